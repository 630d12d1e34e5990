"""Mixture-of-experts MLP: router, dropless grouped expert matmuls, shared experts, router losses.

A token's hidden state goes to its top-k experts (`model.experts_per_token`), each a SwiGLU MLP
of width `model.expert_d_ff`, and comes back weighted by the router. Dropless (the default): the
token-expert assignments are sorted by expert and the experts run as grouped matmuls
(`jax.lax.ragged_dot`) over exactly the tokens each received, with no padding to a capacity.
With `model.capacity_factor` each expert takes at most C = ceil(c x T x k / E) tokens of each
sequence (the group does not depend on the mesh, so every mesh computes the same function), the
assignments beyond it are dropped (top-1 choices first, then by position, as Switch does).

Router losses without plumbing (DESIGN.md §10): the load-balancing loss and the z-loss of a layer
are functions of its router logits only, so their gradient enters where the logits are made, by
a custom VJP (identity forward; backward adds the losses' gradient). Every executor (gradient
accumulation, every pipeline schedule, data and tensor parallelism) then differentiates the
objective  CE + sum over layers of (aux_coef x aux + z_coef x z)  without knowing the losses
exist. A sequence's losses weigh 1 / (sequences per step): the mean over the step's sequences,
set by the train step (`sequences_per_step`), or over the call's batch outside it.
The same VJP reports what is logged: each layer's `router_stats` leaf (zeros, never trained) has
as its "gradient" the step's mean expert loads, losses and dropped fraction, which every executor
sums over microbatches, data shards and stages like any gradient; the train step takes it out of
the gradients before clipping and the optimizer (`split_stats`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax.ad_checkpoint import checkpoint_name

from jaxpar.config import ModelConfig
from jaxpar.model import fp8, grouped_gemm, moe_exchange
from jaxpar.model.moe_exchange import buffer_rows, capacity  # noqa: F401 (the rows' rule lives with the exchange)
from jaxpar.model.layers import linear, param, sequence, swiglu
from jaxpar.sharding import (DOT_TAG, constrain, enter_tp, exchange_experts, exit_tp, gather_sequence_shards,
                             sequence_shard_index, sequence_shards, tensor_parallel_size, varying_axes, vary,
                             zeros_like_varying)

# The per-layer statistics the router reports (`router_stats` holds n_experts loads, then these).
STATS = ("aux_loss", "z_loss", "dropped")

_SEQUENCES: contextvars.ContextVar[int | None] = contextvars.ContextVar("jaxpar_moe_sequences", default=None)


@contextlib.contextmanager
def sequences_per_step(n: int):
    """While tracing a step over `n` sequences (split into microbatches, data shards, stages),
    each sequence's router losses weigh 1/n."""
    token = _SEQUENCES.set(n)
    try:
        yield
    finally:
        _SEQUENCES.reset(token)


def split_stats(cfg: ModelConfig, grads: Any) -> tuple[Any, jax.Array | None]:
    """(the gradients with zeros for `router_stats`, the stats [MoE layers (+ MTP depths), n_experts
    + 3]): the stats leaf's "gradient" is what the routers reported, never an update."""
    if not cfg.moe:
        return grads, None
    stats = [_get(grads, path)["router_stats"] for path in _moe_stacks(cfg)]
    for path, x in zip(_moe_stacks(cfg), stats):
        mlp = _get(grads, path)
        grads = _set(grads, path, {**mlp, "router_stats": jnp.zeros_like(x)})
    return grads, jnp.concatenate(stats).astype(jnp.float32)


def _moe_stacks(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """The paths of the MoE layers' stacked `mlp` subtrees in a parameter-shaped tree: the blocks'
    (a mixed model's `moe` stack), then the multi-token prediction modules' (`jaxpar.model.mtp`)."""
    main = ("blocks", "moe", "mlp") if cfg.mixed else ("blocks", "mlp")
    return [main, ("mtp", "blocks", "mlp")] if cfg.mtp_depth else [main]


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Any, path: tuple[str, ...], value: Any) -> Any:
    """`tree` with the subtree at `path` replaced (new dicts along the path)."""
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def is_stats(path) -> bool:
    """Is this tree path (`jax.tree_util` keys) the routers' report leaf?"""
    return bool(path) and getattr(path[-1], "key", None) == "router_stats"


