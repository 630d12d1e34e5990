"""Rules read off the gradients' reduction plan (`jaxpar.parallel.gradients.Reduction`) by more
than one consumer: the training step (`jaxpar.train.step`, which reads them through `jaxpar.train.optim`) and the
planner (`jaxpar.plan`), so that each asks the same function rather than restating it."""

from __future__ import annotations

from jaxpar.parallel.gradients import reduction


def upcast_at_use(cfg, data: int, stage: int) -> bool:
    """With master weights, whether the float32 upcast of each parameter happens where a layer
    uses it (the per-layer all-reduce of ZeRO-0/1 with one microbatch, data > 1, no pipeline:
    reduced in float32, stored in 16 bits) rather than as a float32 copy of the stored parameters
    that the step differentiates (everywhere else). `jaxpar.train.step` and the planner
    (`jaxpar.plan.memory`) both ask."""
    # ZeRO-1/2 reduce-scatter at use into float32 seeds (`jaxpar.parallel.gradients.Handout`).
    return (cfg.train.master_weights != "none" and cfg.parallel.zero in (0, 1, 2) and stage == 1
            and reduction(cfg, data, stage).at_use)
