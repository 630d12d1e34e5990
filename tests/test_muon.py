"""Muon (`train.optimizer: muon`, `jaxpar.train.muon`): the Newton-Schulz iteration and its scale
against a direct float64 computation of the published algorithm, per logical matrix; the one rule
of which leaves Muon takes; the whole update against a direct computation; parity with one
device (data 8 with ZeRO-1 and ZeRO-3 here, TP + SP, ZeRO-2, a 1F1B pipeline and MoE with expert
parallelism in the slow tier); checkpoints (the refusal, train.reset_optimizer, resuming Muon's
state); the planner's optimizer bytes; bad values."""

from __future__ import annotations

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

import jaxpar
from helpers import assert_parity, max_abs_diff, run_with_loss_and_grads_compiled
from jaxpar import model
from jaxpar.config import ConfigError, from_dict, validate
from jaxpar.mesh import make_mesh
from jaxpar.train import muon as muon_lib
from jaxpar.train.checkpoint import CheckpointError, saved_steps
from jaxpar.train import optim as optim_lib, step as step_lib
from jaxpar.train.optim import decay_mask

A, B, C = 3.4445, -4.7750, 2.0315  # Moonlight's / Kimi K2's quintic


def newton_schulz(g: np.ndarray, steps: int = 5, eps: float = 1e-7) -> np.ndarray:
    """The published algorithm on one matrix, in float64: normalise by the Frobenius norm, iterate
    X <- a X + (b A + c A A) X with A = X X^T on the wide orientation, times 0.2 sqrt(max(m, n))."""
    x = np.asarray(g, np.float64)
    x = x / (np.linalg.norm(x) + eps)
    wide = x.shape[0] > x.shape[1]
    if wide:
        x = x.T
    for _ in range(steps):
        a = x @ x.T
        x = A * x + (B * a + C * a @ a) @ x
    if wide:
        x = x.T
    return x * 0.2 * np.sqrt(max(g.shape))


def ortho(x, names, dtype=jnp.float32) -> np.ndarray:
    return np.asarray(jax.jit(lambda u: muon_lib.orthogonalize(u, names, dtype))(jnp.asarray(x, jnp.float32)))


def test_newton_schulz_and_scale_against_the_published_algorithm():
    rng = np.random.default_rng(0)
    for shape in [(24, 40), (40, 24)]:  # both orientations
        g = rng.standard_normal(shape)
        want = newton_schulz(g)
        got = ortho(g, ("embed", "mlp"))
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
        # It orthogonalizes: singular values in the quintic's band around 1, before the scale.
        sv = np.linalg.svd(got / (0.2 * np.sqrt(max(shape))), compute_uv=False)
        assert 0.5 < sv.min() and sv.max() < 1.3
        # bfloat16 (train.muon_ns_dtype): the same to bf16 rounding, and not float32's result.
        half = ortho(g, ("embed", "mlp"), jnp.bfloat16)
        rel = np.linalg.norm(half - want) / np.linalg.norm(want)
        assert 1e-3 < rel < 0.1, rel


def test_each_logical_matrix_is_orthogonalized_on_its_own():
    rng = np.random.default_rng(1)
    # Stacked layers [layers, m, n]: per layer, not as one [layers * m, n] matrix.
    g = rng.standard_normal((3, 8, 12))
    got = ortho(g, ("layers", "embed", "mlp"))
    for layer in range(3):
        np.testing.assert_allclose(got[layer], newton_schulz(g[layer]), atol=1e-4)
    whole = newton_schulz(g.reshape(24, 12)).reshape(3, 8, 12)
    assert np.abs(got - whole).max() > 0.1
    # Stacked experts [layers, experts, in, out]: per (layer, expert).
    g = rng.standard_normal((2, 3, 8, 12))
    got = ortho(g, ("layers", "experts", "embed", "expert_mlp"))
    for i in range(2):
        for e in range(3):
            np.testing.assert_allclose(got[i, e], newton_schulz(g[i, e]), atol=1e-4)
    # A projection with a heads dim: its input dims x its output dims, the heads on their side.
    g = rng.standard_normal((8, 2, 6))  # wq [D, N, H] -> [D, N*H]
    np.testing.assert_allclose(ortho(g, ("embed", "heads", "head_dim")),
                               newton_schulz(g.reshape(8, 12)).reshape(8, 2, 6), atol=1e-4)
    g = rng.standard_normal((2, 6, 8))  # wo [N, H, D] -> [N*H, D]
    np.testing.assert_allclose(ortho(g, ("heads", "head_dim", "embed")),
                               newton_schulz(g.reshape(12, 8)).reshape(2, 6, 8), atol=1e-4)


