"""Data-parallel loss and gradients: a shard_map manual over `data`, gradient accumulation over
microbatches, and exactly one data-axis reduction of every gradient per step.

Where each gradient is reduced (DESIGN.md decision 5):

- ZeRO 0/1, one microbatch: every parameter is cast to data-varying where it enters the model
  (`sharding.use_params`); the transpose of that cast is the all-reduce of its gradient, so block
  gradients are reduced per layer inside the backward layer scan (overlapping the next layer's
  backward, as DDP's buckets do), and a tied embedding once, after its two uses are added.
- ZeRO 0/1/2 with microbatches, and ZeRO-2: the parameters are made data-varying before the
  microbatch loop, so nothing is reduced inside it; each data shard accumulates its unreduced
  gradient in float32 and reduces once after the loop: all-reduce (0/1) or reduce-scatter (2).
- ZeRO-3: parameters enter as data shards and are all-gathered where they are used (per layer,
  inside the layer scan, and again in the backward pass); the transpose of the all-gather is the
  reduce-scatter of the gradient, so gradients come out sharded. With microbatches this happens
  once per microbatch (`parallel.zero3_gather = microbatch`, the default), as in FSDP and
  DeepSpeed: accumulating unreduced full gradients instead would cost 4 bytes per parameter on
  every device, more than ZeRO-3's whole 16Ψ/d state for d > 4.
  With `zero3_gather = step` and microbatches, every shard is all-gathered once before the
  microbatch loop and the gathered parameters are kept for the step; gradients then accumulate
  unreduced and are reduce-scattered once after the loop, as under ZeRO-2: one gather and one
  reduce-scatter per step, for the memory of the full parameters and a full float32 accumulator.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.config import Config
from jaxpar.parallel.zero import Layout
from jaxpar.sharding import Rules, TensorParallel, activation_rules, compute_rules, vary, varying_axes

DATA, MODEL = "data", "model"


def _varying(x: jax.Array, names: tuple[str, ...] = ()) -> jax.Array:
    del names
    return vary(x, DATA)


def _gather_or_vary(layout: Layout) -> Callable:
    def use(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
        """ZeRO-3's use of a parameter: all-gather a data shard, or mark a replicated leaf varying."""
        if DATA in varying_axes(x):
            return jax.lax.all_gather(x, DATA, axis=layout.gather_dim(names, x.shape), tiled=True)
        return _varying(x)
    return use


def manual_region(cfg: Config, mesh: Mesh, *always: str) -> tuple[set[str], Rules, TensorParallel | None]:
    """The manual axes of a shard_map computing the loss (`always`, plus `data` and `model` where
    they have more than one shard), the compute rules left for the automatic axes, and the
    tensor-parallel context when `model` is manual."""
    t = mesh.shape[MODEL]
    manual = set(always) | ({DATA} if mesh.shape[DATA] > 1 else set()) | ({MODEL} if t > 1 else set())
    tp = TensorParallel(t, cfg.parallel.sequence_parallel, cfg.model.n_heads, cfg.model.kv_heads) if t > 1 else None
    return manual, compute_rules(cfg, mesh).without(tuple(manual)), tp


