"""Data parallelism computes the same function as one device: loss and gradient norm every step,
gradients, parameters (tests/helpers.py: assert_parity and its tolerances)."""

import pytest

from helpers import assert_parity, run_reference, run_steps

_REFERENCE = {}


def reference(tiny, arch):
    if arch not in _REFERENCE:
        _REFERENCE[arch] = run_reference(tiny(arch))
    return _REFERENCE[arch]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("data", [2, 4, 8])
def test_data_parallel_matches_single_device(tiny, arch, data):
    assert_parity(run_steps(tiny(arch, mesh={"data": data})), reference(tiny, arch))
