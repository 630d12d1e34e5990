"""What gradient accumulation (`jaxpar.parallel.gradients`) and the pipeline
(`jaxpar.parallel.pipeline`) share about microbatches: the step's batch cut into them, the loss's
one divisor, and the float32 accumulator their gradients add into. The parameters' hand-out at use
(ZeRO-1/2's seeds, ZeRO-3's marked shards) is shared too: `gradients.mark_for_use` and
`gradients.hand_out`.

Accumulation is not the pipeline executor at p = 1 (DESIGN.md §4, "What the executors share"): the
executor's tick pays for its hops, conds and stash slots, and it reduces after its loop, where one
data-parallel microbatch reduces per layer inside the backward pass (DDP's overlap). Naive DP uses
the same pieces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.config import Config
from jaxpar.sharding import zeros_like_varying


def split(batch: jax.Array, m: int) -> jax.Array:
    """The step's rows [B, ...] as m microbatches [m, B/m, ...] (microbatch i: rows i·B/m on)."""
    return batch.reshape(m, batch.shape[0] // m, *batch.shape[1:])


def loss_tokens(cfg: Config) -> int:
    """The loss's one divisor: the target tokens of the global batch. Every microbatch (and every
    stage's head) divides its summed token loss by it, so that disjoint rows' losses and gradients
    add up to the whole batch's mean."""
    return cfg.train.global_batch * cfg.model.seq_len


def f32_zeros(tree):
    """A float32 accumulator for gradients shaped (and manual-axis typed) like `tree`."""
    return jax.tree.map(lambda x: zeros_like_varying(x).astype(jnp.float32), tree)


def add_f32(acc, *grads):
    """`acc` plus each tree of `grads`, each leaf cast to float32 before it is added."""
    for g in grads:
        acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)
    return acc
