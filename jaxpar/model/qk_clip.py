"""QK-clip (MuonClip, Kimi K2, arXiv 2507.20534 §2.1; `train.qk_clip: tau`): the largest
pre-softmax attention logit of every head, recorded in the forward pass, and the rule that
rescales the query and key projections of the heads whose largest logit exceeded tau.

Recording (at trace time, through two context variables; outside `recording()` nothing is
computed): `dot_product_attention` calls `record(q, k, segments)` with the queries and keys as the
softmax takes them; inside a block body (`transformer.block_bodies`, under `layer()`) that appends
the layer's per-head maximum [N] (float32, no gradient), the body returns it as a scan output, and
`run_blocks` hands the stacked [layers, N] (layer order) to the step's `recording()`, which the
loss function returns as its auxiliary output. The maximum is computed from q and k apart from
the attention kernel (one more q kᵀ product in float32 per layer, forward only, a batch row at a
time: 2·T²·N·H FLOPs per row and N·T² floats of transient memory): every kernel (XLA, cuDNN, the
tiled and query-blocked ones) stays as it is. The executors reduce it with a max over
microbatches (`jaxpar.parallel.microbatches.accumulate`) and data ranks (`pmax`) and assemble the
heads split over `model` (`jaxpar.parallel.gradients`).

The rule (`clip`) is docs/qk-clip.md's: γ_h = tau / S_h for every head with S_h > tau (else 1);
grouped-query attention scales the shared key head by sqrt(γ_kv), γ_kv the smallest γ of its
group, and each query head by γ_h / sqrt(γ_kv), so that every head's q·k is scaled by exactly γ_h
(with one query head per key head: sqrt(γ_h) each, Kimi K2's rule); multi-head latent attention
scales each head's no-RoPE query and key columns by sqrt(γ_h) and its rotary query columns by
γ_h, leaving the shared rotary key alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import ModelConfig
from jaxpar.sharding import vary, varying_axes

_STEP: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxpar_qk_clip_step", default=None)
_LAYER: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxpar_qk_clip_layer", default=None)


@contextlib.contextmanager
def recording(on: bool = True):
    """Trace the model recording each layer's per-head maximum logit (when `on`): the list it
    yields receives the [layers, N] maxima of `run_blocks` (one entry per backbone)."""
    token = _STEP.set([] if on else None)
    try:
        yield _STEP.get()
    finally:
        _STEP.reset(token)


def active() -> bool:
    """Is the model being traced under `recording()`?"""
    return _STEP.get() is not None


@contextlib.contextmanager
def layer():
    """One layer's recording (inside its block body): the list receives its attention's maxima."""
    token = _LAYER.set([])
    try:
        yield _LAYER.get()
    finally:
        _LAYER.reset(token)


KEY = "max_logit"
"""A block body's report of its layer's per-head maximum (`transformer.block_bodies`' aux)."""


def put(maxima_LxN: jax.Array) -> None:
    """Maxima [layers, N] into the step's recording: `run_blocks`' stacked ones, then each
    multi-token prediction depth's [1, N] (`jaxpar.model.mtp`); `gathered` joins them."""
    _STEP.get().append(maxima_LxN)


def gathered(recorded: list) -> jax.Array:
    """The step's recording as one [layers + mtp_depth, N]: the model's layers in order, then the
    MTP depths' blocks (the order `clip` and `metrics` read)."""
    return recorded[0] if len(recorded) == 1 else jnp.concatenate(recorded)


def none(layer_params: dict, x: jax.Array) -> jax.Array:
    """The maximum an inactive layer slot reports, given its parameters and input `x`: -inf for
    each of its (local) query heads, read from its query projection's head dim (under tensor
    parallelism a rank's share), varying over the manual axes a recorded one does (x's and the
    projection's, inside a shard_map)."""
    attn = layer_params["attn"]
    wq = attn["wq_b"] if "wq_b" in attn else attn["wq"]
    return vary(jnp.full((wq.shape[-2],), -jnp.inf, jnp.float32), (*varying_axes(x), *varying_axes(wq)))


def record(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, segments_BxT: jax.Array | None,
           where: Callable[[], tuple] | None = None) -> None:
    """Inside `layer()`: append the per-head maximum logit [N] of causal attention of these
    queries and keys (as the softmax takes them), within the documents `segments_BxT`; or, with
    `where` (context parallelism), of the queries against the keys it returns: () -> (keys [B, S,
    K, H], the queries' positions [T], the keys' positions [S], the queries' and the keys'
    documents [B, T] and [B, S] or None), called only while recording."""
    rec = _LAYER.get()
    if rec is None:
        return
    if where is None:
        rec.append(max_logits(q_BxTxNxH, k_BxSxKxH, segments_BxT))
    else:
        k, q_pos, k_pos, q_seg, k_seg = where()
        rec.append(max_logits(q_BxTxNxH, k, q_seg, q_pos, k_pos, k_seg))


QUERY_BLOCK = 256
"""`max_logits` computes the logits of at most this many queries of one batch row at a time."""


def max_logits(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, segments_BxT: jax.Array | None = None,
               q_pos: jax.Array | None = None, k_pos: jax.Array | None = None,
               k_segments_BxS: jax.Array | None = None) -> jax.Array:
    """[N] float32: over every batch row and every (query, key) pair the causal (and document)
    mask keeps, the largest q·k / sqrt(H) of each query head (GQA: head n reads key head n // G,
    G = N / K, as every kernel groups them). The queries sit at positions `q_pos` [T] and the keys
    at `k_pos` [S] (default: the last T of 0..S-1, and 0..S-1), the keys' documents
    `k_segments_BxS` (default the queries'). No gradient; one batch row and one block of up to
    `QUERY_BLOCK` queries at a time (`lax.map`): N·QUERY_BLOCK·S floats of transient memory."""
    q = jax.lax.stop_gradient(q_BxTxNxH).astype(jnp.float32)
    k = jax.lax.stop_gradient(k_BxSxKxH).astype(jnp.float32)
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    b = next(d for d in range(min(T, QUERY_BLOCK), 0, -1) if T % d == 0)  # queries per block
    q_pos = jnp.arange(S - T, S) if q_pos is None else q_pos
    k_pos = jnp.arange(S) if k_pos is None else k_pos
    seg = jnp.zeros((B, T), jnp.int32) if segments_BxT is None else segments_BxT
    k_seg = seg if k_segments_BxS is None else k_segments_BxS

    def row(args):
        q_TxNxH, k_SxKxH, seg_T, seg_S = args

        def block(args):
            q_bxKxGxH, i = args
            s = jnp.einsum("tkgh,skh->kgts", q_bxKxGxH, k_SxKxH, precision=jax.lax.Precision.HIGHEST) / math.sqrt(H)
            keep = k_pos[None, :] <= jax.lax.dynamic_slice_in_dim(q_pos, i * b, b)[:, None]
            if segments_BxT is not None:
                keep = keep & (jax.lax.dynamic_slice_in_dim(seg_T, i * b, b)[:, None] == seg_S[None, :])
            return jnp.max(jnp.where(keep, s, -jnp.inf), axis=(2, 3)).reshape(N)

        blocks = q_TxNxH.reshape(T // b, b, K, N // K, H)
        return jnp.max(jax.lax.map(block, (blocks, jnp.arange(T // b))), axis=0)

    return jnp.max(jax.lax.map(row, (q, k, seg, k_seg)), axis=0)


def factors(smax: jax.Array, tau: float) -> jax.Array:
    """γ per head: tau / S where S > tau, else 1 (float32, shaped like `smax`)."""
    smax = smax.astype(jnp.float32)
    return jnp.where(smax > tau, tau / jnp.where(smax > tau, smax, 1.0), 1.0)


def _scale(x: jax.Array, f: jax.Array) -> jax.Array:
    return (x.astype(jnp.float32) * f).astype(x.dtype)


def clip_attention(cfg: ModelConfig, attn: dict[str, Any], gamma_LxN: jax.Array) -> dict[str, Any]:
    """One stack's attention parameters (leading `layers` dim) with heads rescaled by γ [L, N]."""
    attn = dict(attn)
    if cfg.mla:
        dn = cfg.qk_nope_head_dim
        root = jnp.sqrt(gamma_LxN)
        wq = "wq" if "wq" in attn else "wq_b"  # [L, ., N, dn + dr]: no-RoPE columns sqrt(γ), rotary γ
        width = attn[wq].shape[-1]
        q_f = jnp.where(jnp.arange(width) < dn, root[..., None], gamma_LxN[..., None])  # [L, N, dn + dr]
        attn[wq] = _scale(attn[wq], q_f[:, None])
        width = attn["wkv_b"].shape[-1]  # [L, r_kv, N, dn + dv]: the key's no-RoPE columns sqrt(γ), values 1
        kv_f = jnp.where(jnp.arange(width) < dn, root[..., None], 1.0)
        attn["wkv_b"] = _scale(attn["wkv_b"], kv_f[:, None])
        return attn
    L, N = gamma_LxN.shape
    K = cfg.kv_heads
    gamma_kv = jnp.min(gamma_LxN.reshape(L, K, N // K), axis=-1)  # [L, K]
    q_f = gamma_LxN / jnp.repeat(jnp.sqrt(gamma_kv), N // K, axis=1)  # [L, N]
    k_f = jnp.sqrt(gamma_kv)
    attn["wq"] = _scale(attn["wq"], q_f[:, None, :, None])  # [L, D, N, H]
    attn["wk"] = _scale(attn["wk"], k_f[:, None, :, None])  # [L, D, K, H]
    if "bq" in attn:  # the projection's bias scales with it (q = x wq + bq)
        attn["bq"] = _scale(attn["bq"], q_f[..., None])
        attn["bk"] = _scale(attn["bk"], k_f[..., None])
    return attn


def clip(cfg: ModelConfig, params: dict[str, Any], smax_LxN: jax.Array, tau: float,
         order: dict[str, np.ndarray]) -> dict[str, Any]:
    """`params` (the model's tree; a float32 master alike) with every head whose largest logit
    `smax_LxN` [layers + mtp_depth, N] (model layer order, then the MTP depths: `gathered`)
    exceeded `tau` rescaled (module docstring). `order`: `transformer.layer_order`, each stack's
    layers (one stack "" = `blocks` itself)."""
    gamma = factors(smax_LxN, tau)
    L = cfg.n_layers
    blocks = params["blocks"]
    if list(order) == [""]:
        new_blocks = {**blocks, "attn": clip_attention(cfg, blocks["attn"], gamma[:L])}
    else:
        new_blocks = dict(blocks)
        for kind, layers in order.items():
            new_blocks[kind] = {**blocks[kind], "attn": clip_attention(cfg, blocks[kind]["attn"], gamma[layers])}
    out = {**params, "blocks": new_blocks}
    if cfg.mtp_depth:  # each depth's block (stacked on `mtp`) by its own row
        mtp = params["mtp"]
        out["mtp"] = {**mtp, "blocks": {**mtp["blocks"], "attn": clip_attention(cfg, mtp["blocks"]["attn"], gamma[L:])}}
    return out


def stacked_maxima(outs: dict[str, jax.Array], order: dict[str, np.ndarray]) -> jax.Array:
    """[layers, N] in model layer order from `scan_layers`' per-stack outs (kind -> [n, N]);
    `order`: `transformer.layer_order`."""
    if list(order) == [""]:
        return outs[""]
    layers = np.concatenate(list(order.values()))
    return jnp.concatenate([outs[kind] for kind in order])[np.argsort(layers)]


def metrics(cfg: ModelConfig, smax_LxN: jax.Array) -> dict[str, jax.Array]:
    """The logged maxima: `max_logit` over every head and layer (the MTP depths' included),
    `max_logit_<l>` per layer and `max_logit_mtp_<k>` per MTP depth (k from 1, as `mtp_loss_<k>`)."""
    per_layer = jnp.max(smax_LxN, axis=1)
    L = cfg.n_layers
    return {"max_logit": jnp.max(per_layer), **{f"max_logit_{i}": per_layer[i] for i in range(L)},
            **{f"max_logit_mtp_{k + 1}": per_layer[L + k] for k in range(cfg.mtp_depth)}}
