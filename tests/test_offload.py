"""ZeRO-Offload (`parallel.offload: optimizer`): the optimizer state lives in pinned host memory
between steps. Parity with one device, the device's share of the compiled step's arguments
falling by exactly the moments' bytes, a checkpoint round trip, and the refusals."""

import shutil
import types

import jax
import numpy as np
import pytest

import jaxpar
from helpers import COMPILER_OPTIONS, assert_parity, run_reference, run_steps
from jaxpar.config import ConfigError
from jaxpar.inspect import analyze
from jaxpar.mesh import make_mesh
from jaxpar.parallel.zero import state_bytes
from jaxpar.train.step import build, check_host_memory

_REF = {}


@pytest.mark.parametrize("arch, mesh, par", [
    ("llama", (8, 1, 1), dict(zero=0)),
    ("llama", (8, 1, 1), dict(zero=1)),
    ("gpt2", (4, 1, 2), dict(zero=3, zero_min_elements=0, microbatches=2)),
    ("llama", (2, 2, 2), dict(zero=2, schedule="1f1b", microbatches=2)),
])
def test_offloaded_optimizer_matches_single_device(tiny, arch, mesh, par):
    """Every ZeRO stage (float32 parameters); with float32 master weights: tests/test_master_weights.py
    (its `offload` layout, at its bf16 tolerances: bf16 runs cannot match one device exactly)."""
    cfg = tiny(arch, mesh=dict(zip(("data", "stage", "model"), mesh)), parallel=dict(offload="optimizer", **par))
    if arch not in _REF:
        _REF[arch] = run_reference(cfg.replace(parallel={"offload": "none", "schedule": "1f1b"}))
    assert_parity(run_steps(cfg), _REF[arch])


def moments(cfg):
    return cfg.replace(model={"n_layers": 2, "d_model": 128, "d_ff": 384, "vocab_size": 256, "seq_len": 32},
                       train={"global_batch": 8})


@pytest.mark.parametrize("zero, master", [(1, False), (3, True)])
def test_device_arguments_fall_by_the_moments_bytes(tiny, zero, master):
    """From the compiled step on (4, 1, 1): the arguments the entry layout places in host memory are
    Adam's two moments (and the float32 master) exactly, on their ZeRO layout; the device keeps
    the rest. Without the feature nothing is in host memory."""
    base = moments(tiny(mesh={"data": 4}, parallel={"zero": zero}))
    if master:
        base = base.replace(model={"param_dtype": "bfloat16", "dtype": "bfloat16"}, train={"master_weights": "float32"})
    mesh = make_mesh(base, jax.devices()[:4])
    got = {}
    for offload in ("none", "optimizer"):
        program = build(base.replace(parallel={"offload": offload}), mesh)
        compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile(COMPILER_OPTIONS)
        got[offload] = analyze(compiled, mesh).memory
    shapes = jax.eval_shape(program.init, jax.random.key(0)).params
    # Adam's two moments, and the master: float32, on the moments' layout, per device.
    per_param = 3 if master else 2
    opt = state_bytes(program.layout, jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32), shapes),
                      mesh, moments_per_param=per_param)["optimizer"]["per_device"]
    off, on = got["none"], got["optimizer"]
    assert off.host_argument_bytes == 0
    assert on.host_argument_bytes == opt, (on, opt)
    if jax.default_backend() == "cpu":
        # XLA:CPU's accounting, not the feature's: it counts the host arguments among its
        # arguments (other backends may not), so the total is unchanged only there.
        assert on.argument_bytes == off.argument_bytes
    assert (off.argument_bytes - off.host_argument_bytes) - (on.argument_bytes - on.host_argument_bytes) == opt


def test_state_lives_in_host_memory_and_checkpoints_round_trip(tiny, tmp_path):
    cfg = tiny(mesh={"data": 8}, parallel={"zero": 1, "offload": "optimizer", "zero_min_elements": 0},
               train={"steps": 4, "checkpoint_every": 2, "run_dir": str(tmp_path / "a")})
    program = build(cfg)
    state = program.init(jax.random.key(0))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state) if x.ndim}
    assert kinds == {"pinned_host"}, kinds
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    full = {r["step"]: r["loss"] for r in jaxpar.train(cfg)}
    # Resume from step 2 (its checkpoint) into the same run: the same losses, bit for bit.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
    history = jaxpar.train(cfg.replace(train={"run_dir": str(tmp_path / "b")}))
    assert history.resumed_from == 2
    for r in history:
        assert r["loss"] == full[r["step"]], (r, full)


def test_offload_is_refused_with_naive_data_parallelism(tiny):
    with pytest.raises(ConfigError, match=r"parallel.offload = optimizer cannot be combined with "
                                          r"parallel.data_mode = naive.*set parallel.offload=none"):
        build(tiny(parallel={"data_mode": "naive", "offload": "optimizer"}))


def test_offload_is_refused_without_pinned_host_memory(tiny):
    device = types.SimpleNamespace(platform="neuron", addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
    with pytest.raises(ConfigError, match=r"parallel.offload = optimizer needs pinned_host memory.*"
                                          r"set parallel.offload=none"):
        check_host_memory(tiny(parallel={"offload": "optimizer"}), device)


def test_planner_moves_the_optimizer_state_to_the_host(tiny):
    from jaxpar import costs

    cfg = moments(tiny(mesh={"data": 4}, parallel={"zero": 1}))
    on = cfg.replace(parallel={"offload": "optimizer"})
    off_gpu, on_gpu = costs.memory(cfg, (4, 1, 1), "gpu"), costs.memory(on, (4, 1, 1), "gpu")
    assert on_gpu["host_optimizer"] == off_gpu["optimizer"] > 0 and on_gpu["optimizer"] == 0
    assert on_gpu["total"] == off_gpu["total"] - off_gpu["optimizer"]
    assert costs.memory(on, (4, 1, 1), "cpu")["total"] == costs.memory(cfg, (4, 1, 1), "cpu")["total"]