def metrics(cfg: ModelConfig, stats: jax.Array) -> dict[str, jax.Array]:
    """What is logged of the stats [layers, n_experts + 3] (summed over layers where a loss, the
    extremes over layers where a load; loads relative to the mean load, 1 = balanced)."""
    E = cfg.n_experts
    load = stats[:, :E] * E  # each row sums to 1 (a fraction of the assignments): 1 = the mean
    out = {"moe_aux_loss": jnp.sum(stats[:, E]), "moe_z_loss": jnp.sum(stats[:, E + 1]),
           "moe_max_load": jnp.max(load), "moe_min_load": jnp.min(load)}
    if cfg.capacity_factor is not None:
        out["moe_dropped"] = jnp.mean(stats[:, E + 2])
    return out


def update_bias(cfg: ModelConfig, params: Any, stats: jax.Array) -> Any:
    """DeepSeek-V3's auxiliary-loss-free balancing, after the step's update: each expert's
    selection bias moves by `router_bias_rate` towards equal load (`stats` as `split_stats`)."""
    if not cfg.moe or cfg.router != "sigmoid_bias":
        return params
    E, start = cfg.n_experts, 0
    for path in _moe_stacks(cfg):
        mlp = _get(params, path)
        bias = mlp["router_bias"]
        load = stats[start:start + bias.shape[0], :E]
        start += bias.shape[0]
        new = bias + (cfg.router_bias_rate * jnp.sign(1.0 / E - load)).astype(bias.dtype)
        params = _set(params, path, {**mlp, "router_bias": new})
    return params