def _names(**model_keys):
    cfg = from_dict({"model": {"arch": "llama", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2,
                               "d_ff": 64, "vocab_size": 64, "seq_len": 16, **model_keys}})
    validate(cfg)
    flat = jax.tree_util.tree_leaves_with_path(model.param_names(cfg.model), is_leaf=lambda x: isinstance(x, tuple))
    return {".".join(str(k.key) for k in path): names for path, names in flat}


def _muon_set(names: dict) -> set[str]:
    return {k for k, n in names.items() if muon_lib.takes_muon(n)}


def test_which_leaves_take_muon():
    names = _names()  # llama: the attention and MLP matrices; embeddings, head and norms stay AdamW
    assert _muon_set(names) == {f"blocks.attn.{w}" for w in ("wq", "wk", "wv", "wo")} | {
        f"blocks.mlp.{w}" for w in ("w_gate", "w_up", "w_down")}
    assert muon_lib.matrix_axes(names["blocks.attn.wq"]) == ((1,), (2, 3))  # [L, D | N, H]
    assert muon_lib.matrix_axes(names["blocks.attn.wo"]) == ((1, 2), (3,))  # [L, N, H | D]
    # MoE (sigmoid_bias router, a shared expert), MLA and an MTP module.
    names = _names(n_experts=4, experts_per_token=2, expert_d_ff=32, router="sigmoid_bias", n_shared_experts=1,
                   n_kv_heads=None, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                   v_head_dim=8, mtp_depth=1)
    matrices = {f"attn.{w}" for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")} | {
        f"mlp.{w}" for w in ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")}
    want = {f"blocks.{w}" for w in matrices} | {f"mtp.blocks.{w}" for w in matrices} | {"mtp.eh_proj"}
    assert _muon_set(names) == want
    adamw = set(names) - want  # embeddings, head, norms, routers with their bias and report, MTP's report
    assert {"embed", "lm_head", "final_norm.scale", "blocks.mlp.router", "blocks.mlp.router_bias",
            "blocks.mlp.router_stats", "blocks.attn.kv_norm", "mtp.report", "mtp.enorm"} <= adamw
    assert muon_lib.matrix_axes(names["blocks.attn.wkv_b"]) == ((1,), (2, 3))  # [L, r | N, dn + dv]
    assert muon_lib.matrix_axes(names["blocks.mlp.w_down"]) == ((2,), (3,))  # [L, E, F | D] per expert
    # gpt2: biases with a heads dim, the position embedding: AdamW.
    names = _names(arch="gpt2", n_kv_heads=None)
    assert {"blocks.attn.bq", "blocks.attn.bk", "pos_embed", "embed"}.isdisjoint(_muon_set(names))
    assert "blocks.mlp.w_up" in _muon_set(names)


def test_the_update_against_a_direct_computation():
    """Two steps of the optimizer on a small tree against numpy: Nesterov momentum, Newton-Schulz
    per layer with its scale, decoupled weight decay, the learning rate; AdamW's leaves get
    exactly optax.adamw's update."""
    names = {"w": ("layers", "embed", "mlp"), "norm": ("layers", "embed"), "embed": ("vocab", "embed")}
    rng = np.random.default_rng(2)
    params = {"w": rng.standard_normal((2, 6, 10)), "norm": rng.standard_normal((2, 6)),
              "embed": rng.standard_normal((12, 6))}
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params) for _ in range(2)]
    lr, mom, wd = 0.1, 0.9, 0.1
    opt = muon_lib.muon(lr, names, momentum=mom, weight_decay=wd, decay_mask=decay_mask(names))
    adamw = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=wd, mask=decay_mask(names))
    state, astate, p, ap = opt.init(params), adamw.init(params), params, params
    assert state.nu["w"].size == 0 and state.mu["w"].shape == (2, 6, 10)  # one momentum on Muon's leaves
    buf = np.zeros((2, 6, 10))
    want = np.asarray(params["w"], np.float64)
    for g in grads:
        u, state = jax.jit(opt.update)(g, state, p)
        au, astate = jax.jit(adamw.update)(g, astate, ap)
        p, ap = optax.apply_updates(p, u), optax.apply_updates(ap, au)
        gw = np.asarray(g["w"], np.float64)
        buf = mom * buf + gw
        nesterov = gw + mom * buf
        want = want - lr * (np.stack([newton_schulz(nesterov[i]) for i in range(2)]) + wd * want)
        np.testing.assert_allclose(np.asarray(p["w"]), want, atol=1e-5)
        for k in ("norm", "embed"):
            np.testing.assert_array_equal(np.asarray(p[k]), np.asarray(ap[k]))


