"""The loss rule: next-token cross-entropy in float32, written so that a vocabulary split over
`model` never gathers the logits (`jaxpar.train.step` trains with it; the planner traces it for the
activations the loss saves, `jaxpar.plan.activations`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.sharding import vocab_offset, vocab_reduce


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array, vocab_size: int | None = None) -> jax.Array:
    """Mean next-token cross-entropy in float32."""
    return cross_entropy_sum(logits_BxTxV, targets_BxT, vocab_size) / targets_BxT.size


def cross_entropy_sum(logits_BxTxV: jax.Array, targets_BxT: jax.Array, vocab_size: int | None = None) -> jax.Array:
    """Summed next-token cross-entropy in float32; ids >= vocab_size (padding) are never predicted.

    Written as reductions over `vocab` only (max, sum of exp, and a masked sum for the target's
    logit, no gather), so with the vocab split over `model` each rank reduces its slice and only
    [B, T] partial results cross ranks: the full [B, T, V] logits never exist on one device.
    """
    logits_BxTxV = logits_BxTxV.astype(jnp.float32)
    # Global ids of this rank's vocabulary slice (all of it without tensor parallelism).
    ids_BxTxV = jax.lax.broadcasted_iota(jnp.int32, logits_BxTxV.shape, 2) + vocab_offset(logits_BxTxV.shape[-1])
    if vocab_size is not None:
        logits_BxTxV = jnp.where(ids_BxTxV < vocab_size, logits_BxTxV, -jnp.inf)
    # The max only keeps exp() in range; its gradient cancels, so it is taken out of the graph.
    max_BxT = vocab_reduce(jax.lax.stop_gradient(jnp.max(logits_BxTxV, axis=-1)), "max")
    sumexp_BxT = vocab_reduce(jnp.sum(jnp.exp(logits_BxTxV - max_BxT[..., None]), axis=-1), "sum")
    target_BxT = vocab_reduce(jnp.sum(jnp.where(ids_BxTxV == targets_BxT[..., None], logits_BxTxV, 0.0), axis=-1),
                              "sum")
    # A negative target (~id: chat data's context, `train.data.with_mask`) is not learned.
    return jnp.sum(jnp.where(targets_BxT >= 0, max_BxT + jnp.log(sumexp_BxT) - target_BxT, 0.0))
