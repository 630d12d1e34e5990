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
token and layer). It is what `torch.nn.functional.scaled_dot_product_attention` keeps on a CPU.
Every matmul runs heads-major ([B, K, rows, H], a kv head's grouped query heads as rows of one
matmul), the layout XLA:CPU's dot reads without copying its operands. DESIGN.md decision 14.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# Causal query blocks: with S == T, the rows [t0, t1) of the scores read keys [0, t1) only, so a
# blocked loop skips the masked upper triangle's whole blocks ((n + 1) / 2n of the [T, T] work for
# n blocks) and its [B, K, G, t1 - t0, t1] arrays are smaller: measured on the pipeline benchmark's
# attention (B 16, T 128, 8 heads of 32, float32, one XLA:CPU thread, the Xeon, before the
# heads-major layout), forward and backward took 47 ms unblocked, 26 ms in 2 blocks, 25 ms in 4 and
# 47 ms in 8 (blocks of 16 rows); at T 1024, 337 ms unblocked and 114 ms in 8. Heads-major, on the
# EPYC: 2 blocks 15.5 ms, 4 blocks 20.8 (`benchmarks/attention_cpu.py`, DESIGN.md decision 14).
QUERY_BLOCK = 64  # the fewest query rows a block holds
MAX_BLOCKS = 8    # the most blocks (the loop is unrolled: ops, and compile time, grow with it)


def query_blocks(T: int, S: int) -> list[tuple[int, int]]:
    """The query blocks [(t0, t1), ...] of a causal [T, S] attention: one block unless S == T, else
    the most blocks, at most MAX_BLOCKS, that divide T into blocks of at least QUERY_BLOCK rows."""
    n = max(1, min(T // QUERY_BLOCK, MAX_BLOCKS)) if S == T else 1
    while T % n:
        n -= 1
    return [(i * T // n, (i + 1) * T // n) for i in range(n)]


_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # XLA's large negative for a masked score


def _heads(x_BxTxKxGxH):
    """[B, T, K, G, H] -> heads-major [B, K, G, T, H]: every attention matmul is then a plain batched
    matmul over (B, K) with rows (G, T), the layout XLA:CPU's dot runs without copying its operands
    (with the row sums as a matrix-vector product, the pipeline benchmark's attention took 23.3 -> 15.2
    ms forward and backward on one thread, DESIGN.md decision 14)."""
    return jnp.transpose(x_BxTxKxGxH, (0, 2, 3, 1, 4))


def _rows(x_BxKxGxTxH, t0, t1):
    """Query rows [t0, t1) of every head of a group as one row axis [B, K, G·(t1 - t0), H]: the
    grouped-query heads of a kv head share its keys, so they are rows of one matmul."""
    B, K, G, _, H = x_BxKxGxTxH.shape
    return x_BxKxGxTxH[:, :, :, t0:t1].reshape(B, K, G * (t1 - t0), H)


def _causal(s, t0, tl, rows_last):
    """Scores masked where key s > query t, queries at rows t0 + r % tl (r = g·tl + t): [B, K, R, S]
    or, with `rows_last`, [B, K, S, R]."""
    R, S = (s.shape[3], s.shape[2]) if rows_last else (s.shape[2], s.shape[3])
    t = t0 + jnp.arange(R) % tl
    ok = jnp.arange(S)[:, None] <= t[None, :] if rows_last else jnp.arange(S)[None, :] <= t[:, None]
    return jnp.where(ok, s, jnp.float32(_MASKED))


def _blocks(T, S_all):
    """(t0, t1, S): each query block's rows and the keys [0, S) it reads."""
    return [(t0, t1, t1 if t1 < T else S_all) for t0, t1 in query_blocks(T, S_all)]


def _forward(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, scale):
    """(o [B, T, N, H], lse [B, K, G, T] float32, q, k, v heads-major)."""
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxSxKxH.shape[2]
    G = N // K
    q = _heads(q_BxTxNxH.reshape(B, T, K, G, H))
    k, v = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k_BxSxKxH, v_BxSxKxH))  # [B, K, S, H]
    outs, lses = [], []
    for t0, t1, S in _blocks(T, k.shape[2]):
        s = jnp.einsum("BKRH,BKSH->BKRS", _rows(q, t0, t1), k[:, :, :S], preferred_element_type=jnp.float32)
        s = _causal(s * jnp.float32(scale), t0, t1 - t0, rows_last=False)
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        p = (e / total).astype(v.dtype)
        outs.append(jnp.einsum("BKRS,BKSH->BKRH", p, v[:, :, :S]).reshape(B, K, G, t1 - t0, H))
        lses.append((m + jnp.log(total))[..., 0].reshape(B, K, G, t1 - t0))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    lse = lses[0] if len(lses) == 1 else jnp.concatenate(lses, axis=3)
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, T, N, H), lse, q, k, v


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, scale):
    return _forward(q, k, v, scale)[0]