# ------------------------------------------------------------------ parity with one device


def tiny(mesh=(1, 1, 1), model_keys=None, **parallel):
    return from_dict({
        "model": {"arch": "llama", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
                  "vocab_size": 64, "seq_len": 16, **(model_keys or {})},
        "mesh": dict(zip(("data", "stage", "model"), mesh)),
        "parallel": {"zero_min_elements": 0, **parallel},
        "train": {"steps": 3, "global_batch": 8, "lr": 1e-2, "warmup_steps": 1, "log_every": 1, "optimizer": "muon"}})


MOE = {"n_layers": 4, "n_experts": 8, "experts_per_token": 2, "expert_d_ff": 32, "router_aux_loss": 0.01}
_REF: dict = {}


def run(cfg) -> dict:
    """Losses and gradient norms of every step, the gradients at the initial parameters (from
    `loss_and_grads`: Muon's momentum is not Adam's first moment) and the final parameters."""
    out = run_with_loss_and_grads_compiled(cfg)
    out["skipped"] = int(out["state"].skipped)
    return out


def reference(model_keys=None) -> dict:
    key = tuple(sorted((model_keys or {}).items()))
    if key not in _REF:
        cfg = tiny(model_keys=model_keys)
        _REF[key] = run(cfg)
        _REF[key]["init"] = jax.device_get(model.init_params(cfg.model, jax.random.key(cfg.train.seed)))
    return _REF[key]


def check_parity(cfg, model_keys=None):
    ref = reference(model_keys)
    out = run(cfg)
    assert_parity(out, ref)


@pytest.mark.parametrize("zero", [1, 3])
def test_parity_data_8(zero):
    check_parity(tiny((8, 1, 1), zero=zero))


