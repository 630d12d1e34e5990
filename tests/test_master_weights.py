"""`train.master_weights: float32`: bf16 stored parameters, a float32 master copy (and Adam's moments)
in the optimizer state, float32 gradients. Parity of every layout with one device running the same
mode, the master as what the optimizer updates, the config rule, checkpoints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import COMPILER_OPTIONS, run_with_loss_and_grads_compiled
from jaxpar.config import ConfigError, from_dict, validate
from jaxpar.mesh import make_mesh
from jaxpar.train.data import batch_at, make_source
from jaxpar.train.optim import MasterState
from jaxpar.train.step import build

# Tolerances against one device running the same mode. Both runs start from the same bf16
# parameters and compute in bf16; what differs is where partial sums are rounded to bf16: a mesh
# rounds each device's (and each microbatch's, and each model rank's) partial weight gradient and
# partial activation sums to bf16 before adding them (in float32), one device rounds the whole
# sum once. One bf16 rounding is a relative 2^-9 = 0.2%; the measured differences are below.
LOSS_RTOL = 2e-3      # a bf16 forward: the same logits to a few bf16 ulps; measured <= 4e-4
GRAD_NORM_RTOL = 1e-2  # global norm of gradients that agree to ~1% of each leaf's scale; measured <= 2e-3
GRAD_LEAF_TOL = 3e-2   # per leaf, max |difference| / max |reference| (bf16 partial sums); measured <= 1e-2
# The float32 masters after 3 AdamW steps of lr 1e-2: Adam's normalized update moves every element
# by about lr whatever the gradient's size, so an element whose gradient is near zero can take a
# step of the other sign on a mesh: |difference| <= 2 lr per step in the worst case. Measured max.
MASTER_ATOL = 6e-2


def tiny(arch="llama", mesh=(1, 1, 1), steps=3, **parallel):
    return from_dict({
        "model": {"arch": arch, "n_layers": 4, "d_model": 32, "n_heads": 4,
                  "n_kv_heads": 2 if arch == "llama" else None, "d_ff": 64, "vocab_size": 64, "seq_len": 16,
                  "dtype": "bfloat16", "param_dtype": "bfloat16"},
        "mesh": dict(zip(("data", "stage", "model"), mesh)),
        "parallel": {"zero_min_elements": 0, **parallel},
        "train": {"steps": steps, "global_batch": 16, "lr": 1e-2, "warmup_steps": 1, "master_weights": "float32"},
    })


def run(cfg) -> dict:
    return run_with_loss_and_grads_compiled(cfg)  # LLVM optimizations off: the same programs, compiled faster


_REF = {}


def reference(arch):
    if arch not in _REF:
        _REF[arch] = run(tiny(arch))
    return _REF[arch]


LAYOUTS = {
    "8x1x1-zero0": dict(mesh=(8, 1, 1), zero=0),
    "8x1x1-zero1": dict(mesh=(8, 1, 1), zero=1),
    "8x1x1-zero2": dict(mesh=(8, 1, 1), zero=2),
    "8x1x1-zero3": dict(mesh=(8, 1, 1), zero=3),
    "8x1x1-zero1-m2": dict(mesh=(8, 1, 1), zero=1, microbatches=2),
    "2x2x2-zero1-1f1b-sp": dict(mesh=(2, 2, 2), zero=1, microbatches=2, sequence_parallel=True),
    # ZeRO-Offload: the master and Adam's moments in pinned host memory between steps.
    "8x1x1-zero1-offload": dict(mesh=(8, 1, 1), zero=1, offload="optimizer"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_match_one_device_in_the_same_mode(name):
    ref = reference("llama")
    out = run(tiny("llama", **LAYOUTS[name]))
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(out["grad_norms"], ref["grad_norms"], rtol=GRAD_NORM_RTOL)
    flat_ref = jax.tree_util.tree_flatten_with_path(ref["grads"])[0]
    for (path, want), got in zip(flat_ref, jax.tree.leaves(out["grads"]), strict=True):
        assert got.dtype == np.float32, path  # float32 gradients reach the optimizer
        err = float(np.max(np.abs(got - want))) / float(np.max(np.abs(want)))
        assert err <= GRAD_LEAF_TOL, (jax.tree_util.keystr(path), err)
    state = out["state"]
    assert isinstance(state.opt_state, MasterState)
    master, ref_master = state.opt_state.master, ref["state"].opt_state.master
    assert max(float(np.max(np.abs(a - b))) for a, b in
               zip(jax.tree.leaves(master), jax.tree.leaves(ref_master))) <= MASTER_ATOL
    # The stored parameters are the master's bf16 cast, exactly.
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(master)):
        assert p.dtype == jnp.bfloat16 and m.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(jnp.bfloat16)))


def test_the_master_accumulates_updates_below_bf16_resolution():
    """lr 1e-4 moves a norm scale of 1.0 by ~1e-4 per step, under half a bf16 ulp at 1.0 (2^-8 =
    0.0039): the bf16 scale does not move in one step, its float32 master does, and after 100 steps
    the master has moved ~1e-2 and the bf16 scale with it. Without the master (pure bf16
    parameters) every one of those updates rounds away and the scale stays 1.0."""
    def final_scales(master_weights, steps):
        cfg = from_dict({
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "vocab_size": 64,
                      "seq_len": 16, "dtype": "bfloat16", "param_dtype": "bfloat16"},
            "mesh": {"data": 8}, "parallel": {"zero": 1, "zero_min_elements": 0},
            "train": {"steps": steps, "global_batch": 8, "lr": 1e-4, "warmup_steps": 0, "min_lr_ratio": 1.0,
                      "weight_decay": 0.0, "grad_clip": 0.0, "master_weights": master_weights}})
        devices = jax.devices()[:8] if master_weights != "none" else jax.devices()[:1]
        if master_weights == "none":  # one device: the data-parallel bf16 all-reduce does not compile on CPU
            cfg = cfg.replace(mesh={"data": 1}, parallel={"zero": 0})
        program = build(cfg, make_mesh(cfg, devices))
        source = make_source(cfg)
        key = jax.random.key(0)
        # LLVM optimizations off, as the parity runs (helpers.COMPILER_OPTIONS): the same program.
        state = program.init.lower(key).compile(COMPILER_OPTIONS)(key)
        batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(steps)]
        step = program.step.lower(state, batches[0]).compile(COMPILER_OPTIONS)
        seen = []
        for batch in batches:
            state, _ = step(state, batch)
            seen.append(jax.device_get((state.params["final_norm"]["scale"],
                                        getattr(state.opt_state, "master", state.params)["final_norm"]["scale"])))
        return seen

    seen = final_scales("float32", 100)
    bf16_1, master_1 = seen[0]
    assert np.all(np.asarray(bf16_1, np.float32) == 1.0)      # bf16: the update rounded away
    assert np.all(master_1 != 1.0)                           # master: every element moved
    assert np.max(np.abs(master_1 - 1.0)) < 2e-4             # by about lr
    bf16_100, master_100 = seen[-1]
    assert np.max(np.abs(master_100 - 1.0)) > 4e-3           # 100 steps of ~lr add up past half an ulp
    assert np.any(np.asarray(bf16_100, np.float32) != 1.0)   # and the stored bf16 scale follows
    np.testing.assert_array_equal(np.asarray(bf16_100), np.asarray(master_100.astype(jnp.bfloat16)))
    # Pure bf16 parameters (no master): each update is below half an ulp and rounds away.
    plain = final_scales("none", 100)
    assert np.all(np.asarray(plain[-1][0], np.float32) == 1.0)


def test_master_weights_need_16_bit_parameters():
    with pytest.raises(ConfigError, match=r"train.master_weights = float32 needs a 16-bit model.param_dtype"):
        validate(from_dict({"model": {"param_dtype": "float32"}, "train": {"master_weights": "float32"}}))
    validate(from_dict({"model": {"param_dtype": "bfloat16"}, "train": {"master_weights": "float32"}}))


def test_checkpoint_holds_the_master_and_resumes_bit_exact(tmp_path):
    """The master is part of the saved state: a run resumed from step 2 on the same mesh repeats
    steps 3-4 bit for bit, and resumed onto (2, 2, 2) (ZeRO-1, 1F1B, TP) it continues within the
    bf16 parity tolerance (the master restored resharded, not re-derived from the bf16 params)."""
    import jaxpar
    from jaxpar.train import checkpoint as ckpt_lib

    cfg = tiny(mesh=(8, 1, 1), steps=4, zero=1).replace(
        train={"checkpoint_every": 2, "run_dir": str(tmp_path / "a"), "log_every": 1, "async_checkpoint": False})
    want = {r["step"]: r["loss"] for r in jaxpar.train(cfg)}
    assert "MasterState" in ckpt_lib.read_meta(str(tmp_path / "a"), 4)["opt_structure"]
    for name, moved in (("same", cfg), ("2x2x2", cfg.replace(mesh={"data": 2, "stage": 2, "model": 2},
                                                              parallel={"microbatches": 2}))):
        import shutil
        run_dir = tmp_path / name
        shutil.copytree(tmp_path / "a", run_dir)
        shutil.rmtree(run_dir / "checkpoints" / "4")
        history = jaxpar.train(moved.replace(train={"run_dir": str(run_dir)}))
        assert history.resumed_from == 2
        got = {r["step"]: r["loss"] for r in history}
        if name == "same":
            assert got == {s: want[s] for s in (3, 4)}
        else:
            np.testing.assert_allclose([got[3], got[4]], [want[3], want[4]], rtol=LOSS_RTOL)