def _attention_fwd(q, k, v, scale):
    o, lse, qh, kh, vh = _forward(q, k, v, scale)
    return o, (qh, kh, vh, o, lse)  # (o as returned: the output projection keeps it too)


def _attention_bwd(scale, res, do_BxTxNxH):
    q, k, v, o_BxTxNxH, lse = res  # q [B, K, G, T, H]; k, v [B, K, S, H]
    B, K, G, T, H = q.shape
    S_all = k.shape[2]
    # Softmax's backward: ds = p (dp - rowsum(p dp)), and rowsum(p dp) = rowsum(do o) (o = p v), a
    # matrix-vector product: as a multiply and a sum over H, XLA:CPU's reduction took 2 of the 17 ms.
    prod = do_BxTxNxH.astype(jnp.float32) * o_BxTxNxH.astype(jnp.float32)
    delta = _heads((prod @ jnp.ones((H,), jnp.float32)).reshape(B, T, K, G, 1))[..., 0]  # [B, K, G, T]
    do = _heads(do_BxTxNxH.reshape(B, T, K, G, H))
    dqs, dk, dv = [], None, None
    for t0, t1, S in _blocks(T, S_all):
        # Key-major [B, K, S, R]: dk and dv are plain matmuls of it, dq the one transposed product.
        tl = t1 - t0
        q_b, do_b, k_b, v_b = _rows(q, t0, t1), _rows(do, t0, t1), k[:, :, :S], v[:, :, :S]
        s = jnp.einsum("BKSH,BKRH->BKSR", k_b, q_b, preferred_element_type=jnp.float32) * jnp.float32(scale)
        p = jnp.exp(_causal(s, t0, tl, rows_last=True) - lse[..., t0:t1].reshape(B, K, 1, G * tl))
        dv_b = jnp.einsum("BKSR,BKRH->BKSH", p.astype(v.dtype), do_b, preferred_element_type=jnp.float32)
        dp = jnp.einsum("BKSH,BKRH->BKSR", v_b, do_b, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., t0:t1].reshape(B, K, 1, G * tl)) * jnp.float32(scale)).astype(q.dtype)
        dk_b = jnp.einsum("BKSR,BKRH->BKSH", ds, q_b, preferred_element_type=jnp.float32)
        dqs.append(jnp.einsum("BKSR,BKSH->BKRH", ds, k_b, preferred_element_type=jnp.float32).reshape(B, K, G, tl, H))
        dk = _pad_keys(dk_b, S_all) if dk is None else dk + _pad_keys(dk_b, S_all)
        dv = _pad_keys(dv_b, S_all) if dv is None else dv + _pad_keys(dv_b, S_all)
    dq = dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=3)
    dq = jnp.transpose(dq, (0, 3, 1, 2, 4)).reshape(B, T, K * G, H)
    dk, dv = (jnp.transpose(x, (0, 2, 1, 3)) for x in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _pad_keys(x_BxKxSxH, S_all):
    """A block's key-side gradient [B, K, S, H] padded with zeros to all S_all keys."""
    S = x_BxKxSxH.shape[2]
    return x_BxKxSxH if S == S_all else jnp.pad(x_BxKxSxH, ((0, 0), (0, 0), (0, S_all - S), (0, 0)))


_attention.defvjp(_attention_fwd, _attention_bwd)


def lse_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array) -> jax.Array:
    """Causal attention [B, T, N, H] of queries [B, T, N, H] over keys and values [B, S, K, H] (N a
    multiple of K: grouped-query heads), scaled by 1/sqrt(H); saves q, k, v (heads-major, as its
    matmuls read them: [B, K, N/K, T, H] and [B, K, S, H]), the output and the float32 log-sum-exp
    [B, K, N/K, T] for its backward."""
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
    o, lse, qh, kh, vh = _forward(q, k, v, scale)
    B, T, N, _ = q.shape
    K, S = k.shape[2], k.shape[1]
    t0, t1 = query_blocks(T, S)[-1]
    block = jnp.zeros((3, B, K, N // K, t1 - t0, S), jnp.float32) + lse[..., :1, None]  # (a value, not a constant)
    return o, (qh, kh, vh, o, lse, block)


def _working_set_bwd(scale, res, do):
    return _attention_bwd(scale, res[:5], do)


_working_set.defvjp(_working_set_fwd, _working_set_bwd)
