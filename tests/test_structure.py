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
