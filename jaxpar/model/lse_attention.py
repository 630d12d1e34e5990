"""Causal attention whose backward recomputes the probabilities (`model.attention: xla_lse`).

XLA's reference attention (`jax.nn.dot_product_attention(implementation="xla")`) leaves four float32
[batch, heads, seq, seq] values (the masked scores twice, the exponentials, the probabilities)
among those a training step keeps for the backward pass (on the pipeline benchmark's model, seq
128, this kernel takes a llama layer's saved values from 8.65 to 6.64 MiB). Flash
attention's backward needs less (Dao et al., 2022, algorithm 4): the output o and, for each query
row, the log-sum-exp of its scores; the probabilities come back as exp(scores - lse) from q and k,
which are kept anyway. This is that backward in plain JAX, in causal query blocks but not tiled
over the keys (`query_blocks`): the forward computes what XLA's attention computes (same einsums,
float32 softmax, each block's rows over the keys it can see) and keeps [batch, heads, seq] floats
instead of [batch, heads, seq, seq]; the backward pays one more q·kᵀ matmul (2·seq·d_attn FLOPs per
token and layer). It is what `torch.nn.functional.scaled_dot_product_attention` keeps on a CPU. DESIGN.md decision 14.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# Causal query blocks: with S == T, the rows [t0, t1) of the scores read keys [0, t1) only, so a
# blocked loop skips the masked upper triangle's whole blocks ((n + 1) / 2n of the [T, T] work for
# n blocks) and its [B, K, G, t1 - t0, t1] arrays are smaller: measured on the pipeline benchmark's
# attention (B 16, T 128, 8 heads of 32, float32, one XLA:CPU thread), forward and backward took
# 47 ms unblocked, 26 ms in 2 blocks, 25 ms in 4 and 47 ms in 8 (blocks of 16 rows); at T 1024,
# 337 ms unblocked and 114 ms in 8 (`benchmarks/attention_cpu.py`, DESIGN.md decision 14).
QUERY_BLOCK = 64  # the fewest query rows a block holds
MAX_BLOCKS = 8    # the most blocks (the loop is unrolled: ops, and compile time, grow with it)


def query_blocks(T: int, S: int) -> list[tuple[int, int]]:
    """The query blocks [(t0, t1), ...] of a causal [T, S] attention: one block unless S == T, else
    the most blocks, at most MAX_BLOCKS, that divide T into blocks of at least QUERY_BLOCK rows."""
    n = max(1, min(T // QUERY_BLOCK, MAX_BLOCKS)) if S == T else 1
    while T % n:
        n -= 1
    return [(i * T // n, (i + 1) * T // n) for i in range(n)]


def _scores(q_BxTxKxGxH, k_BxSxKxH, scale, t0=0):
    """Scaled causal scores [B, K, G, T, S] in float32 of queries at rows t0, t0 + 1, ..., masked
    where s > t (XLA's large negative)."""
    T, S = q_BxTxKxGxH.shape[1], k_BxSxKxH.shape[1]
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(scale)
    causal = jnp.arange(S)[None, :] <= t0 + jnp.arange(T)[:, None]
    return jnp.where(causal, logits, jnp.float32(-0.7 * jnp.finfo(jnp.float32).max))


def _forward(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, scale):
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxSxKxH.shape[2]
    q = q_BxTxNxH.reshape(B, T, K, N // K, H)
    outs, lses = [], []
    for t0, t1 in query_blocks(T, k_BxSxKxH.shape[1]):
        S = t1 if t1 < T else k_BxSxKxH.shape[1]  # (one block: every key)
        s = _scores(q[:, t0:t1], k_BxSxKxH[:, :S], scale, t0)
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        p = (e / total).astype(v_BxSxKxH.dtype)
        outs.append(jnp.einsum("BKGTS,BSKH->BTKGH", p, v_BxSxKxH[:, :S]))
        lses.append((m + jnp.log(total))[..., 0])
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    lse_BxKxGxT = lses[0] if len(lses) == 1 else jnp.concatenate(lses, axis=-1)
    return o.reshape(B, T, N, H), lse_BxKxGxT


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, scale):
    return _forward(q, k, v, scale)[0]


def _attention_fwd(q, k, v, scale):
    o, lse = _forward(q, k, v, scale)
    return o, (q, k, v, o, lse)


def _pad_keys(x_BxSxKxH, S_all):
    """A block's key-side gradient [B, S, K, H] padded with zeros to all S_all keys."""
    S = x_BxSxKxH.shape[1]
    return x_BxSxKxH if S == S_all else jnp.pad(x_BxSxKxH, ((0, 0), (0, S_all - S), (0, 0), (0, 0)))


def _attention_bwd(scale, res, do_BxTxNxH):
    q_BxTxNxH, k, v, o, lse = res
    B, T, N, H = q_BxTxNxH.shape
    K, S_all = k.shape[2], k.shape[1]
    q = q_BxTxNxH.reshape(B, T, K, N // K, H)
    do = do_BxTxNxH.reshape(B, T, K, N // K, H)
    # Softmax's backward: ds = p (dp - rowsum(p dp)), and rowsum(p dp) = rowsum(do o) (o = p v).
    delta = jnp.einsum("BTKGH,BTKGH->BKGT", do.astype(jnp.float32), o.reshape(q.shape).astype(jnp.float32))
    dqs, dk, dv = [], None, None
    for t0, t1 in query_blocks(T, S_all):
        S = t1 if t1 < T else S_all
        q_b, do_b, k_b, v_b = q[:, t0:t1], do[:, t0:t1], k[:, :S], v[:, :S]
        p = jnp.exp(_scores(q_b, k_b, scale, t0) - lse[..., t0:t1, None])  # float32 [B, K, G, t, S]
        dv_b = jnp.einsum("BKGTS,BTKGH->BSKH", p.astype(v.dtype), do_b, preferred_element_type=jnp.float32)
        dp = jnp.einsum("BTKGH,BSKH->BKGTS", do_b, v_b, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., t0:t1, None]) * jnp.float32(scale)).astype(q.dtype)
        dqs.append(jnp.einsum("BKGTS,BSKH->BTKGH", ds, k_b, preferred_element_type=jnp.float32))
        dk_b = jnp.einsum("BKGTS,BTKGH->BSKH", ds, q_b, preferred_element_type=jnp.float32)
        dk = _pad_keys(dk_b, S_all) if dk is None else dk + _pad_keys(dk_b, S_all)
        dv = _pad_keys(dv_b, S_all) if dv is None else dv + _pad_keys(dv_b, S_all)
    dq = (dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=1)).reshape(B, T, N, H)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


