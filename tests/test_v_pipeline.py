"""The V-shape schedules (`zb_v`, `dualpipe_v`) run by the executor: parity with one device (loss
each step and gradients), random valid V tables, the hops of the V in the compiled tick, memory
flat in m, and the config refusing what cannot run. (Their tables: tests/test_v_schedules.py.)"""

import re

import jax
import numpy as np
import pytest

from helpers import assert_parity, max_abs_diff, run_reference, run_steps
from jaxpar.config import ConfigError, load_config
from jaxpar.parallel.pipeline.placement import chunk_at, stage_of, stage_order
from test_pipeline import _table_grads, tiny_pp

_REF = {}


def v_cfg(schedule, p, m, arch="llama", **parallel):
    cfg = tiny_pp(arch, p, schedule, m, v=2)
    return cfg.replace(parallel=parallel) if parallel else cfg


def check_parity(cfg):
    """Against the unpipelined step (no remat, one microbatch), one reference per model and batch
    in this module."""
    key = (cfg.model, cfg.train.global_batch)
    if key not in _REF:
        _REF[key] = run_reference(cfg.replace(parallel={"microbatches": 1, "zero": 0, "virtual_stages": 1,
                                                        "remat": "none", "schedule": "1f1b"}))
    assert_parity(run_steps(cfg), _REF[key])


# ---------------------------------------------------------------------------------------------
# The placement rule


@pytest.mark.parametrize("p", [2, 3, 4])
def test_v_placement_is_one_rule(p):
    """Stage s holds chunks s and 2p-1-s; the head's chunk (2p-1) is stage 0's; the stage order
    of the layer slots and the storage permutation are `chunk_at`'s."""
    assert [stage_of(c, p, "v") for c in range(2 * p)] == [*range(p), *reversed(range(p))]
    assert stage_order(p, 2, "v") == [c for s in range(p) for c in (s, 2 * p - 1 - s)]
    assert all(stage_of(chunk_at(s, k, p, "v"), p, "v") == s for s in range(p) for k in range(2))
    assert stage_order(p, 2, "interleaved") == [c for s in range(p) for c in (s, s + p)]


# ---------------------------------------------------------------------------------------------
# Parity with one device

@pytest.mark.parametrize("m", [4, 5])
def test_zb_v_matches_single_device(m):
    check_parity(v_cfg("zb_v", 2, m))


@pytest.mark.parametrize("m", [4, 5])
def test_dualpipe_v_matches_single_device(m):
    check_parity(v_cfg("dualpipe_v", 2, m))


@pytest.mark.slow
@pytest.mark.parametrize("schedule, m", [("zb_v", 8), ("zb_v", 9), ("dualpipe_v", 8), ("dualpipe_v", 9)])
def test_v_schedules_on_four_stages_match_single_device(schedule, m):
    check_parity(v_cfg(schedule, 4, m))


# ---------------------------------------------------------------------------------------------
# Bad input, refused when the config loads (before anything compiles)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.schedule=zb_v", "mesh.stage=2"], "parallel.virtual_stages = 1 does not fit parallel.schedule = "
                                                 "zb_v, whose V places exactly two chunks on every stage (s and "
                                                 "2p-1-s); set parallel.virtual_stages=2."),
    (["parallel.schedule=dualpipe_v", "mesh.stage=2", "parallel.virtual_stages=3", "model.n_layers=12"],
     "parallel.virtual_stages = 3 does not fit parallel.schedule = dualpipe_v"),
    (["parallel.schedule=zb_v", "mesh.stage=4", "parallel.virtual_stages=2", "model.n_layers=6"],
     "model.n_layers = 6 is fewer than the 2 x mesh.stage = 8 chunks of parallel.schedule = zb_v (its V needs a "
     "layer in each chunk); use at least 8 layers, or mesh.stage=3."),
])
def test_v_schedules_bad_input_is_refused_in_one_sentence(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        load_config(None, ["parallel.microbatches=8", *overrides])
    assert str(err.value).count(". ") == 0, err.value  # one sentence


def test_v_schedules_are_accepted_with_two_chunks_per_stage():
    for schedule in ("zb_v", "dualpipe_v"):
        cfg = load_config(None, [f"parallel.schedule={schedule}", "mesh.stage=2", "parallel.virtual_stages=2",
                                 "model.n_layers=4", "parallel.microbatches=4", "train.global_batch=8"])
        assert cfg.parallel.schedule == schedule
