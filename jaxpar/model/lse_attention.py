"""Causal attention whose backward recomputes the probabilities (`model.attention: xla_lse`).

XLA's reference attention (`jax.nn.dot_product_attention(implementation="xla")`) leaves four float32
[batch, heads, seq, seq] values (the masked scores twice, the exponentials, the probabilities)
among those a training step keeps for the backward pass (on the pipeline benchmark's model, seq
128, this kernel takes a llama layer's saved values from 8.65 to 6.64 MiB). Flash
attention's backward needs less (Dao et al., 2022, algorithm 4): the output o and, for each query
row, the log-sum-exp of its scores; the probabilities come back as exp(scores - lse) from q and k,
which are kept anyway. This is that backward in plain JAX, untiled: the forward computes what XLA's
attention computes (same einsums, float32 softmax) and keeps [batch, heads, seq] floats instead of
[batch, heads, seq, seq]; the backward pays one more q·kᵀ matmul (2·seq·d_attn FLOPs per token and
layer). It is what `torch.nn.functional.scaled_dot_product_attention` keeps on a CPU. DESIGN.md decision 14.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _scores(q_BxTxKxGxH, k_BxSxKxH, scale):
    """Scaled causal scores [B, K, G, T, S] in float32, masked where s > t (XLA's large negative)."""
    T, S = q_BxTxKxGxH.shape[1], k_BxSxKxH.shape[1]
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(scale)
    causal = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]
    return jnp.where(causal, logits, jnp.float32(-0.7 * jnp.finfo(jnp.float32).max))


def _forward(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, scale):
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxSxKxH.shape[2]
    q = q_BxTxNxH.reshape(B, T, K, N // K, H)
    s = _scores(q, k_BxSxKxH, scale)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = (e / total).astype(v_BxSxKxH.dtype)
    o = jnp.einsum("BKGTS,BSKH->BTKGH", p, v_BxSxKxH).reshape(B, T, N, H)
    lse_BxKxGxT = (m + jnp.log(total))[..., 0]
    return o, lse_BxKxGxT


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, scale):
    return _forward(q, k, v, scale)[0]


def _attention_fwd(q, k, v, scale):
    o, lse = _forward(q, k, v, scale)
    return o, (q, k, v, o, lse)


def _attention_bwd(scale, res, do_BxTxNxH):
    q_BxTxNxH, k, v, o, lse = res
    B, T, N, H = q_BxTxNxH.shape
    K = k.shape[2]
    q = q_BxTxNxH.reshape(B, T, K, N // K, H)
    do = do_BxTxNxH.reshape(B, T, K, N // K, H)
    p = jnp.exp(_scores(q, k, scale) - lse[..., None])  # float32 [B, K, G, T, S]
    dv = jnp.einsum("BKGTS,BTKGH->BSKH", p.astype(v.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("BTKGH,BSKH->BKGTS", do, v, preferred_element_type=jnp.float32)
    # Softmax's backward: ds = p (dp - rowsum(p dp)), and rowsum(p dp) = rowsum(do o) (o = p v).
    delta = jnp.einsum("BTKGH,BTKGH->BKGT", do.astype(jnp.float32), o.reshape(q.shape).astype(jnp.float32))
    ds = (p * (dp - delta[..., None]) * jnp.float32(scale)).astype(q.dtype)
    dq = jnp.einsum("BKGTS,BSKH->BTKGH", ds, k, preferred_element_type=jnp.float32).reshape(B, T, N, H)
    dk = jnp.einsum("BKGTS,BTKGH->BSKH", ds, q, preferred_element_type=jnp.float32)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


def lse_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array) -> jax.Array:
    """Causal attention [B, T, N, H] of queries [B, T, N, H] over keys and values [B, S, K, H] (N a
    multiple of K: grouped-query heads), scaled by 1/sqrt(H); saves q, k, v, the output and the
    float32 log-sum-exp [B, K, N/K, T] for its backward."""
    return _attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, 1.0 / float(q_BxTxNxH.shape[-1]) ** 0.5)
