"""Context parallelism: c of the `data` axis's ranks split each sequence (`parallel.context: c`).

The design's three mesh axes stay as they are: the data ranks form groups of c consecutive ranks
(rank i is context rank j = i mod c of group g = i div c); a group holds B / (data / c) sequences
of the global batch, each cut into 2c chunks of L = T / 2c tokens, and its context rank j holds
chunks j and 2c − 1 − j of each (the zigzag of Megatron-Core, torchtitan's `headtail`, MaxText's
`dual_chunk_swap`): under causal attention chunk j reads j + 1 chunks of keys and chunk
2c − 1 − j reads 2c − j, 2c + 1 in all whatever j, so every rank does the same attention work.
Everything but attention is per token: the rank runs the model on its 2L tokens as on a row of its
own, and its gradients join the data axis's reduction and ZeRO shards like any data rank's (each
rank's loss is its tokens' share of the global sum, `microbatches.loss_tokens`).

Attention reads the keys and values of the whole sequence (`parallel.context_attention`):
- `all_gather` (Llama 3's): K and V all-gathered over the group inside the attention; their
  cotangents reduce-scattered back (the all-gather's transpose).
- `ring`: K and V blocks passed around the group's ring by `ppermute`, c − 1 hops, each step's
  partial attention merged by its log-sum-exp; the backward passes dK and dV around with their
  blocks and home (Liu et al., 2023; TransformerEngine-JAX's ring).
Both compute each block with the tiled kernel (`jaxpar.model.tiled_attention`) over the tile pairs
the causal mask leaves, from static tables indexed by the rank's j.

The batch keeps its shape [B, T + 1]; `windows` cuts its rows into the chunks' token windows
[B · 2c, L + 1] (a token window overlaps the next chunk's first token, its last target), ordered so
that the data axis's shard of rank i is its chunks; `loss_rows` puts a rank's two chunks of each
sequence back side by side.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import Config
from jaxpar.parallel.gradients import DATA
from jaxpar.model import qk_clip, tiled_attention as ta
from jaxpar.model.layers import Sequence, document_positions, document_segments
from jaxpar.model.mtp import cut, pad


def groups(d: int, c: int) -> list[list[int]]:
    """The context groups of a data axis of d ranks: c consecutive ranks each."""
    return [[g * c + j for j in range(c)] for g in range(d // c)]


def chunks_of(j: int, c: int) -> tuple[int, int]:
    """The two chunks (of 2c) of each sequence that context rank j holds: j and 2c − 1 − j."""
    return j, 2 * c - 1 - j


def positions(c: int, L: int) -> np.ndarray:
    """int32 [c, 2L]: the positions in the whole sequence of context rank j's tokens (its two chunks
    side by side); row-major, it is the order an all-gather over the group puts the tokens in."""
    return np.stack([np.concatenate([np.arange(k * L, (k + 1) * L) for k in chunks_of(j, c)])
                     for j in range(c)]).astype(np.int32)


def windows(batch_BxT1: jax.Array, c: int, d: int, extra: int = 0) -> jax.Array:
    """The chunks' token windows [B · 2c, L + 1 + extra] of a batch [B, T + 1 + extra] (inputs and
    shifted targets, and `extra` tokens more for multi-token prediction's depths: `model.mtp.pad`),
    in the data axis's order: group g, context rank j, the group's sequence s, chunk (j, 2c − 1 − j),
    so that data rank g·c + j's contiguous share is its chunks of its group's sequences."""
    B, T1 = batch_BxT1.shape
    L = (T1 - 1 - extra) // (2 * c)
    order = [k for j in range(c) for k in chunks_of(j, c)]
    w = jnp.stack([batch_BxT1[:, k * L:k * L + L + 1 + extra] for k in order], axis=1)  # [B, 2c, L + 1 + extra]
    w = w.reshape(d // c, B * c // d, c, 2, L + 1 + extra).transpose(0, 2, 1, 3, 4)
    return w.reshape(B * 2 * c, L + 1 + extra)


def loss_rows(rows: jax.Array, shift: int = 0, extra: int = 0) -> tuple[jax.Array, jax.Array]:
    """A rank's windows [2n, L + 1 + extra] (`windows`) as inputs and targets [n, 2L], `shift`
    tokens ahead (multi-token prediction's depths; 0: the model's): each sequence's two chunks side
    by side, as `positions` orders them."""
    n2, W = rows.shape
    L = W - 1 - extra
    return (rows[:, shift:shift + L].reshape(n2 // 2, 2 * L),
            rows[:, shift + 1:shift + 1 + L].reshape(n2 // 2, 2 * L))


def row_split(cfg: Config) -> Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]:
    """`split(rows, shift) -> (inputs, targets)` of the step's rows (windows [B, T + 1 + D] of the
    batch, or chunk windows under context parallelism), `shift` tokens ahead (0: the model's; D =
    `model.mtp_depth`)."""
    D = cfg.model.mtp_depth
    if cfg.parallel.context > 1:
        return lambda rows, shift: loss_rows(rows, shift, D)
    return lambda rows, shift: cut(rows, shift, D)


def gather_pairs(c: int, m: int) -> np.ndarray:
    """int32 [c, P, 2]: for each context rank, the (query tile, key tile) pairs of its all-gather
    attention in tiles of L / m tokens: its 2m query tiles against the group's 2cm key tiles in the
    all-gather's order, those with a key not after the query (P = m²(2c − 1) + m(m + 1), the same
    for every rank: the zigzag's balance)."""
    tile_of = positions(c, m)  # a tile's index in the sequence: the chunks' positions in tiles of one
    keys = tile_of.reshape(-1)
    tables = [np.array([(u, kt) for u in range(2 * m) for kt in range(2 * c * m) if keys[kt] <= tile_of[j, u]],
                       np.int32) for j in range(c)]
    assert len({len(t) for t in tables}) == 1, [len(t) for t in tables]
    return np.stack(tables)


