"""The planner: will a model fit, and which layout trains it fastest (`python -m jaxpar.plan`)?

A layer above the model and the parallel strategies, which it reads and never changes: the cost
model of one config on one mesh shape, without devices, in `memory` (per-device memory by part;
`activations`: what JAX saves for the backward pass; `moe`: the mixture-of-experts terms),
`collectives` (the collectives of a step and their bytes per mesh axis) and `steptime` (hardware
FLOPs, the calibrated compute, the roofline step time); `search` enumerates and ranks every valid
layout with it; `presets` holds the model presets (the hardware ones are `jaxpar.hardware`);
`report` and `command` are what the command prints and its arguments. DESIGN.md §6 states the
model; `tests/test_plan.py` holds it to the compiled step.
"""

# (_write_config, _describe and _human: the tests and benchmarks read them here.)
from jaxpar.plan.command import _write_config, main, parse_bytes  # noqa: F401
from jaxpar.plan.report import _describe, _human  # noqa: F401
from jaxpar.plan.search import (Estimate, Plan, candidates, estimate, evaluate, layout_shape, memory_wall, plan,
                                stage_split, to_json)
from jaxpar.plan.steptime import Roofline

__all__ = ["Estimate", "Plan", "Roofline", "candidates", "estimate", "evaluate", "layout_shape", "main", "memory_wall",
           "parse_bytes", "plan", "stage_split", "to_json"]
