"""Attention tiled over queries and keys with an online softmax (flash attention in plain JAX).

The one kernel behind every attention that does not run cuDNN's fused kernel on a long sequence,
a packed sequence (document masking) or a sequence split over devices (context parallelism):

- **Tiles.** Queries and keys are cut into tiles of `block` positions; the work is a list of
  (query tile, key tile) pairs, `pairs` [P, 2] int32, that a `lax.scan` walks. A pair that the
  mask hides entirely is not in the list: for a causal sequence on one device the list is the
  lower triangle of tiles (`causal_pairs`), n (n + 1) / 2 of the n² tiles, so the work is the
  causal optimum plus the diagonal tiles' masked halves. The list may be a traced array (a
  context-parallel rank's tiles depend on its index), but its length is static, so every rank runs
  the same program.
- **Mask.** Query and key positions are indices into the whole sequence (`q_index` [T], `k_index`
  [S]: a rank's tiles of a zigzag layout are not contiguous); key s is visible to query t when
  k_index[s] <= q_index[t] and, with document masking, both lie in one document (`q_segment`
  [B, T], `k_segment` [B, S]).
- **Forward** (Dao et al., 2022, algorithm 1): per query row a running max m, sum l and float32
  output accumulator, rescaled by exp(m_old − m_new) as tiles arrive; the probabilities of a
  masked score are 0 (a select, not a large negative), so a row that sees no key in a tile is left
  as it was and a row that sees no key at all (a context-parallel partial) comes out with o = 0 and
  lse = `MASKED`, which weighs nothing in `merge`.
- **Backward** (algorithm 2): from q, k, v, o and the float32 log-sum-exp [B, K, G, T]: each pair
  recomputes p = exp(s − lse) and adds its dq, dk and dv; the saved values are O(seq), the
  transients one tile pair's [B, K, G·block, block] float32 scores, probabilities and their
  gradients.

Layout as `jaxpar.model.lse_attention`: heads-major, q [B, K, G, T, H] (G = N / K grouped query
heads of a kv head as rows of one matmul), k and v [B, K, S, H]. `attention` is the differentiable
entry; `forward`, `backward` and `merge` are the pieces a ring of key blocks composes
(`jaxpar.parallel.context`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.sharding import vary, varying_axes

BLOCK = 512
"""Default tile: 512 positions (at seq 4,096, a tile pair's [512, 512] scores are 1/8 of the
`xla_lse` kernel's largest query block, [512, 4096])."""

MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
"""The log-sum-exp of a row that saw no key, and the running max before any: finite, so that
exp(MASKED − m) is 0 and never NaN."""


class Mask(NamedTuple):
    """What the mask reads: the positions of queries and keys in the whole sequence (int32 [T] and
    [S]) and, with document masking, each token's document (int32 [B, T] and [B, S]; else None)."""

    q_index: jax.Array
    k_index: jax.Array
    q_segment: jax.Array | None = None
    k_segment: jax.Array | None = None


def causal_pairs(n_q: int, n_k: int | None = None) -> np.ndarray:
    """The (query tile, key tile) pairs [P, 2] of a causal attention whose queries and keys are the
    same n tiles in order: the lower triangle, row by row (key tiles j <= i)."""
    n_k = n_q if n_k is None else n_k
    assert n_q == n_k, (n_q, n_k)
    return np.array([(i, j) for i in range(n_q) for j in range(i + 1)], np.int32).reshape(-1, 2)


MIN_TILE = 64
"""The smallest tile `tile` picks for a long sequence: below it the scan's steps cost more than
the memory they save (a sequence with no divisor in [MIN_TILE, BLOCK] runs one tile)."""


def tile(T: int, block: int | None = None) -> int:
    """The tile size for T positions: T itself when T <= block (default BLOCK), else the largest
    divisor of T that is at most `block` (T when none is at least MIN_TILE, or `block` if smaller)."""
    block = BLOCK if block is None else block
    if T <= block:
        return T
    b = next(b for b in range(block, 0, -1) if T % b == 0)
    return b if b >= min(MIN_TILE, block) else T


def heads_major(q_BxTxNxH: jax.Array, K: int) -> jax.Array:
    """[B, T, N, H] -> [B, K, G, T, H] (G = N / K)."""
    B, T, N, H = q_BxTxNxH.shape
    return jnp.transpose(q_BxTxNxH.reshape(B, T, K, N // K, H), (0, 2, 3, 1, 4))


def kv_heads_major(k_BxSxKxH: jax.Array) -> jax.Array:
    """[B, S, K, H] -> [B, K, S, H]."""
    return jnp.transpose(k_BxSxKxH, (0, 2, 1, 3))


def _carry(init, *inputs):
    """A scan's initial carry, varying (inside a shard_map) over every manual axis its inputs vary
    over, as the carry the body returns does."""
    axes = sorted({a for x in jax.tree.leaves(inputs) for a in varying_axes(x)})
    return jax.tree.map(lambda x: vary(x, axes), init) if axes else init


def _slice(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _scores(q, k, mask: Mask, qi, kj, b, scale):
    """One tile pair's scaled scores [B, K, G·b, b] float32, the visibility [B or 1, 1, G·b, b] and
    the query tile's rows [B, K, G·b, H]."""
    B, K, G, _, H = q.shape
    q_t = _slice(q, qi * b, b, 3).reshape(B, K, G * b, H)
    k_t = _slice(k, kj * b, b, 2)
    s = jnp.einsum("BKRH,BKSH->BKRS", q_t, k_t, preferred_element_type=jnp.float32) * jnp.float32(scale)
    t = jnp.tile(_slice(mask.q_index, qi * b, b, 0), G)  # row r = g·b + t
    keys = _slice(mask.k_index, kj * b, b, 0)
    segments = None
    if mask.q_segment is not None:
        segments = jnp.tile(_slice(mask.q_segment, qi * b, b, 1), (1, G)), _slice(mask.k_segment, kj * b, b, 1)
    # The mask's inputs pass a barrier with the scores: inside a loop over layers XLA otherwise finds
    # the mask loop-invariant and precomputes every tile pair's, [pairs, B, K, G·b, b] booleans (2 GiB
    # at 65,536 tokens over 8 context ranks, tile 512).
    s, t, keys, segments = jax.lax.optimization_barrier((s, t, keys, segments))
    ok = (keys[None, :] <= t[:, None])[None, None]
    if segments is not None:
        qs, ks = segments  # [B, G·b], [B, b]
        ok = ok & (qs[:, :, None] == ks[:, None, :])[:, None]
    return s, ok, q_t


def forward(q, k, v, mask: Mask, pairs, block: int, scale: float):
    """(o [B, K, G, T, H] float32, lse [B, K, G, T] float32) of heads-major q over the keys and
    values k, v that `pairs` reads; rows no pair reaches: o = 0, lse = MASKED."""
    B, K, G, T, H = q.shape
    b = block

    def step(carry, pair):
        acc, m, l = carry
        qi, kj = pair[0], pair[1]
        s, ok, _ = _scores(q, k, mask, qi, kj, b, scale)
        m_old = _slice(m, qi * b, b, 3).reshape(B, K, G * b)
        l_old = _slice(l, qi * b, b, 3).reshape(B, K, G * b)
        a_old = _slice(acc, qi * b, b, 3).reshape(B, K, G * b, H)
        m_new = jnp.maximum(m_old, jnp.max(jnp.where(ok, s, MASKED), axis=-1))
        p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m_old - m_new)
        l_new = alpha * l_old + jnp.sum(p, axis=-1)
        pv = jnp.einsum("BKRS,BKSH->BKRH", p.astype(v.dtype), _slice(v, kj * b, b, 2),
                        preferred_element_type=jnp.float32)
        a_new = alpha[..., None] * a_old + pv
        put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y.reshape(B, K, G, b, *x.shape[4:]), qi * b, 3)  # noqa: E731
        return (put(acc, a_new), put(m, m_new), put(l, l_new)), None

    init = (jnp.zeros((B, K, G, T, H), jnp.float32), jnp.full((B, K, G, T), MASKED, jnp.float32),
            jnp.zeros((B, K, G, T), jnp.float32))
    (acc, m, l), _ = jax.lax.scan(step, _carry(init, q, k, v, mask, pairs), jnp.asarray(pairs, jnp.int32))
    seen = l > 0
    o = acc / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), MASKED)
    return o, lse


