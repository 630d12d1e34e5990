"""The optimizer: AdamW with linear warmup and cosine decay, global-norm clipping, decay mask."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar.config import TrainConfig


def lr_schedule(tr: TrainConfig) -> optax.Schedule:
    """0 -> lr linearly over warmup_steps, then cosine down to lr * min_lr_ratio at the last step."""
    warmup = min(tr.warmup_steps, tr.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tr.lr, warmup_steps=warmup,
        decay_steps=max(tr.steps, warmup + 1), end_value=tr.lr * tr.min_lr_ratio)


def decay_mask(names: Any) -> Any:
    """Weight decay on matrices and embeddings (two or more dims besides `layers`), not on norms or biases."""
    return jax.tree.map(lambda n: sum(d != "layers" for d in n) >= 2, names,
                        is_leaf=lambda x: isinstance(x, tuple))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm` (same trigger, the same factor up to rounding) as one scalar
    factor on the gradient. optax selects per element between `g` and `g / norm * max_norm`, which
    XLA materialises as a second gradient that every Adam fusion reads besides `g`. The update
    takes the norm as the extra arg `grad_norm` when the caller has it (the train step does, for
    its NaN check), so that it is not computed twice."""
    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def make_optimizer(tr: TrainConfig, names: Any) -> optax.GradientTransformation:
    """AdamW over a parameter tree whose logical dim names are `names`."""
    adamw = optax.adamw(lr_schedule(tr), b1=tr.b1, b2=tr.b2, weight_decay=tr.weight_decay,
                        mask=decay_mask(names))
    if tr.grad_clip > 0:
        return optax.chain(clip_by_global_norm(tr.grad_clip), adamw)
    return optax.with_extra_args_support(adamw)