SLOW = {
    "tp2-sp-zero1": (dict(mesh=(4, 1, 2), zero=1, sequence_parallel=True), None),
    "tp4-sp-zero1": (dict(mesh=(2, 1, 4), zero=1, sequence_parallel=True), None),
    "data8-zero0": (dict(mesh=(8, 1, 1), zero=0), None),
    "data8-zero2": (dict(mesh=(8, 1, 1), zero=2), None),
    "data8-naive": (dict(mesh=(8, 1, 1), data_mode="naive"), None),
    "1f1b-2x2x2-zero1": (dict(mesh=(2, 2, 2), zero=1, schedule="1f1b", microbatches=2), None),
    "moe-ep4-tp2": (dict(mesh=(4, 1, 2), zero=1, sequence_parallel=True), MOE),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_parity_slow(name):
    parallel, model_keys = SLOW[name]
    parallel = dict(parallel)
    check_parity(tiny(parallel.pop("mesh"), model_keys, **parallel), model_keys)


@pytest.mark.slow
def test_master_weights_and_optimizer_offload():
    """bf16 parameters with a float32 master (train.master_weights) and the optimizer state in
    host memory (parallel.offload: optimizer) on data 8 ZeRO-1, against one device with the
    master: the same losses and masters to bf16 rounding (the gradients are summed in bf16 on
    another order: measured loss 9e-6 relative, master 8.4e-4 after 3 steps of lr 1e-2)."""
    def cfg(mesh, **parallel):
        return tiny(mesh, {"dtype": "bfloat16", "param_dtype": "bfloat16"}, **parallel).replace(
            train={"master_weights": "float32"})

    ref = run_with_loss_and_grads_compiled(cfg((1, 1, 1)))
    out = run_with_loss_and_grads_compiled(cfg((8, 1, 1), zero=1, offload="optimizer"))
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=2e-3)
    state = ref["state"].opt_state
    assert isinstance(state.inner[1], muon_lib.MuonState) and state.inner[1].nu["blocks"]["attn"]["wq"].size == 0
    init = jax.device_get(model.init_params(cfg((1, 1, 1)).model, jax.random.key(0)))
    assert max_abs_diff(state.master, jax.tree.map(lambda x: np.asarray(x, np.float32), init)) > 1e-2
    assert max_abs_diff(out["state"].opt_state.master, state.master) < 5e-3


# ------------------------------------------------------------------ the distributed cost


def _cost_cfg(zero: int, optimizer: str):
    """docs/muon.md's measured llama (4 layers, d_model 128, d_ff 384) on data 8."""
    return from_dict({"model": {"arch": "llama", "n_layers": 4, "d_model": 128, "n_heads": 4, "n_kv_heads": 2,
                                "d_ff": 384, "vocab_size": 256, "seq_len": 128},
                      "mesh": {"data": 8, "stage": 1, "model": 1}, "parallel": {"zero": zero},
                      "train": {"global_batch": 16, "optimizer": optimizer}})


def _step_cost(cfg) -> tuple[float, int, int, int]:
    """FLOPs per device (all, and of the dots), bytes of the collectives that span `data` (per
    device, per step) and temporaries per device, of the compiled train step."""
    from jaxpar.inspect import analyze, dot_flops

    compiled, mesh = step_lib.lower_step(cfg, make_mesh(cfg))
    cost = compiled.cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    return (flops, dot_flops(compiled.as_text())[0], analyze(compiled, mesh).traffic(spans="data"),
            compiled.memory_analysis().temp_size_in_bytes)


# Newton-Schulz of the whole model, counted (5 x (4 a^2 b + 2 a^3) per matrix [a <= b]: 12 MLP
# matrices 128 x 384, 8 of 128 x 128 (wq, wo), 8 of 64 x 128 (wk, wv)), over 8 ranks.
NS_TOTAL = 5 * (12 * (4 * 128 ** 2 * 384 + 2 * 128 ** 3) + 8 * 6 * 128 ** 3 + 8 * (4 * 64 ** 2 * 128 + 2 * 64 ** 3))