def backward(q, k, v, do, lse, delta, mask: Mask, pairs, block: int, scale: float):
    """(dq [B, K, G, T, H], dk, dv [B, K, S, H]), float32, of the pairs' share of the attention
    whose log-sum-exp is `lse` and whose rowsum(do · o) is `delta` (both [B, K, G, T], of the whole
    attention: a ring step passes the merged ones)."""
    B, K, G, T, H = q.shape
    b = block

    def step(carry, pair):
        dq, dk, dv = carry
        qi, kj = pair[0], pair[1]
        s, ok, q_t = _scores(q, k, mask, qi, kj, b, scale)
        rows = lambda x: _slice(x, qi * b, b, 3).reshape(B, K, G * b, *x.shape[4:])  # noqa: E731
        p = jnp.where(ok, jnp.exp(s - rows(lse)[..., None]), 0.0)
        do_t = rows(do)
        k_t, v_t = _slice(k, kj * b, b, 2), _slice(v, kj * b, b, 2)
        dv_t = jnp.einsum("BKRS,BKRH->BKSH", p.astype(do.dtype), do_t, preferred_element_type=jnp.float32)
        dp = jnp.einsum("BKRH,BKSH->BKRS", do_t, v_t, preferred_element_type=jnp.float32)
        ds = (p * (dp - rows(delta)[..., None]) * jnp.float32(scale)).astype(q.dtype)
        dq_t = jnp.einsum("BKRS,BKSH->BKRH", ds, k_t, preferred_element_type=jnp.float32)
        dk_t = jnp.einsum("BKRS,BKRH->BKSH", ds, q_t, preferred_element_type=jnp.float32)
        dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, qi * b, b, 3) + dq_t.reshape(B, K, G, b, H), qi * b, 3)
        add = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, _slice(x, kj * b, b, 2) + y, kj * b, 2)  # noqa: E731
        return (dq, add(dk, dk_t), add(dv, dv_t)), None

    S = k.shape[2]
    init = (jnp.zeros((B, K, G, T, H), jnp.float32), jnp.zeros((B, K, S, H), jnp.float32),
            jnp.zeros((B, K, S, H), jnp.float32))
    (dq, dk, dv), _ = jax.lax.scan(step, _carry(init, q, k, v, do, lse, delta, mask, pairs),
                                   jnp.asarray(pairs, jnp.int32))
    return dq, dk, dv


