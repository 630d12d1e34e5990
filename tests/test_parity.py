"""Data parallelism computes the same function as one device: loss every step, gradients, parameters."""

import numpy as np
import pytest

from helpers import max_abs_diff, run_reference, run_steps

# Tolerances, all float32 rounding: a data-parallel run sums the same per-example terms in another
# order (per-device partial sums, then an all-reduce).
LOSS_RTOL = 1e-5      # a mean of ~100 log-probabilities of size ~4: observed diffs ~1e-7 relative
GRAD_ATOL = 1e-6      # gradients of size 1e-3..1: observed diffs <= 6e-8
# After 3 AdamW steps at lr 1e-2: Adam divides by sqrt(v) + eps, so a rounding difference in a
# gradient element that is itself near zero moves that element's update by up to ~lr x its
# relative difference. Observed <= 6e-6; 5e-5 is 0.5% of one step of size lr, far below any bug
# (a missing or doubled gradient reduction moves parameters by O(lr) = 1e-2).
PARAM_ATOL = 5e-5

_REFERENCE = {}


def reference(tiny, arch):
    if arch not in _REFERENCE:
        _REFERENCE[arch] = run_reference(tiny(arch))
    return _REFERENCE[arch]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("data", [2, 4, 8])
def test_data_parallel_matches_single_device(tiny, arch, data):
    ref = reference(tiny, arch)
    out = run_steps(tiny(arch, mesh={"data": data}))
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=LOSS_RTOL)
    assert max_abs_diff(out["grads"], ref["grads"]) < GRAD_ATOL
    assert max_abs_diff(out["params"], ref["params"]) < PARAM_ATOL
    # The run must actually have moved the parameters, or the comparison above proves nothing.
    assert max_abs_diff(out["params"], reference_init(tiny, arch)) > 1e-3


def reference_init(tiny, arch):
    import jax
    from jaxpar import model
    return jax.device_get(model.init_params(tiny(arch).model, jax.random.key(0)))