def check_cost(zero: int):
    """Each logical matrix orthogonalized whole on one owning rank (`orthogonalize_owned`), from
    the compiled step on data 8 against AdamW's at the same ZeRO stage and ZeRO-1 AdamW's bytes
    (docs/muon.md's table). FLOPs per device: the matrix products 1.248x total/8 at every stage
    (the 12 MLP matrices over 8 ranks make 2 on every rank, padding included); all FLOPs
    (`cost_analysis`, Muon's step minus AdamW's) 1.246x at ZeRO-0 and 1.275x at ZeRO-1/3, the
    iterations' elementwise work added (at ZeRO-0 AdamW's own elementwise work on its replicated
    moments, which Muon's leaves do not do, is subtracted). Bytes over `data`: 1.91x ZeRO-1 AdamW's at ZeRO-0,
    1.28x at ZeRO-1, 2.10x at ZeRO-3 (where AdamW's own step is 1.82x, its parameter gathers: Muon
    adds 1.08 MB, one all-to-all, over AdamW at each sharded stage). Without the owners: 8.04x
    FLOPs (ZeRO-0), 1.32x with 9.7x AdamW's bytes (ZeRO-1), which these bounds refuse."""
    adam, adam_dots, adam_bytes, adam_temp = _step_cost(_cost_cfg(zero, "adamw"))
    flops, dots, data_bytes, temp = _step_cost(_cost_cfg(zero, "muon"))
    zero1_adam_bytes = adam_bytes if zero == 1 else _step_cost(_cost_cfg(1, "adamw"))[2]
    # The matrix products: 2 MLP matrices, one 128 x 128 and one 64 x 128 on every rank, exactly.
    assert dots - adam_dots == 5 * (2 * (4 * 128 ** 2 * 384 + 2 * 128 ** 3) + 6 * 128 ** 3
                                    + 4 * 64 ** 2 * 128 + 2 * 64 ** 3), dots - adam_dots
    assert (dots - adam_dots) / (NS_TOTAL / 8) <= 1.25
    ratio = (flops - adam) / (NS_TOTAL / 8)
    assert 1.2 < ratio < 1.29, ratio
    # At most 2x ZeRO-1 AdamW's, or 2x AdamW's at the same stage where that is more (ZeRO-3).
    assert data_bytes <= 2 * max(zero1_adam_bytes, adam_bytes), (data_bytes, zero1_adam_bytes, adam_bytes)
    if zero:
        assert data_bytes - adam_bytes < 0.4 * zero1_adam_bytes, (data_bytes, adam_bytes)
    # Temporaries within 1 KiB of AdamW's (the optimizer state is 0.54x AdamW's: one momentum).
    assert temp <= adam_temp + 1024, (temp, adam_temp)
    # The planner's owners' traffic (`muon_collectives`, from `muon.deal`) is what Muon adds.
    assert _planned_extra(zero, (8, 1, 1))["data"] == data_bytes - adam_bytes


def _planned_extra(zero: int, mesh: tuple[int, int, int]) -> dict[str, float]:
    """What the planner says Muon's step adds to AdamW's bytes on each axis."""
    from jaxpar.plan.collectives import bytes_per_axis

    cfg = _cost_cfg(zero, "muon").replace(mesh=dict(zip(("data", "stage", "model"), mesh)))
    muon, adam = bytes_per_axis(cfg, mesh), bytes_per_axis(cfg.replace(train={"optimizer": "adamw"}), mesh)
    return {a: muon[a] - adam[a] for a in muon}


def test_newton_schulz_on_owning_ranks_zero1():
    check_cost(1)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_newton_schulz_on_owning_ranks(zero):
    check_cost(zero)