class MoE(nnx.Module):
    """The MoE MLP of one layer (llama architecture: SwiGLU experts)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, E, F, pd, std = cfg.d_model, cfg.n_experts, cfg.expert_width, cfg.param_dtype, cfg.init_std
        out_std = std / math.sqrt(2 * cfg.n_layers)
        self.cfg = cfg
        self.router = param(rngs, (D, E), ("embed", "router"), pd, std)
        self.w_gate = param(rngs, (E, D, F), ("experts", "embed", "expert_mlp"), pd, std)
        self.w_up = param(rngs, (E, D, F), ("experts", "embed", "expert_mlp"), pd, std)
        self.w_down = param(rngs, (E, F, D), ("experts", "expert_mlp", "embed"), pd, out_std)
        if cfg.n_shared_experts:
            S = cfg.n_shared_experts * F
            self.shared_gate = param(rngs, (D, S), ("embed", "mlp"), pd, std)
            self.shared_up = param(rngs, (D, S), ("embed", "mlp"), pd, std)
            self.shared_down = param(rngs, (S, D), ("mlp", "embed"), pd, out_std)
        if cfg.router == "sigmoid_bias":
            self.router_bias = param(None, (E,), ("router",), jnp.float32)
        self.router_stats = param(None, (E + len(STATS),), ("router",), jnp.float32)

    def routes_sequence_shard(self) -> bool:
        """Under sequence parallelism with every expert whole on each model rank
        (`parallel.expert_tensor_parallel: false`): this layer takes the rank's sequence shard of
        the residual stream (no `enter_tp`) and returns its output for that shard."""
        return sequence_shards() > 1 and self.w_gate[...].shape[-1] == self.cfg.expert_width

    def __call__(self, x_BxTxD: jax.Array, *, sequence_shard: bool = False) -> jax.Array:
        cfg, dt = self.cfg, cfg_dtype(self.cfg)
        B, T, D = x_BxTxD.shape
        E, k = cfg.n_experts, cfg.experts_per_token
        # The sequence is split into `shards` over `model` (sequence_shard): statistics per
        # sequence are sums over the shards, and each rank's tokens are its own.
        shards = sequence_shards() if sequence_shard else 1
        # Router in float32 (the softmax and the top-k see the precision they need).
        logits_BxTxE = jnp.einsum("btd,de->bte", x_BxTxD.astype(jnp.float32), self.router[...].astype(jnp.float32))
        bias = self.router_bias[...] if cfg.router == "sigmoid_bias" else None
        n = _SEQUENCES.get()
        # Under tensor parallelism every model rank computes the same logits and their cotangents
        # are summed over `model`: each rank adds 1/t of the losses' gradient (and reports 1/t).
        # (Routing its own sequence shard, a rank's logits are its own: no 1/t.)
        weight = 1.0 / ((B if n is None else n) * (1 if sequence_shard else tensor_parallel_size()))
        # (The stats leaf varies over the manual axes the logits vary over, so that its cotangent,
        # computed from them, is typed as it is; the cast's transpose sums it over those axes.)
        axes = (*varying_axes(logits_BxTxE), *varying_axes(self.router_stats[...]))
        layout = sequence()  # (context parallelism: the sequence's other chunks are on other data ranks)
        context = None if layout is None or layout.groups is None else (layout.groups, layout.whole, layout.own)
        logits_BxTxE = _router_losses(vary(logits_BxTxE, axes), vary(self.router_stats[...], axes), bias, cfg, weight,
                                      shards, context)
        gates_BxTxK, experts_BxTxK = route(cfg, logits_BxTxE, bias)
        keep_BxTxK = keep_mask(cfg, experts_BxTxK, shards, context) if cfg.capacity_factor is not None else None
        x_NxD = x_BxTxD.reshape(B * T, D)
        weights = (self.w_gate[...].astype(dt), self.w_up[...].astype(dt), self.w_down[...].astype(dt))
        experts_NxK = experts_BxTxK.reshape(B * T, k)
        groups = None
        if weights[0].shape[1] < D:  # a slice of every expert: more data ranks than experts
            d = D // weights[0].shape[1]
            weights = (own_expert(weights[0], d, 1), own_expert(weights[1], d, 1), own_expert(weights[2], d, 2))
            groups = replica_groups(E, d)
        if weights[0].shape[0] < E:  # this data rank holds E / d of the experts: expert parallelism
            rows = buffer_rows(cfg, B, T, shards * (1 if context is None else len(context[0][0])), weights[0].shape[0])
            keep = None if keep_BxTxK is None else keep_BxTxK.reshape(B * T, k)
            y_NxD = experts_parallel(x_NxD, experts_NxK, gates_BxTxK.reshape(B * T, k).astype(dt), keep, *weights,
                                     n_experts=E, rows=rows, groups=groups, kernel=cfg.moe_kernel,
                                     exchange=moe_exchange.resolve(cfg.moe_exchange, jax.default_backend()))
        else:
            if keep_BxTxK is not None:
                gates_BxTxK = gates_BxTxK * keep_BxTxK
            y_NxD = experts_dropless(x_NxD, experts_NxK, gates_BxTxK.reshape(B * T, k).astype(dt), *weights,
                                     kernel=cfg.moe_kernel)
        out_BxTxD = y_NxD.reshape(B, T, D)
        if sequence_shard:  # the routed output is this shard's, whole; shared experts stay tensor-parallel
            return out_BxTxD + (exit_tp(self.shared(enter_tp(x_BxTxD))) if cfg.n_shared_experts else 0)
        if cfg.n_shared_experts:
            out_BxTxD = out_BxTxD + self.shared(x_BxTxD)
        # Row-parallel under tensor parallelism: expert and shared outputs are partial sums over `model`.
        return exit_tp(out_BxTxD)

    def shared(self, x_BxTxD: jax.Array) -> jax.Array:
        """The shared experts (one SwiGLU MLP), as a partial sum under tensor parallelism."""
        dt = cfg_dtype(self.cfg)
        h = swiglu(linear(x_BxTxD, self.shared_gate[...].astype(dt)), linear(x_BxTxD, self.shared_up[...].astype(dt)))
        h = constrain(h, ("batch", "seq", "mlp"))
        return linear(h, self.shared_down[...].astype(dt))


def cfg_dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype)


def route(cfg: ModelConfig, logits_BxTxE: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(gates [B, T, k] float32, expert ids [B, T, k] int32) of each token's top-k experts: chosen
    by score (softmax probability; or sigmoid score + the balancing bias, which decides the choice
    only, not the weights: DeepSeek-V3), within the token's best `router_topk_groups` groups when
    experts are grouped (`limit_to_groups`); weighted by score, renormalised
    (`router_norm_topk`) and scaled by `router_scaling`."""
    k = cfg.experts_per_token
    scores = jax.nn.softmax(logits_BxTxE, axis=-1) if cfg.router == "softmax" else jax.nn.sigmoid(logits_BxTxE)
    choice = scores if cfg.router == "softmax" else scores + jax.lax.stop_gradient(bias)
    _, experts = jax.lax.top_k(limit_to_groups(cfg, choice), k)
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.router_norm_topk:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return gates * cfg.router_scaling if cfg.router_scaling != 1.0 else gates, experts


