"""QK-clip (`train.qk_clip`, MuonClip: `jaxpar.model.qk_clip`, docs/qk-clip.md): the step's
per-head maximum logits and the clipped parameters against a direct float64 computation from the
parameters and the batch, for grouped-query attention and multi-head latent attention (the clip of
the initial parameters, at step 0 where the warmup's lr is 0, and the clip of an updated step,
against the same step's program without qk_clip); that the clipped heads' logits come down to tau
(fails if the clip is skipped); parity with one device (data 8 with microbatches here, more in the
slow tier); the config refusals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import COMPILER_OPTIONS, max_abs_diff, run_steps
from jaxpar import model
from jaxpar.config import ConfigError, from_dict, validate
from jaxpar.mesh import make_mesh
from jaxpar.model.layers import document_segments, packed, sequence_layout
from jaxpar.train.data import batch_at, make_source
from jaxpar.train.step import build

MLA = {"n_kv_heads": None, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}

# The maxima: the step's float32 q·kᵀ (HIGHEST precision) of float32 projections against float64
# products of the same float32 layer inputs and parameters: sums of 8..12 terms of size ~1 after
# float32 projections of 32 terms, observed <= 3e-7 relative; 1e-5 is ~80 float32 ulps. A head
# unclipped or clipped twice, or a maximum taken over the wrong positions, moves them by > 1e-2.
MAX_RTOL = 1e-5
# The clipped parameters: float32 products w x f(γ) against float64, f computed from float32
# maxima (relative 1e-7 each): observed <= 1e-7 relative; PARAM_RTOL is 100x that. A head left
# unclipped differs by 1 - γ >= 1e-2 (tau is chosen between the heads' maxima, below).
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-8


def tiny(mesh=(1, 1, 1), model_keys=None, tau=None, train=None, data=None, **parallel):
    # init_std 0.3: logits of size ~1 (at 0.02 every logit is ~0.05); warmup_steps 1: step 0 runs at lr 0.
    return from_dict({
        "model": {"arch": "llama", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
                  "vocab_size": 64, "seq_len": 16, "init_std": 0.3, **(model_keys or {})},
        "mesh": dict(zip(("data", "stage", "model"), mesh)),
        "parallel": {"zero_min_elements": 0, **parallel}, "data": data or {},
        "train": {"steps": 3, "global_batch": 8, "lr": 1e-2, "warmup_steps": 1, "log_every": 1, "qk_clip": tau,
                  **(train or {})}})


# ------------------------------------------------------------------ the direct computation (float64)


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _documents(tokens, eos):
    """(segments, positions) [B, T] of packed documents, each ended by `eos` (data.document_mask)."""
    ends = (tokens == eos).astype(np.int64)
    seg = np.cumsum(ends, axis=1) - ends
    pos = np.zeros_like(seg)
    for t in range(1, seg.shape[1]):
        pos[:, t] = np.where(seg[:, t] == seg[:, t - 1], pos[:, t - 1] + 1, 0)
    return seg, pos


def _rope(x, theta, pos=None):
    """RoPE on the last dim of [B, T, ..., H] (the two halves rotated) at positions [B, T]
    (default 0..T-1)."""
    H, B, T = x.shape[-1], x.shape[0], x.shape[1]
    pos = np.broadcast_to(np.arange(T), (B, T)) if pos is None else pos
    inv = 1.0 / theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    ang = pos.astype(np.float64)[..., None] * inv  # [B, T, H/2]
    shape = (B, T) + (1,) * (x.ndim - 3) + (H // 2,)
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    x1, x2 = x[..., :H // 2], x[..., H // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def layer_inputs(cfg, params, inputs, eos=None) -> list[np.ndarray]:
    """Each layer's input x_l [B, T, D] (float64 of the model's float32 forward): the backbone of
    the first l layers (a mixed model's first dense layers and MoE layers, `moe_layers:
    first_dense:1` here)."""
    out = []
    for n in range(cfg.n_layers):
        if cfg.mixed and n <= 1:  # the dense first layer alone
            mc = dataclasses.replace(cfg, n_layers=1, n_experts=0, moe_layers="all")
            p = {**params, "blocks": jax.tree.map(lambda a: a[:1], params["blocks"]["dense"])}
        elif cfg.mixed:
            mc = dataclasses.replace(cfg, n_layers=n)
            p = {**params, "blocks": {"dense": params["blocks"]["dense"],
                                      "moe": jax.tree.map(lambda a: a[:n - 1], params["blocks"]["moe"])}}
        else:
            mc = dataclasses.replace(cfg, n_layers=max(n, 1))
            p = {**params, "blocks": jax.tree.map(lambda a: a[:max(n, 1)], params["blocks"])}
        m = model.bind(mc, p)
        layout = None if eos is None else packed(document_segments(jnp.asarray(inputs), eos))
        with sequence_layout(layout):
            x = m.embed_tokens(jnp.asarray(inputs))
            out.append(np.asarray(x if n == 0 else m.backbone(x), np.float64))
    return out


def direct_maxima(cfg, params, inputs, eos=None) -> np.ndarray:
    """[layers, N]: every head's largest causal logit on `inputs`, in float64 (with `eos`, within
    each packed document, RoPE positions restarting at each)."""
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), jax.device_get(params))
    seg, pos = _documents(inputs, eos) if eos is not None else (None, None)
    out = []
    for n, x in enumerate(layer_inputs(cfg, params, inputs, eos)):
        blocks, i = (p64["blocks"], n) if not cfg.mixed else (
            (p64["blocks"]["dense"], 0) if n == 0 else (p64["blocks"]["moe"], n - 1))
        out.append(attention_maxima(cfg, blocks, i, x, seg, pos))
    return np.stack(out)


def attention_maxima(cfg, blocks, i, x, seg=None, pos=None) -> np.ndarray:
    """[N]: the largest causal logit of each head of layer i of the float64 `blocks` (stacked) on
    its input x [B, T, D] (within the documents `seg`, at positions `pos`)."""
    a = jax.tree.map(lambda v: v[i], blocks["attn"])
    h = _rms(x, blocks["attn_norm"]["scale"][i], cfg.norm_eps)
    if cfg.mla:
        dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q = np.einsum("btr,rnh->btnh", _rms(h @ a["wq_a"], a["q_norm"], cfg.norm_eps), a["wq_b"])
        kv = h @ a["wkv_a"]
        k_c = np.einsum("btr,rnh->btnh", _rms(kv[..., :r], a["kv_norm"], cfg.norm_eps), a["wkv_b"][..., :dn])
        k_r = _rope(kv[..., r:], cfg.rope_theta, pos)
        s = (np.einsum("btnh,bsnh->bnts", q[..., :dn], k_c)
             + np.einsum("btnh,bsh->bnts", _rope(q[..., dn:], cfg.rope_theta, pos), k_r)) / np.sqrt(q.shape[-1])
    else:
        q = _rope(np.einsum("btd,dnh->btnh", h, a["wq"]), cfg.rope_theta, pos)
        k = _rope(np.einsum("btd,dkh->btkh", h, a["wk"]), cfg.rope_theta, pos)
        k = np.repeat(k, cfg.n_heads // cfg.kv_heads, axis=2)  # head n reads key head n // G
        s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    T = s.shape[-1]
    keep = np.tril(np.ones((T, T), bool))[None, None]
    if seg is not None:
        keep = keep & (seg[:, :, None] == seg[:, None, :])[:, None]
    s = np.where(keep, s, -np.inf)
    return s.max(axis=(0, 2, 3))


def clip_by_hand(cfg, params, smax, tau):
    """The rule of docs/qk-clip.md on host arrays, in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), jax.device_get(params))
    a = p["blocks"]["attn"]
    g = np.where(smax > tau, tau / smax, 1.0)  # [L, N]
    if cfg.mla:
        dn = cfg.qk_nope_head_dim
        a["wq_b"][..., :dn] *= np.sqrt(g)[:, None, :, None]
        a["wq_b"][..., dn:] *= g[:, None, :, None]
        a["wkv_b"][..., :dn] *= np.sqrt(g)[:, None, :, None]
    else:
        L, N, K = g.shape[0], cfg.n_heads, cfg.kv_heads
        g_kv = g.reshape(L, K, N // K).min(axis=-1)
        a["wq"] *= (g / np.repeat(np.sqrt(g_kv), N // K, axis=1))[:, None, :, None]
        a["wk"] *= np.sqrt(g_kv)[:, None, :, None]
    return p


def assert_params_close(got, want):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                   err_msg=jax.tree_util.keystr(path))


def inputs_of(batch) -> np.ndarray:
    return np.asarray(jax.device_get(batch))[:, :-1]


def test_max_logits_blocks_and_documents(monkeypatch):
    """`qk_clip.max_logits` in query blocks (3 of 8 here) under the causal and a document mask,
    grouped heads (N 4, K 2), against float64 (MAX_RTOL's reasons)."""
    from jaxpar.model import qk_clip

    monkeypatch.setattr(qk_clip, "QUERY_BLOCK", 8)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 24, 4, 8)), rng.standard_normal((2, 24, 2, 8))
    seg = np.cumsum(rng.random((2, 24)) < 0.2, axis=1)
    s = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, 2, axis=2)) / np.sqrt(8)
    for segments in (None, seg):
        keep = np.tril(np.ones((24, 24), bool))[None]
        if segments is not None:
            keep = keep & (segments[:, :, None] == segments[:, None, :])
        want = np.where(keep[:, None], s, -np.inf).max(axis=(0, 2, 3))
        got = jax.jit(qk_clip.max_logits)(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                          None if segments is None else jnp.asarray(segments, jnp.int32))
        np.testing.assert_allclose(np.asarray(got), want, rtol=MAX_RTOL)
    # (The document mask matters here: the masked maxima differ from the causal ones.)
    assert not np.allclose(want, np.where(np.tril(np.ones((24, 24), bool)), s, -np.inf).max(axis=(0, 2, 3)))


@pytest.mark.parametrize("kind", ["gqa", pytest.param("mla", marks=pytest.mark.slow),  # (31 s each)
                                  pytest.param("gqa-documents", marks=pytest.mark.slow)])
def test_clip_against_direct_computation(kind):
    keys = MLA if kind == "mla" else None
    data = {"document_mask": True} if kind == "gqa-documents" else None
    tiny_ = lambda **kw: tiny(model_keys=keys, data=data, **kw)  # noqa: E731
    base = tiny_()
    eos = base.model.vocab_size - 1 if data else None  # (synthetic data's documents end at vocab_size - 1)
    params0 = jax.device_get(model.init_params(base.model, jax.random.key(0)))
    source = make_source(base)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    batches = [np.asarray(batch_at(source, k, 8, one)) for k in range(2)]
    if eos is not None:  # several documents in some rows, so that the mask matters
        assert (inputs_of(batches[0])[:, :-1] == eos).any()
    smax0 = direct_maxima(base.model, params0, inputs_of(batches[0]), eos)
    # tau between the heads' maxima: some heads of every layer clip, some do not.
    tau = float(np.sort(smax0.ravel())[smax0.size // 2 - 1] + np.sort(smax0.ravel())[smax0.size // 2]) / 2
    clipped = smax0 > tau
    assert clipped.any() and (~clipped).any() and np.min(np.abs(smax0 - tau) / tau) > 1e-3
    cfg = tiny_(tau=tau)
    mesh = make_mesh(cfg, jax.devices()[:1])
    program, plain = build(cfg, mesh), build(tiny_(), mesh)  # (the same step without qk_clip)
    key = jax.random.key(0)
    state = program.init.lower(key).compile(COMPILER_OPTIONS)(key)
    # (The compiled init rounds a few ulps apart from the eager one tau was chosen from: the
    # maxima are taken again from the step's own initial parameters, the margin above is 1e-3.)
    params0 = jax.device_get(state.params)
    smax0 = direct_maxima(cfg.model, params0, inputs_of(batches[0]), eos)
    assert (clipped == (smax0 > tau)).all()
    put = lambda b: jax.device_put(b, program.batch_sharding)  # noqa: E731
    step = program.step.lower(state, put(batches[0])).compile(COMPILER_OPTIONS)

    # Step 0 (lr 0): the parameters are the initial ones, clipped by the maxima of batch 0.
    state, metrics = step(state, put(batches[0]))
    for n in range(cfg.model.n_layers):
        np.testing.assert_allclose(float(metrics[f"max_logit_{n}"]), smax0[n].max(), rtol=MAX_RTOL)
    np.testing.assert_allclose(float(metrics["max_logit"]), smax0.max(), rtol=MAX_RTOL)
    assert_params_close(state.params, clip_by_hand(cfg.model, params0, smax0, tau))
    # The clip acts: the first layer's clipped heads now peak at tau on the same batch, its other
    # heads where they were (later layers' inputs moved with it). Skipping the clip leaves
    # them at smax0 (>= 1e-3 above tau); MAX_RTOL as above.
    after = direct_maxima(cfg.model, state.params, inputs_of(batches[0]), eos)
    np.testing.assert_allclose(after[0], np.where(clipped[0], tau, smax0[0]), rtol=MAX_RTOL)

    # Step 1 (lr > 0): the clip of the updated parameters, by the maxima of the step's own forward.
    params1 = jax.device_get(state.params)
    smax1 = direct_maxima(cfg.model, params1, inputs_of(batches[1]), eos)
    plain_state = jax.tree.map(jnp.copy, state)
    state, metrics = step(state, put(batches[1]))
    plain_step = plain.step.lower(plain_state, put(batches[1])).compile(COMPILER_OPTIONS)
    updated = plain_step(plain_state, put(batches[1]))[0].params
    assert max_abs_diff(updated, params1) > 1e-4  # (the step moved the parameters)
    np.testing.assert_allclose([float(metrics[f"max_logit_{n}"]) for n in range(2)], smax1.max(axis=1), rtol=MAX_RTOL)
    # (Some head clips at step 1 too; on the documents' batch 1 none exceeds tau after step 0's
    # clip, measured: the comparison then checks that nothing else moves.)
    assert (smax1 > tau).any() or eos is not None
    assert_params_close(state.params, clip_by_hand(cfg.model, updated, smax1, tau))


@pytest.mark.slow
def test_mixed_moe_layer_order():
    """A mixed MoE model (a dense first layer, then MoE layers: two stacks, `MixedBlocks`): the
    step's per-layer maxima are each layer's, in layer order, and each stack's heads are clipped
    by its own layers' maxima (step 0, lr 0; MAX_RTOL, PARAM_RTOL as above)."""
    keys = MOE
    base = tiny(model_keys=keys)
    tau = 10.5  # (the heads' maxima on batch 0 at init: 8.2..15.0, at least 1% from tau)
    cfg = tiny(model_keys=keys, tau=tau)
    program = build(cfg, make_mesh(cfg, jax.devices()[:1]))
    key = jax.random.key(0)
    state = program.init(key)
    params0 = jax.device_get(state.params)
    batch = batch_at(make_source(base), 0, 8, program.batch_sharding)
    smax = direct_maxima(cfg.model, params0, inputs_of(batch))
    assert (smax > tau).any() and (smax <= tau).any() and np.min(np.abs(smax - tau)) > 1e-2 * tau
    assert len(set(np.round(smax.max(axis=1), 3))) == 3  # (layers told apart by their maxima)
    state, metrics = program.step(state, batch)
    np.testing.assert_allclose([float(metrics[f"max_logit_{n}"]) for n in range(3)], smax.max(axis=1), rtol=MAX_RTOL)
    got = jax.device_get(state.params)
    for kind, rows in (("dense", [0]), ("moe", [1, 2])):
        want = clip_by_hand(cfg.model, {"blocks": got["blocks"][kind] | {"attn": params0["blocks"][kind]["attn"]}},
                            smax[rows], tau)
        assert_params_close(got["blocks"][kind]["attn"], want["blocks"]["attn"])


@pytest.mark.slow
def test_mtp_blocks_are_recorded_and_clipped():
    """Multi-token prediction (`model.mtp_depth`): each depth's block reports its heads' largest
    logit (`max_logit_mtp_1`, the last row of the step's maxima) and is clipped by it, like a
    layer's (step 0, lr 0: the parameters are the initial ones clipped). Against float64 of the
    block on its input, built from the model's own float32 functions (MAX_RTOL, PARAM_RTOL)."""
    from jaxpar.model import mtp
    from jaxpar.model.layers import linear, rms_norm

    keys = {"mtp_depth": 1}
    base = tiny(model_keys=keys)
    program0 = build(base, make_mesh(base, jax.devices()[:1]))
    key = jax.random.key(0)
    params0 = jax.device_get(program0.init(key).params)
    batch = np.asarray(batch_at(make_source(base), 0, 8, jax.sharding.SingleDeviceSharding(jax.devices()[0])))
    m, cfg_m = model.bind(base.model, params0), base.model
    rows = mtp.pad(jnp.asarray(batch), 1)
    split = lambda r, shift: mtp.cut(r, shift, 1)  # noqa: E731
    h = m.final_norm(m.backbone(m.embed_tokens(split(rows, 0)[0])))
    (ahead, _), = mtp.depth_rows(split, rows, 1, None)
    e = m.embed_tokens(ahead)
    p = params0["mtp"]
    x = linear(jnp.concatenate([rms_norm(e, p["enorm"][0], cfg_m.norm_eps), rms_norm(h, p["hnorm"][0], cfg_m.norm_eps)],
                               axis=-1), jnp.asarray(p["eh_proj"][0]))
    mtp64 = jax.tree.map(lambda a: np.asarray(a, np.float64), p["blocks"])
    smax_mtp = attention_maxima(cfg_m, mtp64, 0, np.asarray(x, np.float64))
    smax = np.concatenate([direct_maxima(cfg_m, params0, batch[:, :-1]), smax_mtp[None]])
    srt = np.sort(smax_mtp)
    tau = float(srt[1] + srt[2]) / 2  # two of the block's four heads clip
    assert np.min(np.abs(smax - tau) / tau) > 1e-3
    cfg = tiny(model_keys=keys, tau=tau)
    program = build(cfg, make_mesh(cfg, jax.devices()[:1]))
    state, metrics = program.step(program.init(key), jax.device_put(batch, program.batch_sharding))
    np.testing.assert_allclose(float(metrics["max_logit_mtp_1"]), smax_mtp.max(), rtol=MAX_RTOL)
    np.testing.assert_allclose(float(metrics["max_logit"]), smax.max(), rtol=MAX_RTOL)
    got = jax.device_get(state.params)
    assert_params_close(got["blocks"]["attn"], clip_by_hand(cfg.model, params0, smax[:2], tau)["blocks"]["attn"])
    want = clip_by_hand(cfg.model, {"blocks": p["blocks"]}, smax[2:], tau)["blocks"]["attn"]
    assert_params_close(got["mtp"]["blocks"]["attn"], want)


# ------------------------------------------------------------------ parity with one device

TAU = 1.5  # below the tiny model's largest logits (~1.5..3 at init_std 0.3): heads clip every step
_REF: dict = {}


def run(cfg) -> dict:
    """Losses, the max_logit metrics of every step (`maxima`), final parameters."""
    return run_steps(cfg)


def reference(model_keys=None, train=None, data=None) -> dict:
    key = tuple(tuple(sorted((x or {}).items())) for x in (model_keys, train, data))
    if key not in _REF:
        _REF[key] = run(tiny(model_keys=model_keys, tau=TAU, train=train, data=data))
    return _REF[key]


def check_parity(mesh, model_keys=None, train=None, data=None, **parallel):
    """Losses (helpers.LOSS_RTOL's reasons), the logged maxima (MAX_RTOL's: the same products,
    reduced by max in another order, which is exact: observed equal to 2e-8) and the final
    parameters (helpers.PARAM_ATOL's reasons) against one device, with heads clipped."""
    from helpers import LOSS_RTOL, PARAM_ATOL

    ref = reference(model_keys, train, data)
    assert (ref["maxima"][:, 0] > TAU).all() and max_abs_diff(ref["params"], ref["init"]) > 1e-3
    out = run(tiny(mesh, model_keys, TAU, train, data, **parallel))
    assert out["skipped"] == ref["skipped"] == 0
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(out["maxima"], ref["maxima"], rtol=MAX_RTOL)
    assert max_abs_diff(out["params"], ref["params"]) < PARAM_ATOL


def test_parity_data_4_microbatches_2():
    """The max over data ranks (pmax) and over microbatches (accumulate), with ZeRO-1."""
    check_parity((4, 1, 1), zero=1, microbatches=2)


def test_parity_context_parallel_all_gather():
    """Context parallelism (2 ranks per group, zigzag chunks): each rank's queries against the
    whole sequence's keys at their positions, the max over the group by the data ranks' pmax."""
    check_parity((8, 1, 1), zero=1, context=2)


def test_parity_pipeline_1f1b():
    """Pipelined (2 stages, 1F1B): each stage's F reports its layers' maxima, the step takes the
    max over microbatches, stages and data ranks (`pipeline.executor.layer_maxima`)."""
    check_parity((2, 2, 1), zero=1, microbatches=2, schedule="1f1b")


MOE = {"n_layers": 3, "n_experts": 4, "experts_per_token": 2, "expert_d_ff": 16, "moe_layers": "first_dense:1"}

SLOW = {
    # Pipelines: split I and W with tensor parallelism (each model rank's heads); interleaved
    # chunks (stage s holds chunks s and s + p); uneven stages (layer slots, an inactive slot
    # reports -inf); the MTP block on the last stage; a mixed MoE model's two stacks.
    "zb_h1-tp2-sp": (dict(mesh=(2, 2, 2), zero=1, microbatches=2, schedule="zb_h1", sequence_parallel=True), None,
                     None),
    "interleaved": (dict(mesh=(2, 2, 1), zero=1, microbatches=2, schedule="interleaved_1f1b", virtual_stages=2),
                    {"n_layers": 4}, None),
    "uneven-stages": (dict(mesh=(2, 2, 1), zero=1, microbatches=2, schedule="1f1b", stage_layers=[2, 1]),
                      {"n_layers": 3}, None),
    "mtp-1f1b": (dict(mesh=(2, 2, 1), zero=1, microbatches=2, schedule="1f1b"), {"mtp_depth": 1}, None),
    "mixed-moe-1f1b": (dict(mesh=(2, 2, 1), zero=1, microbatches=2, schedule="1f1b", stage_layers=[1, 2]), MOE,
                       None),
    "context2-ring-documents": (dict(mesh=(4, 1, 1), zero=1, context=2, context_attention="ring"), None, None,
                                {"document_mask": True}),
    "data8-zero0": (dict(mesh=(8, 1, 1), zero=0), None, None),
    "data2-zero2-microbatches4": (dict(mesh=(2, 1, 1), zero=2, microbatches=4), None, None),
    "data8-zero3": (dict(mesh=(8, 1, 1), zero=3), None, None),
    "tp2-sp-zero1": (dict(mesh=(4, 1, 2), zero=1, sequence_parallel=True), None, None),
    "tp4-kv-replicated": (dict(mesh=(2, 1, 4), zero=1, sequence_parallel=True, microbatches=2), None, None),
    "mla-tp2-sp": (dict(mesh=(4, 1, 2), zero=1, sequence_parallel=True), MLA, None),
    "muon-tp2-sp": (dict(mesh=(4, 1, 2), zero=1, sequence_parallel=True), None, {"optimizer": "muon"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_parity_slow(name):
    parallel, model_keys, train, *data = SLOW[name]
    parallel = dict(parallel)
    check_parity(parallel.pop("mesh"), model_keys, train, *data, **parallel)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("keys, words", [
    ({"train": {"qk_clip": 0.0}}, "train.qk_clip = 0.0 must be positive"),
    ({"train": {"qk_clip": 5.0}, "parallel": {"data_mode": "naive"}}, "parallel.data_mode = naive"),
    ({"train": {"qk_clip": 5.0}, "model": {"qk_norm": True}}, "model.qk_norm = true"),
])
def test_refusals(keys, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")) as info:
        validate(from_dict(keys))
    assert "; set " in str(info.value)  # the fix


def test_the_log_line_shows_max_logit():
    from jaxpar.train.progress import line

    rec = {"step": 3, "loss": 4.1, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0, "model_tflops_per_device": 0.1,
           "step_time_s": 1.0, "device_wait_s": 0.9, "skipped_steps": 0, "max_logit": 123.456, "max_logit_0": 1.0}
    assert line(rec, 10, 1.0).endswith(" max_logit 123.5")
    assert "max_logit" not in line({k: v for k, v in rec.items() if not k.startswith("max_logit")}, 10, 1.0)
