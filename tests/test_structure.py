"""Structure of the compiled train step, read from its HLO with jaxpar.inspect."""

import jax
import pytest

from jaxpar import model
from jaxpar.inspect import analyze
from jaxpar.train.step import lower_step


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_each_gradient_is_reduced_once_per_step(tiny, arch):
    """Data-axis traffic per step (bytes x executions) is one all-reduce of every gradient.

    The reductions of block gradients may sit in the backward layer scan (one per layer, as
    DDP's buckets overlap them with the next layer's backward); what must not happen is more
    than one reduction of any gradient per step.
    """
    cfg = tiny(arch, mesh={"data": 8})
    compiled, mesh = lower_step(cfg)
    report = analyze(compiled, mesh)
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.param_shapes(cfg.model)))
    data_traffic = report.traffic(spans="data")
    # Besides the gradients, only scalars cross the data axis (the loss's partial sum).
    assert grad_bytes <= data_traffic <= grad_bytes + 64, (data_traffic, grad_bytes)
    assert {c.kind for c in report.select(spans="data")} == {"all-reduce"}
    # The block gradients' reductions run once per layer: in the layer loop, n_layers times.
    in_loop = report.select(spans="data", in_loop=True)
    assert in_loop and all(c.executions == cfg.model.n_layers for c in in_loop)


def test_memory_report_counts_replicated_state(tiny):
    """With parameters and Adam moments replicated (ZeRO 0), each device holds all of them."""
    cfg = tiny(mesh={"data": 8})
    compiled, mesh = lower_step(cfg)
    report = analyze(compiled, mesh)
    psi_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.param_shapes(cfg.model)))
    batch_bytes = cfg.train.global_batch // 8 * (cfg.model.seq_len + 1) * 4
    # Arguments: params + two Adam moments (3 x psi bytes), the step counters, the batch shard.
    assert 3 * psi_bytes + batch_bytes <= report.memory.argument_bytes <= 3 * psi_bytes + batch_bytes + 64


# (mesh (data, stage, model), ZeRO stage, microbatches, other parallel keys)
REDUCTION_CASES = [
    ((8, 1, 1), 0, 1, {}),
    ((8, 1, 1), 1, 1, {}),
    ((8, 1, 1), 1, 2, {}),
    ((8, 1, 1), 2, 2, {"zero2_reduce": "microbatch"}),
    ((8, 1, 1), 2, 2, {"zero2_reduce": "step"}),
    ((8, 1, 1), 3, 2, {"zero3_gather": "microbatch"}),
    ((8, 1, 1), 3, 2, {"zero3_gather": "step"}),
    ((4, 2, 1), 1, 2, {}),
    ((4, 2, 1), 2, 2, {"zero2_reduce": "microbatch"}),
    ((4, 2, 1), 3, 2, {"zero3_gather": "microbatch"}),
]


@pytest.mark.parametrize("mesh,zero,micro,extra", REDUCTION_CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-zero{c[1]}-m{c[2]}-{'-'.join(c[3].values()) or 'default'}"
                              for c in REDUCTION_CASES])
def test_reduction_describes_the_compiled_step(tiny, mesh, zero, micro, extra):
    """`gradients.reduction` — the one description of the data-axis policy that the executors, the
    planner and the CLI read — says what the compiled step does: gradients reduced where used
    (`at_use`) have their reductions over `data` inside the step's loops (the layer scan, the
    microbatch or tick loop), the others only after them; ZeRO-3's gathers sit inside the loops
    where it gathers at use and outside them where it gathers once per step. The CLI's sentence
    says which."""
    from jaxpar.parallel.gradients import reduction

    d, p, t = mesh
    cfg = tiny(mesh={"data": d, "stage": p, "model": t}, train={"global_batch": 16},
               parallel={"zero": zero, "microbatches": micro, "zero_min_elements": 1, **extra})
    red = reduction(cfg, d, p)
    compiled, mesh_ = lower_step(cfg)
    report = analyze(compiled, mesh_)
    # Gradient reductions over data (scalars such as the loss's partial sums left out).
    grads = [c for c in report.select(spans="data") if c.kind in ("all-reduce", "reduce-scatter") and c.bytes > 64]
    assert grads
    assert any(c.in_loop for c in grads) == red.at_use, [(c.kind, c.bytes, c.in_loop) for c in grads]
    if red.gather:
        gathers = [c for c in report.select(spans="data", kind="all-gather") if c.bytes > 64]
        assert gathers and any(c.in_loop for c in gathers) == (red.gather == "use")
    text = red.describe()
    assert ("once after" in text) == (not red.at_use), text
    assert ("reduce-scattered" in text) == (zero >= 1), text