def limit_to_groups(cfg: ModelConfig, choice_BxTxE: jax.Array) -> jax.Array:
    """DeepSeek-V3's group-limited routing: the experts are `router_groups` groups of consecutive
    ids, a group scored by the sum of its two best choice scores; outside a token's best
    `router_topk_groups` groups the choice scores become −inf, so its top-k lies inside them.
    Unchanged with one group."""
    G = cfg.router_groups
    if G == 1:
        return choice_BxTxE
    *lead, E = choice_BxTxE.shape
    grouped = choice_BxTxE.reshape(*lead, G, E // G)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., G]
    _, best = jax.lax.top_k(group_scores, cfg.router_topk_groups)
    keep = jnp.sum(jax.nn.one_hot(best, G, dtype=jnp.int32), axis=-2) > 0  # [..., G]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice_BxTxE.shape)


def keep_mask(cfg: ModelConfig, experts_BxTxK: jax.Array, shards: int = 1, context=None) -> jax.Array:
    """1 where an assignment fits its expert's capacity in its sequence, else 0 (float32). The
    assignments queue choice-major: every token's first choice, in sequence order, then every
    second choice, and so on. With the sequence split into `shards` (this rank's tokens are one
    shard), the queue runs over the whole sequence: the counts of the other shards are gathered.
    With context parallelism (`context`: the layout's groups, `whole` and `own`) a rank's tokens
    are chunks from across the sequence: the group's choices (int32, k per token) are gathered
    into whole sequences, queued as on one device, and this rank's tokens taken back."""
    if context is not None:
        _, whole, own = context
        row = experts_BxTxK
        if shards > 1:  # this model rank's piece of its data rank's tokens: the whole row first
            every = gather_sequence_shards(row)  # [shards, B, T / shards, k]
            row = jnp.moveaxis(every, 0, 1).reshape(row.shape[0], -1, row.shape[2])
        keep = own(keep_mask(cfg, whole(row)))
        if shards > 1:
            n = experts_BxTxK.shape[1]
            keep = jax.lax.dynamic_slice_in_dim(keep, sequence_shard_index() * n, n, axis=1)
        return keep
    B, T, k = experts_BxTxK.shape
    onehot = jax.nn.one_hot(jnp.swapaxes(experts_BxTxK, 1, 2), cfg.n_experts, dtype=jnp.int32)  # [B, k, T, E]
    counts = jnp.sum(onehot, axis=2)  # [B, k, E]: this shard's assignments per choice and expert
    earlier = jnp.zeros_like(counts)  # ... of the same choice in the shards before this one
    total = counts
    if shards > 1:
        every = gather_sequence_shards(counts)  # [shards, B, k, E]
        before = jnp.arange(shards) < sequence_shard_index()
        earlier = jnp.sum(every * before[:, None, None, None], axis=0)
        total = jnp.sum(every, axis=0)
    queued = jnp.cumsum(total, axis=1) - total + earlier  # ahead of this shard's choice-j assignments
    position = jnp.cumsum(onehot, axis=2) - onehot + queued[:, :, None, :]  # [B, k, T, E]
    pos = jnp.sum(position * onehot, axis=-1)  # [B, k, T]: place in its expert's queue
    return jnp.swapaxes(pos < capacity(cfg, T * shards), 1, 2).astype(jnp.float32)


# Rows per block of the grouped matmul on backends without a ragged dot (`_blocked`).
GROUP_BLOCK = 128


def grouped(x_MxC: jax.Array, w_ExCxO: jax.Array, sizes_E: jax.Array, kernel: str = "auto") -> jax.Array:
    """Rows grouped by expert (the first sizes[0] rows expert 0's, ...) times their expert's
    matrix; rows past the groups come out 0. `kernel` is `model.moe_kernel` (`_grouped`). Named
    `DOT_TAG`, so that remat `dots` saves it as it saves a dense matmul's output (its policy does
    not see any of the forms as a weight matmul)."""
    if fp8.active():  # model.fp8: e4m3 rows and experts (one scale each), an e5m2 output cotangent
        axes = (*varying_axes(x_MxC), *varying_axes(w_ExCxO))
        f = functools.partial(_grouped, kernel=kernel)
        return checkpoint_name(fp8.apply(f, vary(x_MxC, axes), vary(w_ExCxO, axes), sizes_E), DOT_TAG)
    return checkpoint_name(_grouped(x_MxC, w_ExCxO, sizes_E, kernel), DOT_TAG)


def _grouped(x_MxC: jax.Array, w_ExCxO: jax.Array, sizes_E: jax.Array, kernel: str = "auto") -> jax.Array:
    """The grouped matmul `model.moe_kernel` names. auto: blockwise on CPU (`_blocked`: jax lowers
    `ragged_dot` there to one dense dot of every row with every expert, E times the work), and
    `jax.lax.ragged_dot` on GPU and TPU (XLA:GPU's dense rewrite of it is slow, docs/moe.md, but no
    GPU has measured the Pallas kernel against it yet: the choice waits for those figures).
    pallas: `grouped_gemm.gmm`, the routed rows only, forward and both gradients."""
    if kernel == "pallas":
        axes = (*varying_axes(x_MxC), *varying_axes(w_ExCxO))
        return grouped_gemm.gmm(vary(x_MxC, axes), vary(w_ExCxO, axes), sizes_E)
    if kernel == "ragged_dot" or (kernel == "auto" and jax.default_backend() != "cpu"):
        return jax.lax.ragged_dot(x_MxC, w_ExCxO, sizes_E)
    if kernel != "auto":
        raise ValueError(f"model.moe_kernel = {kernel!r} is none of auto, ragged_dot, pallas")
    return _blocked(x_MxC, w_ExCxO, sizes_E)


def _blocked(x_MxC: jax.Array, w_ExCxO: jax.Array, sizes_E: jax.Array) -> jax.Array:
    """The grouped matmul as a scan over blocks of b rows: each group padded to a multiple of b
    (ceil(M/b) + E blocks, enough for any sizes), each block multiplied by its group's matrix,
    blocks past the last group skipped (a `lax.cond`: an expert-parallel receive buffer is mostly
    empty). The work is that of the rows plus at most E·b padding rows (MegaBlocks' layout,
    looped). Its own backward: the input's gradient the same way with the matrices transposed,
    the weights' accumulated block by block (autodiff of the scan would keep every block's
    weight slice as a residual: blocks x C x O)."""
    axes = (*varying_axes(x_MxC), *varying_axes(w_ExCxO))
    return _blocked_vjp(vary(x_MxC, axes), vary(w_ExCxO, axes), sizes_E)


def _block_layout(M: int, E: int, sizes_E: jax.Array):
    """(b, blocks, slot of each row (blocks·b: none), group of each block, blocks in use)."""
    b = min(GROUP_BLOCK, M)
    blocks = -(-M // b) + E
    ends = jnp.cumsum(sizes_E)
    padded = -(-sizes_E // b) * b
    padded_ends = jnp.cumsum(padded)
    row = jnp.arange(M)
    # (Counts of group ends passed, not `jnp.searchsorted`: that fails on manual-axis-typed
    # values inside a shard_map in jax 0.10.2.)
    group = jnp.sum(row[:, None] >= ends[None, :], axis=1)  # E for rows past the groups
    g = jnp.minimum(group, E - 1)
    slot = jnp.where(group < E, padded_ends[g] - padded[g] + row - (ends[g] - sizes_E[g]), blocks * b)
    block_group = jnp.minimum(jnp.sum((jnp.arange(blocks) * b)[:, None] >= padded_ends[None, :], axis=1), E - 1)
    return b, blocks, slot, block_group, padded_ends[-1] // b


def _to_blocks(x_MxC, slot, b, blocks):
    out = vary(jnp.zeros((blocks * b, x_MxC.shape[1]), x_MxC.dtype), varying_axes(x_MxC))
    return out.at[slot].set(x_MxC, mode="drop").reshape(blocks, b, x_MxC.shape[1])


def _from_blocks(y_blocks, slot, b, blocks):
    y = jnp.take(y_blocks.reshape(blocks * b, -1), jnp.minimum(slot, blocks * b - 1), axis=0)
    return jnp.where((slot < blocks * b)[:, None], y, 0)


def _blocked_matmul(x_MxC, w_ExCxO, sizes_E):
    M, _ = x_MxC.shape
    E, _, O = w_ExCxO.shape
    b, blocks, slot, block_group, used = _block_layout(M, E, sizes_E)
    dtype = jnp.result_type(x_MxC.dtype, w_ExCxO.dtype)
    axes = (*varying_axes(x_MxC), *varying_axes(w_ExCxO))

    def block(_, xs):
        x_bxC, e, j = xs
        y = jax.lax.cond(j < used, lambda: x_bxC @ w_ExCxO[e], lambda: vary(jnp.zeros((b, O), dtype), axes))
        return None, y

    _, yb = jax.lax.scan(block, None, (_to_blocks(x_MxC, slot, b, blocks), block_group, jnp.arange(blocks)))
    return _from_blocks(yb, slot, b, blocks).astype(dtype)


@jax.custom_vjp
def _blocked_vjp(x_MxC, w_ExCxO, sizes_E):
    return _blocked_matmul(x_MxC, w_ExCxO, sizes_E)


def _blocked_fwd(x_MxC, w_ExCxO, sizes_E):
    return _blocked_matmul(x_MxC, w_ExCxO, sizes_E), (x_MxC, w_ExCxO, sizes_E)


def _blocked_bwd(res, g_MxO):
    x_MxC, w_ExCxO, sizes_E = res
    M, C = x_MxC.shape
    E = w_ExCxO.shape[0]
    g_MxO = g_MxO.astype(x_MxC.dtype)
    dx = _blocked_matmul(g_MxO, jnp.swapaxes(w_ExCxO, 1, 2), sizes_E).astype(x_MxC.dtype)
    b, blocks, slot, block_group, used = _block_layout(M, E, sizes_E)

    def block(dw, xs):
        x_bxC, g_bxO, e, j = xs
        return jax.lax.cond(j < used, lambda dw: dw.at[e].add((x_bxC.T @ g_bxO).astype(dw.dtype)), lambda dw: dw, dw), None

    dw0 = zeros_like_varying(w_ExCxO)
    dw, _ = jax.lax.scan(block, dw0, (_to_blocks(x_MxC, slot, b, blocks), _to_blocks(g_MxO, slot, b, blocks),
                                      block_group, jnp.arange(blocks)))
    return dx, dw, None


_blocked_vjp.defvjp(_blocked_fwd, _blocked_bwd)


def experts_dropless(x_NxD, experts_NxK, gates_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD,
                     kernel: str = "auto") -> jax.Array:
    """sum_j gate_j x expert_{e_j}(x) for every token: the N*k assignments sorted by expert, each
    expert's SwiGLU as grouped matmuls over its run of rows (`kernel`: `grouped`), and the rows
    put back in order."""
    N, k = experts_NxK.shape
    E = w_gate_ExDxF.shape[0]
    flat = experts_NxK.reshape(N * k)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x_NxD[order // k]
    h = swiglu(grouped(xs, w_gate_ExDxF, sizes, kernel), grouped(xs, w_up_ExDxF, sizes, kernel))
    ys = grouped(h, w_down_ExFxD, sizes, kernel)
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
    return jnp.einsum("nkd,nk->nd", y.reshape(N, k, -1), gates_NxK)


def own_expert(w_ExAxB: jax.Array, d: int, axis: int) -> jax.Array:
    """More data ranks (d) than experts (E), each expert replicated on r = d / E ranks (rank q
    runs expert q // r): every rank stores a 1/d slice along `axis` (the `embed` dim) of every
    expert, and this assembles the rank's own expert whole, [1, A, B], by one all-to-all over
    `data` (rank j is sent the slice of expert j // r). Its transpose sends each replica's
    gradient slices back to where they are stored, where the r replicas' gradients of each slice
    are summed (the transpose of the local gather): the expert's gradient complete, reduced over
    its replicas only, in (d-1)/d of one expert's bytes per rank each way."""
    E = w_ExAxB.shape[0]
    owner = jnp.arange(d) // (d // E)
    return jax.lax.all_to_all(w_ExAxB[owner], "data", 0, axis, tiled=True)


def replica_groups(n_experts: int, d: int) -> list[list[int]]:
    """The data ranks that exchange tokens when each expert has r = d / E replicas: r groups of E
    ranks, group j = {j, j + r, ..., j + (E-1)·r}, whose e-th member runs expert e (`own_expert`).
    A token goes to the replica of its expert in its own rank's group: on a balanced load every
    replica serves as many tokens as an unreplicated expert's rank does."""
    r = d // n_experts
    return [[j + e * r for e in range(n_experts)] for j in range(r)]


def experts_parallel(x_NxD, experts_NxK, gates_NxK, keep_NxK, w_gate, w_up, w_down, *, n_experts: int, rows: int,
                     groups: list[list[int]] | None = None, kernel: str = "auto", exchange: str = "fixed") -> jax.Array:
    """`experts_dropless` with the experts split over the data ranks (this rank holds
    experts [r·El, (r+1)·El), El = n_experts / d): each assignment travels to its expert's rank,
    the rank runs its experts as grouped matmuls over what arrived from every rank, and the
    results travel back (and in the backward pass the transposes, the same exchanges reversed).
    `exchange` (`jaxpar.model.moe_exchange`): fixed, a buffer of `rows` rows per destination rank
    (the worst case, so no assignment is ever dropped) by all-to-alls; ragged, only the routed
    rows, by ragged all-to-alls. Dropped assignments (capacity mode, `keep_NxK` 0) are not sent.
    With `groups` (replicated experts, `replica_groups`) the exchange runs within this rank's
    group of n_experts ranks, one expert each. One argsort per layer (the sender's, by expert):
    the receiver groups its rows by local expert without sorting."""
    N, k = experts_NxK.shape
    D = x_NxD.shape[1]
    El = w_gate.shape[0]
    d = n_experts // El
    axes = varying_axes(x_NxD)
    flat = experts_NxK.reshape(N * k)
    valid = jnp.ones((N * k,), bool) if keep_NxK is None else keep_NxK.reshape(N * k) > 0

    def local_experts(xs, sizes):
        h = swiglu(grouped(xs, w_gate, sizes, kernel), grouped(xs, w_up, sizes, kernel))
        return grouped(h, w_down, sizes, kernel)

    if exchange == "ragged":
        y = moe_exchange.experts_ragged(x_NxD, flat, valid, local_experts, n_experts=n_experts,
                                        recv_rows=d * rows, groups=groups)
        return jnp.einsum("nkd,nk->nd", y.reshape(N, k, D), gates_NxK)
    if exchange != "fixed":
        raise ValueError(f"exchange = {exchange!r} is neither fixed nor ragged (moe_exchange.resolve)")
    dest = jnp.where(valid, flat // El, d)  # d: not sent
    # Each assignment's row in its destination's buffer: its place among the valid assignments
    # to that rank, in order of expert (so that each rank's rows arrive grouped by expert).
    order = jnp.argsort(jnp.where(valid, flat, n_experts), stable=True)
    counts = jnp.sum(jax.nn.one_hot(dest, d, dtype=jnp.int32), axis=0)
    starts = jnp.cumsum(counts) - counts
    slot_sorted = jnp.arange(N * k) - jnp.take(jnp.concatenate([starts, jnp.zeros((1,), starts.dtype)]), dest[order])
    slot = jnp.zeros((N * k,), jnp.int32).at[order].set(slot_sorted.astype(jnp.int32), unique_indices=True)
    index = jnp.where(valid, dest * rows + slot, d * rows)  # d * rows: out of bounds, dropped by the scatter
    token = jnp.arange(N * k) // k
    send = vary(jnp.zeros((d * rows, D), x_NxD.dtype), axes).at[index].set(x_NxD[token], mode="drop")
    send_e = vary(jnp.full((d * rows,), El, jnp.int32), axes).at[index].set(flat % El, mode="drop")
    recv = exchange_experts(send, groups)  # [d * rows, D]: rows from rank 0, 1, ...
    recv_e = exchange_experts(send_e, groups)  # the local expert of each row; El: an empty row
    # Each row's place in local-expert order, stable (a counting sort: its expert's run start
    # plus the rows of that expert before it, not a second argsort), the empty rows nowhere.
    onehot = jax.nn.one_hot(recv_e, El, dtype=jnp.int32)  # [d * rows, El]; all 0 for an empty row
    sizes = jnp.sum(onehot, axis=0)
    before = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    place = jnp.where(recv_e < El, (jnp.cumsum(sizes) - sizes)[jnp.minimum(recv_e, El - 1)] + before, d * rows)
    xs = jnp.zeros_like(recv).at[place].set(recv, mode="drop", unique_indices=True)
    ys = local_experts(xs, sizes)
    y_recv = jnp.where((recv_e < El)[:, None], jnp.take(ys, jnp.minimum(place, d * rows - 1), axis=0), 0)
    back = exchange_experts(y_recv, groups)  # each row back where it was sent from
    y = jnp.where(valid[:, None], jnp.take(back, jnp.minimum(index, d * rows - 1), axis=0), 0)
    return jnp.einsum("nkd,nk->nd", y.reshape(N, k, D), gates_NxK)


# --------------------------------------------------------------------------------------------
# The router losses' gradient and the router's report, through one custom VJP


def router_losses(cfg: ModelConfig, logits_BxTxE: jax.Array, bias: jax.Array | None, shards: int = 1,
                  context: tuple[tuple[int, ...], ...] | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per sequence [B]: the load-balancing loss, the z-loss, the dropped fraction, and the loads
    [B, E] (the fraction of the sequence's assignments each expert received). With the sequence
    split into `shards` over `model` (these logits are one shard's), and over the data ranks of
    `context`'s groups (context parallelism: the layout's groups, `whole` and `own`), each is this
    shard's share:
    the shards' values add up to the sequence's (the loss takes its loads from the whole sequence)."""
    E, k = cfg.n_experts, cfg.experts_per_token
    _, experts = route(cfg, jax.lax.stop_gradient(logits_BxTxE), bias)
    c = 1 if context is None else len(context[0][0])
    T = logits_BxTxE.shape[1] * shards * c
    counts_BxE = jnp.sum(jax.nn.one_hot(experts, E, dtype=jnp.float32), axis=(1, 2))
    load_BxE = counts_BxE / (T * k)
    seq_counts = counts_BxE if shards == 1 else jnp.sum(gather_sequence_shards(counts_BxE), axis=0)
    if context is not None:  # the counts of the sequence's other chunks, on the group's other ranks
        # (An all-gather and a sum: jax's psum takes no axis_index_groups inside a shard_map.)
        every = jax.lax.all_gather(seq_counts, "data", axis_index_groups=[list(g) for g in context[0]])
        seq_counts = jnp.sum(every, axis=0)
    seq_load = seq_counts / (T * k)
    probs = (jax.nn.softmax(logits_BxTxE, axis=-1) if cfg.router == "softmax"
             else _normalized(jax.nn.sigmoid(logits_BxTxE)))
    aux = E * jnp.sum(seq_load * jnp.sum(probs, axis=1) / T, axis=-1)
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_BxTxE, axis=-1)), axis=1) / T
    if cfg.capacity_factor is None:
        dropped = jnp.zeros_like(aux)
    else:
        dropped = jnp.sum(1.0 - keep_mask(cfg, experts, shards, context), axis=(1, 2)) / (T * k)
    return aux, z, dropped, load_BxE


def _normalized(scores):
    return scores / jnp.sum(scores, axis=-1, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _router_losses(logits, stats, bias, cfg, weight, shards, context):
    return logits


def _router_losses_fwd(logits, stats, bias, cfg, weight, shards, context):
    return logits, (logits, stats, bias)


def _router_losses_bwd(cfg, weight, shards, context, res, g):
    logits, stats, bias = res

    def objective(lg):
        aux, z, _, _ = router_losses(cfg, lg, bias, shards, context)
        return weight * jnp.sum(cfg.router_aux_loss * aux + cfg.router_z_loss * z)

    d_logits = jax.grad(objective)(logits)
    aux, z, dropped, load = router_losses(cfg, logits, bias, shards, context)
    report = weight * jnp.concatenate([jnp.sum(load, axis=0), jnp.stack([jnp.sum(aux), jnp.sum(z), jnp.sum(dropped)])])
    report = vary(report.astype(stats.dtype), varying_axes(stats))
    return g + d_logits.astype(g.dtype), report, None if bias is None else zeros_like_varying(bias)


_router_losses.defvjp(_router_losses_fwd, _router_losses_bwd)