def make_loss_and_grads(cfg: Config, mesh: Mesh, layout: Layout, loss_fn: Callable) -> Callable:
    """`(params, batch) -> (loss, grads)` on the global batch, with params and grads laid out by
    `layout`. `loss_fn(params, batch_rows, n_tokens)` is the summed loss of some rows divided by
    `n_tokens`, so that losses and gradients of disjoint rows add up to those of the whole batch.

    The shard_map is manual over `data` (when it has more than one shard) and over `model` (when
    tensor parallelism is on: Megatron's explicit collectives, `jaxpar.sharding.enter_tp` etc.).
    A manual axis of size 1 is left out: beside an automatic axis it trips XLA's SPMD
    partitioner on jax 0.10.2 ("Cross-partition allreduce must be in (partial) manual
    partitioning mode"), and there is nothing to reduce over it anyway.
    """
    zero, m = layout.zero, cfg.parallel.microbatches
    n_tokens = cfg.train.global_batch * cfg.model.seq_len
    dp = mesh.shape[DATA] > 1
    manual, rules, tp = manual_region(cfg, mesh)
    reduce_at_use = zero in (0, 1) and m == 1
    gather_per_step = zero == 3 and m > 1 and cfg.parallel.zero3_gather == "step"
    param_fn = _gather_or_vary(layout) if zero == 3 and not gather_per_step else _varying if reduce_at_use else None
    param_fn = param_fn if dp else None
    if cfg.train.master_weights != "none" and param_fn is _varying:  # float32 per-layer all-reduce
        param_fn = lambda x, n: _varying(x.astype(jnp.float32))  # noqa: E731

    def grads_of(params, rows):
        with activation_rules(mesh, rules, param_fn=param_fn, tp=tp):
            return jax.value_and_grad(lambda p: loss_fn(p, rows, n_tokens))(params)

    def accumulate(params, batch):
        if m == 1:
            return grads_of(params, batch)
        micro = batch.reshape(m, batch.shape[0] // m, *batch.shape[1:])
        # The first microbatch starts the float32 accumulator, so it carries exactly the type
        # (shape, and which manual axes it varies over) of the gradients it sums.
        loss, g = grads_of(params, micro[0])
        to_f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731

        def body(carry, rows):
            acc_loss, acc = carry
            loss, g = grads_of(params, rows)
            return (acc_loss + loss, jax.tree.map(jnp.add, acc, to_f32(g))), None

        (loss, acc), _ = jax.lax.scan(body, (loss, to_f32(g)), micro[1:])
        return loss, jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)

    def local(params, batch):
        after = dp and param_fn is None  # reduce after the loop: differentiate data-varying copies
        if after and gather_per_step:  # ZeRO-3, once per step: the gathered copies are data-varying
            params = jax.tree.map(_gather, params, layout.zero_dims)
        if after:
            params = jax.tree.map(_varying, params)
        loss, g = accumulate(params, batch)
        if after:
            g = jax.tree.map(_reduce, g, layout.zero_dims) if zero >= 2 else jax.lax.psum(g, DATA)
        return (jax.lax.psum(loss, DATA) if dp else loss), g

    if not manual:
        return accumulate
    batch_spec = P(DATA) if dp else P()
    return jax.shard_map(local, mesh=mesh, in_specs=(layout.manual_specs("params", manual), batch_spec),
                         out_specs=(P(), layout.manual_specs("grads", manual)), axis_names=manual)


def _gather(x: jax.Array, dim: int | None) -> jax.Array:
    """A ZeRO-3 shard all-gathered over `data` along its sharded dim (a replicated leaf as is)."""
    return x if dim is None else jax.lax.all_gather(x, DATA, axis=dim, tiled=True)


def _reduce(g: jax.Array, dim: int | None) -> jax.Array:
    """One reduction of a gradient over `data`: reduce-scatter along its ZeRO dim, else all-reduce."""
    if dim is None:
        return jax.lax.psum(g, DATA)
    return jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)


def describe_reduction(cfg: Config) -> str:
    """Where the data-axis gradient reduction happens for this config, in words (for the CLI)."""
    zero, m, gather = cfg.parallel.zero, cfg.parallel.microbatches, cfg.parallel.zero3_gather
    if cfg.mesh.stage != 1:
        if zero == 3 and gather == "microbatch":
            return (f"pipeline, ZeRO-3: parameters all-gathered per layer in every forward and backward of "
                    f"{m} microbatches; gradients reduce-scattered there")
        prefix = "ZeRO-3: parameters all-gathered once before the tick loop; " if zero == 3 else ""
        return (f"pipeline: {prefix}accumulated in float32 over {m} microbatches, "
                f"{'reduce-scattered' if zero >= 2 else 'all-reduced'} over data once after the tick loop")
    if zero == 3 and m > 1 and gather == "step":
        return (f"ZeRO-3: parameters all-gathered once per step; gradients accumulated over {m} microbatches "
                "and reduce-scattered once after them")
    if zero == 3:
        return "ZeRO-3: parameters all-gathered per layer where used; gradients reduce-scattered there" + (
            f", once per microbatch ({m})" if m > 1 else "")
    if zero in (0, 1) and m == 1:
        return "all-reduce per layer inside the backward layer scan"
    return ("reduce-scatter" if zero == 2 else "all-reduce") + f" once per step, after {m} microbatch(es)"