def delta_of(o, do):
    """rowsum(do · o) [B, K, G, T] float32: softmax's backward term, one per query row."""
    return jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)


def merge(o1, lse1, o2, lse2):
    """Two partial attentions of the same queries over disjoint keys, merged by their log-sum-exp
    (o float32 [..., T, H], lse [..., T]): the attention over both key sets."""
    lse = jnp.logaddexp(lse1, lse2)
    w1, w2 = jnp.exp(lse1 - lse), jnp.exp(lse2 - lse)
    return o1 * w1[..., None] + o2 * w2[..., None], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, mask, pairs, block, scale):
    return forward(q, k, v, mask, pairs, block, scale)[0].astype(q.dtype)


def _attention_fwd(q, k, v, mask, pairs, block, scale):
    o, lse = forward(q, k, v, mask, pairs, block, scale)
    o = o.astype(q.dtype)
    return o, (q, k, v, o, lse, mask, pairs)


def _attention_bwd(block, scale, res, do):
    q, k, v, o, lse, mask, pairs = res
    dq, dk, dv = backward(q, k, v, do, lse, delta_of(o, do), mask, pairs, block, scale)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, mask: Mask | None = None,
              pairs: jax.Array | np.ndarray | None = None, block: int | None = None) -> jax.Array:
    """Attention [B, T, N, H] of queries [B, T, N, H] over keys and values [B, S, K, H] (N a
    multiple of K), scaled by 1/sqrt(H), tiled `block` positions square: causal over the positions
    `mask` gives (default: T == S, both 0 .. T − 1), within documents when it has segments, over
    the tile pairs `pairs` (default: `causal_pairs`, for a mask whose indices are in order). Saves
    q, k, v heads-major, the output and its float32 log-sum-exp for the backward. `block` defaults to
    BLOCK."""
    B, T, N, H = q_BxTxNxH.shape
    S, K = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
    b = tile(T, block)
    assert S % b == 0, (S, b)
    if mask is None:
        assert S == T, (S, T)
        mask = Mask(jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32))
    if pairs is None:
        pairs = causal_pairs(T // b, S // b)
    o = _attention(heads_major(q_BxTxNxH, K), kv_heads_major(k_BxSxKxH), kv_heads_major(v_BxSxKxH), mask,
                   jnp.asarray(pairs, jnp.int32), b, 1.0 / float(H) ** 0.5)
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, T, N, H)