def test_owned_matrices_pad_and_come_back():
    """`orthogonalize_owned` on 8 devices against `orthogonalize` per leaf: leaves of one matrix
    shape stacked together (one transposed), a count the ranks do not divide (zero matrices
    padded in: they orthogonalize to zeros), a heads dim."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(3)
    names = [("layers", "embed", "mlp"), ("layers", "mlp", "embed"), ("layers", "embed", "heads", "head_dim"),
             ("experts", "embed", "expert_mlp")]
    us = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(3, 8, 12), (2, 12, 8), (3, 8, 2, 3), (5, 8, 4)]]
    got = jax.jit(lambda us: muon_lib.orthogonalize_owned(us, names, mesh, ("data",)))(us)
    for g, u, n in zip(got, us, names):
        assert g.shape == u.shape
        np.testing.assert_allclose(np.asarray(g), ortho(u, n), atol=1e-5)
    zeros = jax.jit(lambda x: muon_lib.orthogonalize_owned([x], names[:1], mesh, ("data",)))(jnp.zeros((3, 8, 12)))
    assert np.abs(np.asarray(zeros[0])).max() == 0
    assert muon_lib.owner_axes(None) == () and muon_lib.owner_axes(make_mesh(tiny(), jax.devices()[:1])) == ()


def test_owned_per_stage_with_the_states_layout():
    """`orthogonalize_owned` with the state's layout on a (2, 2, 2) mesh against `orthogonalize`
    per leaf: `layers` stacks sharded over `stage` dealt within their stage, a square matrix laid
    out the other way round (wo against wq: stacked transposed), a leaf moved to its stack's layout
    (w_down's b over data), a leaf not on `stage` (MTP's) dealt over every rank."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "stage", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    rng = np.random.default_rng(5)
    names = [("layers", "embed", "mlp"), ("layers", "mlp", "embed"), ("layers", "embed", "heads", "head_dim"),
             ("layers", "heads", "head_dim", "embed"), ("mtp", "embed", "mlp")]
    specs = [P("stage", "data", "model"), P("stage", "data", "model"), P("stage", "data", "model", None),
             P("stage", "model", None, "data"), P(None, "data", "model")]
    shapes = [(4, 8, 16), (4, 16, 8), (4, 8, 2, 4), (4, 2, 4, 8), (3, 8, 16)]
    us = [jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32), NamedSharding(mesh, sp))
          for s, sp in zip(shapes, specs)]
    step = jax.jit(lambda us: muon_lib.orthogonalize_owned(us, names, mesh, ("data", "stage", "model"), specs=specs))
    for g, u, n, sp in zip(step(us), us, names, specs):
        assert g.shape == u.shape and g.sharding.is_equivalent_to(NamedSharding(mesh, sp), g.ndim)
        np.testing.assert_allclose(np.asarray(g), ortho(u, n), atol=1e-5)


def _mesh_cost_cfg(mesh: tuple[int, int, int], optimizer: str):
    return _cost_cfg(1, optimizer).replace(mesh=dict(zip(("data", "stage", "model"), mesh)),
                                           parallel={"schedule": "1f1b", "microbatches": 1 + (mesh[1] > 1)})


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(2, 2, 2)])  # (4, 1, 2) measured alike (docs/muon.md); one mesh for CI time
def test_owners_per_stage_and_over_tensor_parallelism(mesh):
    """From the compiled ZeRO-1 step: each rank runs the deal's Newton-Schulz FLOPs
    (`muon.deal`: whole matrices, a pipeline's layers dealt within their stage), the same 1.248x
    total/8 as on data 8; the momentum moves to its owners and back over `data` and `model` only,
    one axis at a time (exactly 2 x the owned bytes over each, AdamW's bytes otherwise) and never
    over `stage`. Dealt over every axis at once (before), the (2, 2, 2) step moved 7.5 MB more over
    `stage` and replicated its stacks (XLA's involuntary rematerialization)."""
    from jaxpar.inspect import analyze, dot_flops

    def cost(optimizer):
        cfg = _mesh_cost_cfg(mesh, optimizer)
        compiled, m = step_lib.lower_step(cfg, make_mesh(cfg))
        report = analyze(compiled, m)
        return dot_flops(compiled.as_text())[0], {a: report.traffic(spans=a) for a in ("data", "stage", "model")}

    adam_dots, adam_bytes = cost("adamw")
    dots, axis_bytes = cost("muon")
    cfg = _cost_cfg(1, "muon")
    d = muon_lib.deal(model.param_shapes(cfg.model), model.param_names(cfg.model), 8, mesh[1])
    assert dots - adam_dots == d.flops and d.flops / (NS_TOTAL / 8) <= 1.25, (dots - adam_dots, d)
    moved = {"data": 2 * 4 * d.owned, "stage": 0, "model": 2 * 4 * d.owned}
    assert {a: axis_bytes[a] - adam_bytes[a] for a in moved} == moved, (axis_bytes, adam_bytes)
    assert _planned_extra(1, mesh) == moved


# ------------------------------------------------------------------ checkpoints, planner, config


