"""The optimizer: AdamW (or Muon with AdamW for the rest, `train.optimizer`: `jaxpar.train.muon`)
with linear warmup and cosine decay, global-norm clipping, decay mask, and optionally a float32
master copy of 16-bit parameters (`train.master_weights`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpar.config import TrainConfig
from jaxpar.parallel.reduction import upcast_at_use  # noqa: F401 (re-exported: train.step reads it here)


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


class MasterState(NamedTuple):
    """Optimizer state with master weights: the float32 copy of the parameters, and the state of
    the optimizer that updates it (Adam's moments, shaped like the parameters, in float32)."""

    master: Any
    inner: Any


def with_master_weights(inner: optax.GradientTransformationExtraArgs, dtype: Any = jnp.float32
                        ) -> optax.GradientTransformationExtraArgs:
    """`inner` run on a `dtype` master copy of the parameters, held in the optimizer state.

    `init(params)` upcasts the (16-bit) parameters into the master; `update(grads, state)` runs
    `inner` on the master (the gradients should be `dtype` too) and returns `inner`'s updates
    together with the state holding the updated master. The parameters the model uses are then the
    master cast to their storage dtype (`stored_params`), not `params + updates`: a 16-bit sum
    would drop every update smaller than half a unit in the last place of the parameter."""

    def init(params):
        master = jax.tree.map(lambda p: p.astype(dtype), params)
        return MasterState(master, inner.init(master))

    def update(grads, state, params=None, **extra_args):
        del params  # the master is the parameter inner updates
        updates, inner_state = inner.update(grads, state.inner, state.master, **extra_args)
        return updates, MasterState(optax.apply_updates(state.master, updates), inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def stored_params(opt_state: MasterState, like: Any) -> Any:
    """The parameters to store: the master cast to the dtypes of `like` (the stored parameters)."""
    return jax.tree.map(lambda m, p: m.astype(p.dtype), opt_state.master, like)


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


def make_optimizer(tr: TrainConfig, names: Any, mesh: Any = None, specs: Any = None) -> optax.GradientTransformation:
    """AdamW (or Muon, `tr.optimizer`) over a parameter tree whose logical dim names are `names`
    (on a float32 master copy when `tr.master_weights` is set), after global-norm clipping. Muon
    given the step's `mesh` (and `specs`, its optimizer-state layout: `Layout.moments`)
    orthogonalizes each matrix on one owning rank (`jaxpar.train.muon`)."""
    if tr.optimizer == "muon":
        from jaxpar.train.muon import muon

        adamw = muon(lr_schedule(tr), names, momentum=tr.muon_momentum, b1=tr.b1, b2=tr.b2,
                     weight_decay=tr.weight_decay, decay_mask=decay_mask(names), ns_dtype=jnp.dtype(tr.muon_ns_dtype),
                     mesh=mesh, specs=specs)
    else:
        adamw = optax.adamw(lr_schedule(tr), b1=tr.b1, b2=tr.b2, weight_decay=tr.weight_decay,
                            mask=decay_mask(names))
    opt = (optax.chain(clip_by_global_norm(tr.grad_clip), adamw) if tr.grad_clip > 0
           else optax.with_extra_args_support(adamw))
    if tr.master_weights != "none":
        return with_master_weights(opt, jnp.dtype(tr.master_weights))
    return opt