def ring_pairs(c: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The tile pairs of a ring attention's steps: int32 [c, P0, 2] of step 0 (the rank's own
    blocks) and [c, c − 1, P, 2] of steps 1 .. c − 1 (the block of rank j − s), P = 2m²: a block
    from an earlier rank is read whole by half of the queries, a later one's by the other half."""
    tile_of = positions(c, m)

    def table(j, r):
        return [(u, v) for u in range(2 * m) for v in range(2 * m) if tile_of[r, v] <= tile_of[j, u]]

    own = np.stack([np.array(table(j, j), np.int32) for j in range(c)])
    steps = [[np.array(table(j, (j - s) % c), np.int32) for s in range(1, c)] for j in range(c)]
    assert len({len(t) for row in steps for t in row}) <= 1, [[len(t) for t in row] for row in steps]
    return own, np.stack([np.stack(row) for row in steps]) if c > 1 else np.zeros((c, 0, 0, 2), np.int32)


def layout(cfg: Config, inputs_BxT: jax.Array, d: int, eos: int | None) -> Sequence:
    """The `Sequence` of this context rank's tokens [B, 2L] (inside the step's shard_map over
    `data`): their positions in the whole sequence (or, with document masking, in their document:
    the tokens of the whole sequence are all-gathered over the group, ints, to find where documents
    end), their documents, and the context-parallel attention."""
    c = cfg.parallel.context
    L = inputs_BxT.shape[1] // 2
    grp = groups(d, c)
    j = jax.lax.axis_index(DATA) % c
    table = jnp.asarray(positions(c, L))
    mine = table[j]  # [2L]
    segments = segments_all = None
    pos = jnp.broadcast_to(mine[None], inputs_BxT.shape)
    whole = functools.partial(_whole, c=c, L=L, groups=grp)
    if eos is not None:
        from jaxpar.model.transformer import token_ids

        seg_whole = document_segments(whole(token_ids(inputs_BxT)), eos)
        segments, pos = seg_whole[:, mine], document_positions(seg_whole)[:, mine]
        segments_all = seg_whole[:, table.reshape(-1)]  # in the all-gather's order
    kind = cfg.parallel.context_attention
    attend = functools.partial(_all_gather if kind == "all_gather" else _ring, c=c, j=j, groups=grp, L=L,
                               segments=segments, segments_all=segments_all, seg_whole=None if eos is None else seg_whole)
    return Sequence(pos, segments, attend, tuple(map(tuple, grp)), whole, functools.partial(_own, c=c, L=L))