def test_checkpoint_refusal_reset_and_muons_state(tmp_path, caplog):
    """Without compiling a step: AdamW's checkpoint is refused by a Muon config in one sentence;
    with train.reset_optimizer it restores its parameters and step and a fresh Muon state (one log
    line); Muon's state (its empty second moments included, ZeRO-1 over 2 devices) restores equal."""
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.step import build

    def program(cfg):
        return build(cfg, make_mesh(cfg, jax.devices()[:2]))

    def save(cfg, state):
        ckpt = Checkpoints(cfg)
        ckpt.save(state, make_mesh(cfg, jax.devices()[:2]))
        ckpt.close()

    def moved(tree):  # non-zero state, so that restoring it is seen
        return jax.tree.map(lambda x: x + 0.5 if x.ndim else x, tree)

    run_dir = str(tmp_path / "r")
    adam = tiny((2, 1, 1), zero=1).replace(train={"optimizer": "adamw", "run_dir": run_dir, "async_checkpoint": False})
    muon = adam.replace(train={"optimizer": "muon"})
    a = program(adam)
    state = a.init(jax.random.key(0))
    state = state._replace(step=state.step + 7, params=moved(state.params), opt_state=moved(state.opt_state))
    save(adam, state)
    m = program(muon)
    with pytest.raises(CheckpointError, match=r"was saved with train\.optimizer = adamw, but this config trains "
                                              r"with train\.optimizer = muon; resume with train\.optimizer=adamw, or "
                                              r"set train\.reset_optimizer=true to keep its parameters and step and "
                                              r"start a fresh muon state\.$"):
        Checkpoints(muon).candidate(m)
    reset = muon.replace(train={"reset_optimizer": True})
    with caplog.at_level(logging.INFO, logger="jaxpar"):
        ckpt = Checkpoints(reset)
        restored, step = ckpt.restore(m, ckpt.candidate(m))
    lines = [r.getMessage() for r in caplog.records if "train.reset_optimizer" in r.getMessage()]
    assert len(lines) == 1 and "holds adamw optimizer state" in lines[0] and "fresh optimizer state" in lines[0]
    assert step == 7 and int(restored.step) == 7
    assert max_abs_diff(jax.device_get(restored.params), jax.device_get(state.params)) == 0
    fresh = jax.device_get(m.init(jax.random.key(0)).opt_state)
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(fresh)
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(jax.device_get(restored.opt_state)) if x.size) == 0
    # Muon's own state: saved without its empty arrays, restored equal with them, on its shardings.
    state = restored._replace(step=restored.step + 1, opt_state=moved(restored.opt_state))
    save(muon, state)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxpar"):
        again, step = Checkpoints(reset).restore(m, 8)
    assert step == 8 and not any("fresh optimizer state" in r.getMessage() for r in caplog.records)
    for x, y in zip(jax.tree.leaves(jax.device_get(again.opt_state)), jax.tree.leaves(jax.device_get(state.opt_state)),
                    strict=True):
        np.testing.assert_array_equal(x, y)
        assert x.shape == y.shape
    assert again.opt_state[1].nu["blocks"]["attn"]["wq"].shape == (0, 0, 0, 0)
    assert jax.tree.map(lambda x: x.sharding, again.opt_state) == m.state_shardings.opt_state


