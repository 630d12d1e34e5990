"""Research code: a block registered by name (examples/custom_block.py) runs under every strategy."""

import os
import runpy

import pytest

from helpers import assert_parity, run_reference, run_steps
from jaxpar.config import ConfigError
from jaxpar.train.step import build

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "custom_block.py")


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(EXAMPLE)  # registers the "parallel" block (not run as __main__)


def test_registered_block_matches_one_device_on_a_3d_mesh(example):
    cfg = example["config"]((2, 2, 2)).replace(train={"steps": 3})
    got, want = run_steps(cfg), run_reference(cfg)
    assert_parity(got, want)
    # It is the example's block: one norm per layer, no attn_norm / mlp_norm.
    assert set(got["params"]["blocks"]) == {"norm", "attn", "mlp"}


def test_unknown_block_is_named(tiny):
    with pytest.raises(ConfigError, match=r"model.block = 'nope' is not a registered block \(registered: .*pre_norm"):
        build(tiny(model={"block": "nope"}, mesh={"data": 8}))