def _whole(x, *, c, L, groups):
    """x [B, 2L, ...] of this rank's tokens gathered over its group into whole sequences
    [B, 2cL, ...] in order."""
    gathered = jax.lax.all_gather(x, DATA, axis=1, tiled=True, axis_index_groups=groups)
    return gathered[:, np.argsort(positions(c, L).reshape(-1))]


def _own(x, *, c, L):
    """This context rank's tokens [B, 2L, ...] of whole sequences [B, 2cL, ...]."""
    return jnp.take(x, jnp.asarray(positions(c, L))[jax.lax.axis_index(DATA) % c], axis=1)


def _tiles(L: int) -> tuple[int, int]:
    """(tile size, tiles per chunk) for chunks of L tokens."""
    b = ta.tile(L)
    return b, L // b


def _record(q, k, *, c, j, groups, L, segments, segments_all):
    """train.qk_clip: this rank's queries' per-head largest logit against the whole sequence's
    keys (an all-gather of K over the group, forward only, while recording: `jaxpar.model.qk_clip`)."""
    table = jnp.asarray(positions(c, L))

    def where():
        keys = jax.lax.all_gather(jax.lax.stop_gradient(k), DATA, axis=1, tiled=True,
                                  axis_index_groups=[list(g) for g in groups])
        return keys, table[j], table.reshape(-1), segments, segments_all

    qk_clip.record(q, None, segments, where)


def _all_gather(q, k, v, cfg, *, c, j, groups, L, segments, segments_all, seg_whole):
    _record(q, k, c=c, j=j, groups=groups, L=L, segments=segments, segments_all=segments_all)
    b, m = _tiles(L)
    K = k.shape[2]
    B, T, N, H = q.shape
    table = jnp.asarray(positions(c, L))
    mask = ta.Mask(table[j], table.reshape(-1), segments, segments_all)
    o = _gathered_attention(ta.heads_major(q, K), ta.kv_heads_major(k), ta.kv_heads_major(v),
                            _Static(c, tuple(map(tuple, groups)), b, 1.0 / float(H) ** 0.5),
                            (mask, jnp.asarray(gather_pairs(c, m))[j]))
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, T, N, H)


def _gather(x, groups):
    """Heads-major K or V [B, K, 2L, H] of this rank, all-gathered over its group: [B, K, 2cL, H]."""
    return jax.lax.all_gather(x, DATA, axis=2, tiled=True, axis_index_groups=[list(g) for g in groups])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gathered_attention(q, k, v, static, aux):
    c, groups, b, scale = static
    mask, pairs = aux
    return ta.forward(q, _gather(k, groups), _gather(v, groups), mask, pairs, b, scale)[0].astype(q.dtype)


def _gathered_attention_fwd(q, k, v, static, aux):
    # Saves this rank's K and V, not the gathered ones: the backward gathers them again (as
    # TransformerEngine's all-gather context parallelism does), so the whole sequence's K and V is
    # held one layer at a time, not once per layer until the backward reaches it.
    c, groups, b, scale = static
    mask, pairs = aux
    o, lse = ta.forward(q, _gather(k, groups), _gather(v, groups), mask, pairs, b, scale)
    o = o.astype(q.dtype)
    return o, (q, k, v, o, lse, aux)


def _gathered_attention_bwd(static, res, do):
    c, groups, b, scale = static
    q, k, v, o, lse, (mask, pairs) = res
    dq, dk, dv = ta.backward(q, _gather(k, groups), _gather(v, groups), do, lse, ta.delta_of(o, do), mask, pairs,
                             b, scale)
    # The cotangents of the whole K and V go home reduce-scattered in their dtype (the all-gather's
    # transpose: the bytes the planner and inspector count).
    scatter = lambda x, like: jax.lax.psum_scatter(x.astype(like.dtype), DATA, scatter_dimension=2, tiled=True,  # noqa: E731
                                                   axis_index_groups=[list(g) for g in groups])
    return dq.astype(q.dtype), scatter(dk, k), scatter(dv, v), None


_gathered_attention.defvjp(_gathered_attention_fwd, _gathered_attention_bwd)