@pytest.mark.slow
def test_checkpoints_refuse_the_other_optimizer_and_reset_on_purpose(tmp_path, caplog):
    """AdamW's checkpoint is refused by a Muon config in one sentence; train.reset_optimizer keeps
    its parameters and step with a fresh Muon state (one log line); Muon's own checkpoints (empty
    second moments on its leaves, ZeRO-1 over 2 devices) resume bit-exact."""
    def train(cfg):
        return jaxpar.train(cfg, mesh=make_mesh(cfg, jax.devices()[:2]))

    run_dir = str(tmp_path / "r")
    adam = tiny((2, 1, 1), zero=1).replace(train={"optimizer": "adamw", "steps": 2, "run_dir": run_dir,
                                                   "async_checkpoint": False})
    train(adam)
    muon = adam.replace(train={"optimizer": "muon", "steps": 5, "checkpoint_every": 3})
    with pytest.raises(CheckpointError, match=r"was saved with train\.optimizer = adamw, but this config trains with "
                                              r"train\.optimizer = muon; resume with train\.optimizer=adamw, or set "
                                              r"train\.reset_optimizer=true"):
        train(muon)
    with caplog.at_level(logging.INFO, logger="jaxpar"):
        straight = train(muon.replace(train={"reset_optimizer": True}))
    lines = [r.getMessage() for r in caplog.records if "train.reset_optimizer" in r.getMessage()]
    assert len(lines) == 1 and "fresh optimizer state" in lines[0], lines
    assert [r["step"] for r in straight] == [3, 4, 5] and saved_steps(run_dir) == [2, 3, 5]
    # Muon's checkpoint of step 3 (its momentum, its empty arrays made again) resumes to the same
    # step 5, whose loss follows the update of step 4 that the restored momentum took part in.
    again = str(tmp_path / "again")
    shutil.copytree(run_dir, again)
    shutil.rmtree(os.path.join(again, "checkpoints", "5"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxpar"):
        resumed = train(muon.replace(train={"run_dir": again, "reset_optimizer": True}))
    assert not any("fresh optimizer state" in r.getMessage() for r in caplog.records)
    assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in straight if r["step"] > 3]


def test_planner_counts_one_momentum_on_muons_leaves():
    from jaxpar.plan.memory import model_state
    from jaxpar.train.step import build

    for master in ("none", "float32"):
        cfg = tiny((8, 1, 1), zero=1).replace(
            model={"param_dtype": "bfloat16" if master != "none" else "float32"}, train={"master_weights": master})
        abstract = build(cfg).abstract_state()
        held = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                   for x in jax.tree.leaves(abstract.opt_state) if x.ndim)
        assert model_state(cfg, (8, 1, 1))["optimizer"] == held
        adam = model_state(cfg.replace(train={"optimizer": "adamw"}), (8, 1, 1))["optimizer"]
        assert model_state(cfg, (8, 1, 1))["optimizer"] < adam


def test_planner_times_newton_schulz_on_the_busiest_rank():
    """The step-time model's `newton_schulz` term: the deal's FLOPs per rank at the matmul rate of
    `train.muon_ns_dtype`; 0 with AdamW; it falls with more ranks."""
    from jaxpar.hardware import HARDWARE
    from jaxpar.plan.steptime import MATMUL_EFFICIENCY, compute_terms

    hw = HARDWARE["h100-80gb"]
    cfg = _cost_cfg(1, "muon")
    d = muon_lib.deal(model.param_shapes(cfg.model), model.param_names(cfg.model), 8)
    assert compute_terms(cfg, (8, 1, 1), hw)["newton_schulz"] == d.flops / (MATMUL_EFFICIENCY * hw.peak_flops_fp32)
    bf16 = cfg.replace(train={"muon_ns_dtype": "bfloat16"})
    assert compute_terms(bf16, (8, 1, 1), hw)["newton_schulz"] == d.flops / (MATMUL_EFFICIENCY * hw.peak_flops)
    assert compute_terms(cfg.replace(train={"optimizer": "adamw"}), (8, 1, 1), hw)["newton_schulz"] == 0
    assert compute_terms(cfg, (2, 1, 1), hw)["newton_schulz"] > compute_terms(cfg, (8, 1, 1), hw)["newton_schulz"]


def test_bad_values_are_refused_before_compiling():
    with pytest.raises(ConfigError, match=r"`train.optimizer` got 'sgd', but it must be one of 'adamw', 'muon'"):
        from_dict({"train": {"optimizer": "sgd"}})
    with pytest.raises(ConfigError, match=r"`train.muon_ns_dtype` got 'float16', but it must be one of"):
        from_dict({"train": {"muon_ns_dtype": "float16"}})
    with pytest.raises(ConfigError, match=r"train.muon_momentum = 1.0 must lie in \[0, 1\)"):
        validate(tiny().replace(train={"muon_momentum": 1.0}))
