"""What gradient accumulation (`jaxpar.parallel.gradients`) and the pipeline
(`jaxpar.parallel.pipeline`) share about microbatches: the step's batch cut into them, the loss's
one divisor, and the float32 accumulator their gradients add into; and the one accumulation loop
(`accumulate`) of data parallelism, ZeRO and naive DP. The parameters' hand-out at use
(ZeRO-1/2's seeds, ZeRO-3's marked shards) is shared too: `gradients.mark_for_use` and
`gradients.hand_out`.

Accumulation is not the pipeline executor at p = 1 (DESIGN.md §4, "What the executors share"): the
executor's tick pays for its hops, conds and stash slots, and it reduces after its loop, where one
data-parallel microbatch reduces per layer inside the backward pass (DDP's overlap). Naive DP uses
the same pieces.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.config import Config
from jaxpar.model import fp8
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
    """`acc` plus each tree of `grads`, each leaf cast to float32 before it is added; an FP8 amax
    history's leaf (`fp8.is_history`: its "gradient" is the amaxes seen) takes the maximum."""
    def one(path, a, x):
        return jnp.maximum(a, x.astype(jnp.float32)) if fp8.is_history(path) else a + x.astype(jnp.float32)
    for g in grads:
        acc = jax.tree_util.tree_map_with_path(one, acc, g)
    return acc


def accumulate(value_and_grad: Callable, like, batch: jax.Array, m: int, maxima: bool = False):
    """(summed loss, gradients) of `batch` in `m` microbatches: `value_and_grad(rows)` of each inside
    one scan (one microbatch's activations live at a time), its gradients added into a float32
    accumulator typed like `like` (a gradient has its primal's shape and manual-axis variance),
    cast back to `like`'s dtypes at the end. With m = 1, `value_and_grad(batch)` itself. With
    `maxima` (train.qk_clip), `value_and_grad` returns ((loss, maxima), g) and so does this, the
    maxima (each layer's per-head largest attention logit) the largest over microbatches."""
    if m == 1:
        return value_and_grad(batch)

    def body(acc, rows):
        loss, g = value_and_grad(rows)
        return add_f32(acc, g), loss

    acc, losses = jax.lax.scan(body, f32_zeros(like), split(batch, m))
    g = jax.tree.map(lambda a, x: a.astype(x.dtype), acc, like)
    if maxima:
        return (jnp.sum(losses[0]), jnp.max(losses[1], axis=0)), g
    return jnp.sum(losses), g


def guard_non_finite(on_nan: str, loss: jax.Array, grad_norm: jax.Array, step: jax.Array,
                     skipped: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`train.on_nan`, the one rule of every step (DDP/ZeRO, pipeline, naive): a non-finite loss or
    gradient norm drops the update and is counted; with `stop`, the first such step also freezes
    the state (step count included), so that what the loop saves when it sees the count, a step or
    two later, is exactly the state before the bad step. Returns (apply the update?, the next step
    count, the next skipped count)."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if on_nan == "stop":
        ok = finite & (skipped == 0)
        next_step = jnp.where(ok, step + 1, step)
    else:
        ok, next_step = finite, step + 1
    return ok, next_step, skipped + (~finite).astype(jnp.int32)