def _ring(q, k, v, cfg, *, c, j, groups, L, segments, segments_all, seg_whole):
    _record(q, k, c=c, j=j, groups=groups, L=L, segments=segments, segments_all=segments_all)
    b, m = _tiles(L)
    K = k.shape[2]
    table = jnp.asarray(positions(c, L))
    own, steps = ring_pairs(c, m)
    B, T, N, H = q.shape
    segs = None if seg_whole is None else jnp.stack([seg_whole[:, table[r]] for r in range(c)])  # [c, B, 2L]
    o = _ring_attention(ta.heads_major(q, K), ta.kv_heads_major(k), ta.kv_heads_major(v),
                        _Static(c, tuple(map(tuple, groups)), b, 1.0 / float(H) ** 0.5),
                        (j, table, segs, jnp.asarray(own), jnp.asarray(steps)))
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, T, N, H)


class _Static(tuple):
    """(c, groups, tile, scale): what the context attentions' custom VJPs take as static."""

    def __new__(cls, c, groups, block, scale):
        return super().__new__(cls, (c, groups, block, scale))


def _hop(x, c, groups):
    """x passed one step round each group's ring: rank j's to rank j + 1 (mod c)."""
    perm = [(g[i], g[(i + 1) % c]) for g in groups for i in range(c)]
    return jax.lax.ppermute(x, DATA, perm)


def _step_mask(aux, s):
    """The mask of ring step s: this rank's queries against the block of rank (j − s) mod c."""
    j, table, segs, _, _ = aux
    c = table.shape[0]
    r = (j - s) % c
    return ta.Mask(table[j], table[r], None if segs is None else segs[j], None if segs is None else segs[r])


def _step_pairs(aux, s):
    j, _, _, own, steps = aux
    return own[j] if s == 0 else steps[j, s - 1]


def _ring_forward(q, k, v, static, aux):
    c, groups, b, scale = static
    o, lse = ta.forward(q, k, v, _step_mask(aux, 0), _step_pairs(aux, 0), b, scale)
    kv = (k, v)
    for s in range(1, c):
        kv = _hop(kv, c, groups)
        o_s, lse_s = ta.forward(q, *kv, _step_mask(aux, s), _step_pairs(aux, s), b, scale)
        o, lse = ta.merge(o, lse, o_s, lse_s)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring_attention(q, k, v, static, aux):
    return _ring_forward(q, k, v, static, aux)[0].astype(q.dtype)


def _ring_attention_fwd(q, k, v, static, aux):
    o, lse = _ring_forward(q, k, v, static, aux)
    o = o.astype(q.dtype)
    return o, (q, k, v, o, lse, aux)


def _ring_attention_bwd(static, res, do):
    c, groups, b, scale = static
    q, k, v, o, lse, aux = res
    delta = ta.delta_of(o, do)
    dq = jnp.zeros(q.shape, jnp.float32)
    kv, dkv = (k, v), None
    for s in range(c):
        if s:
            kv = _hop(kv, c, groups)
            dkv = _hop(dkv, c, groups)
        dq_s, dk_s, dv_s = ta.backward(q, *kv, do, lse, delta, _step_mask(aux, s), _step_pairs(aux, s), b, scale)
        dq = dq + dq_s
        # dK and dV travel with their block in its dtype (the bytes of the all-gather's reduce-scatter).
        step = (dk_s.astype(k.dtype), dv_s.astype(v.dtype))
        dkv = step if dkv is None else (dkv[0] + step[0], dkv[1] + step[1])
    dkv = _hop(dkv, c, groups) if c > 1 else dkv  # the last hop takes each block's gradient home
    return dq.astype(q.dtype), dkv[0], dkv[1], None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def wrap_batch(loss_and_grads: Callable, c: int, d: int, extra: int = 0) -> Callable:
    """`loss_and_grads(params, windows)` of the step's shard_map, taking the batch [B, T + 1]: its
    rows with `extra` masked tokens appended (multi-token prediction: `model.mtp.pad`), cut into
    chunk windows under context parallelism."""
    if c == 1 and not extra:
        return loss_and_grads
    if c == 1:
        return lambda params, batch: loss_and_grads(params, pad(batch, extra))
    return lambda params, batch: loss_and_grads(params, windows(pad(batch, extra), c, d, extra))