def lse_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array) -> jax.Array:
    """Causal attention [B, T, N, H] of queries [B, T, N, H] over keys and values [B, S, K, H] (N a
    multiple of K: grouped-query heads), scaled by 1/sqrt(H); saves q, k, v, the output and the
    float32 log-sum-exp [B, K, N/K, T] for its backward."""
    return _attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, _scale(q_BxTxNxH))


def _scale(q_BxTxNxH: jax.Array) -> float:
    return 1.0 / float(q_BxTxNxH.shape[-1]) ** 0.5


def working_set_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array) -> jax.Array:
    """`lse_attention` for the planner's trace (`jaxpar.model.layers.backward_working_set`): its
    saved values are the kernel's residuals and what its backward materializes at once, one query
    block's float32 p, dp and ds (the largest block's: the matmuls' operands, freed before the next
    block's); the same forward and backward."""
    return _working_set(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, _scale(q_BxTxNxH))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _working_set(q, k, v, scale):
    return _forward(q, k, v, scale)[0]


def _working_set_fwd(q, k, v, scale):
    o, lse = _forward(q, k, v, scale)
    B, T, N, _ = q.shape
    K, S = k.shape[2], k.shape[1]
    t0, t1 = query_blocks(T, S)[-1]
    block = jnp.zeros((3, B, K, N // K, t1 - t0, S), jnp.float32) + lse[..., :1, None]  # (a value, not a constant)
    return o, (q, k, v, o, lse, block)


def _working_set_bwd(scale, res, do):
    return _attention_bwd(scale, res[:5], do)


_working_set.defvjp(_working_set_fwd, _working_set_bwd)
