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

import dataclasses
import functools
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.config import Config
from jaxpar.model import fp8
from jaxpar.model.transformer import param_names
from jaxpar.parallel import microbatches
from jaxpar.parallel.zero import Layout
from jaxpar.sharding import (Handout, Shard, recast, Rules, TensorParallel, activation_rules, compute_rules, vary,
                             varying_axes)

DATA, MODEL = "data", "model"


def _varying(x: jax.Array) -> jax.Array:
    return vary(x, DATA)


def _cast(x: jax.Array, dtype) -> jax.Array:
    return x if dtype is None else recast(x, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scatter_at_use(full: jax.Array, seed: jax.Array, dim: int) -> jax.Array:
    """ZeRO-1/2's use of a replicated parameter: `full`, data-varying; its gradient comes out as
    the gradient of `seed` (a zero data shard), reduce-scattered over `data` right here in the
    backward pass (per layer, inside the layer scan), so the full gradient never exists."""
    return _varying(full)


def _scatter_fwd(full, seed, dim):
    return _varying(full), jnp.zeros((0,), seed.dtype)  # the residual only carries the seed's dtype


def _scatter_bwd(dim, res, ct):
    # In the seed's dtype: float32 under train.master_weights, whatever the parameter's.
    return None, jax.lax.psum_scatter(ct.astype(res.dtype), DATA, scatter_dimension=dim, tiled=True)


_scatter_at_use.defvjp(_scatter_fwd, _scatter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_cast(shard: jax.Array, dim: int, dtype, stored) -> jax.Array:
    """ZeRO-3's use of a data shard in a narrower compute dtype: cast, then all-gather (half the
    bytes in bf16, as FSDP's mixed precision); the gradient is reduce-scattered in the stored
    dtype (float32), not in the compute dtype."""
    return jax.lax.all_gather(shard.astype(dtype), DATA, axis=dim, tiled=True)


def _gather_cast_fwd(shard, dim, dtype, stored):
    return _gather_cast(shard, dim, dtype, stored), None


def _gather_cast_bwd(dim, dtype, stored, _, ct):
    return (jax.lax.psum_scatter(ct.astype(stored), DATA, scatter_dimension=dim, tiled=True),)


_gather_cast.defvjp(_gather_cast_fwd, _gather_cast_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_fp8(shard: jax.Array, dim: int, dtype, stored) -> jax.Array:
    """ZeRO-3's use of an FP8 matmul's weight shard (`model.fp8`): quantized with the whole
    weight's scale and all-gathered as float8 bytes (`jaxpar.model.fp8.gather`: half of bf16's
    bytes), dequantized in `dtype`; the gradient is reduce-scattered in the stored dtype."""
    return fp8.gather(shard, lambda q: jax.lax.all_gather(q, DATA, axis=dim, tiled=True), dtype)


def _gather_fp8_fwd(shard, dim, dtype, stored):
    return _gather_fp8(shard, dim, dtype, stored), None


_gather_fp8.defvjp(_gather_fp8_fwd, _gather_cast_bwd)


def gather_at_use(shard: jax.Array, dim: int | None, cast, in_fp8: bool = False) -> jax.Array:
    """ZeRO-3's use of a parameter: a data shard (`dim` not None) all-gathered along `dim`, in the
    compute dtype `cast` when given (`_gather_cast`), or as float8 (`in_fp8`: `_gather_fp8`); a
    replicated leaf only cast."""
    if dim is None:
        return _cast(shard, cast)
    if in_fp8:
        return _gather_fp8(shard, dim, shard.dtype if cast is None else cast, shard.dtype)
    if cast is None:
        return jax.lax.all_gather(shard, DATA, axis=dim, tiled=True)
    return _gather_cast(shard, dim, cast, shard.dtype)


def hand_out(upcast: bool = False, fp8_gathers: bool = False) -> Callable:
    """The `use_params` hook inside a shard_map manual over `data`: a `Handout` (ZeRO-1/2) is
    reduce-scattered at use, a `Shard` (ZeRO-3) all-gathered at use, a value already data-varying
    only cast, anything else cast to data-varying (its gradient all-reduced at use). Matrices come
    out in the compute dtype. With `upcast` (master weights) a 16-bit parameter is made float32
    first, so that its gradient is reduced in float32. With `fp8_gathers` (`model.fp8`) the FP8
    matmuls' weights (`jaxpar.model.fp8.gathered`) are gathered as float8. Both executors hand
    parameters out through it, marked by `mark_for_use`."""
    def use(x, names: tuple[str, ...], cast) -> jax.Array:
        if isinstance(x, Handout):
            return _cast(_scatter_at_use(x.full, x.seed, x.dim % x.full.ndim), cast)
        if isinstance(x, Shard):
            return gather_at_use(x.value, x.dim % x.value.ndim, cast, fp8_gathers and fp8.gathered(names))
        if DATA in varying_axes(x):  # already data-varying: an expert's slice, the pipeline's leaves
            return _cast(x, cast)
        if upcast:
            x = x.astype(jnp.float32)
        return _cast(_varying(x), cast)
    return use


def mark_for_use(red: Reduction, diff, full, dims):
    """The parameters as `hand_out` receives them: where `red` reduces ZeRO-1/2's gradients at
    use, a `Handout` of each sharded leaf of `full` with its seed from `diff`; where it gathers
    ZeRO-3's shards at use, each shard of `diff` as a `Shard`; else `diff` as is. `dims` are the
    leaves' ZeRO dims (`Layout.zero_dims`, a stack's: they count from the end once marked)."""
    scatter, gather = red.scatter, red.gather == "use"

    def one(dd, w, dim):
        if dim is None or not (scatter or gather):
            return dd
        return Handout(w, dd, dim - w.ndim) if scatter else Shard(dd, dim - w.ndim)
    return jax.tree.map(one, diff, full, dims, is_leaf=lambda x: x is None or isinstance(x, int))


def manual_region(cfg: Config, mesh: Mesh, *always: str) -> tuple[set[str], Rules, TensorParallel | None]:
    """The manual axes of a shard_map computing the loss (`always`, plus `data` and `model` where
    they have more than one shard), the compute rules left for the automatic axes, and the
    tensor-parallel context when `model` is manual."""
    t = mesh.shape[MODEL]
    manual = set(always) | ({DATA} if mesh.shape[DATA] > 1 else set()) | ({MODEL} if t > 1 else set())
    tp = TensorParallel(t, cfg.parallel.sequence_parallel, cfg.model.n_heads, cfg.model.kv_heads) if t > 1 else None
    return manual, compute_rules(cfg, mesh).without(tuple(manual)), tp


@dataclasses.dataclass(frozen=True)
class GradientReduction:
    """How one gradient leaf is reduced over `data` in a step (`Reduction.gradient`)."""

    op: str         # "all-reduce" or "reduce-scatter" (along the leaf's ZeRO dim)
    when: str
    """`use`: where the parameter is used, per microbatch (inside the backward layer scan; in a
    pipeline in each B or W action); `after`: once per step, after the microbatch or tick loop."""
    float32: bool   # reduced in float32 (else in the parameter's dtype)
    per_step: int   # reductions per step


@dataclasses.dataclass(frozen=True)
class Reduction:
    """Where a step reduces its gradients over `data` and gathers ZeRO-3's parameters, for one
    config on one mesh: the one description that both executors (`make_loss_and_grads`,
    `jaxpar.parallel.pipeline`), the planner (`jaxpar.costs`), the master-weight upcast
    (`jaxpar.train.optim.upcast_at_use`) and the CLI summary (`describe`) read. `reduction(...)`
    builds it; DESIGN.md decision 5 gives the reasons."""

    data: int          # data shards
    zero: int          # the ZeRO stage in effect (0 on one data shard: nothing is sharded)
    pipeline: bool     # stage > 1: the tick loop's executor
    microbatches: int
    gather: str | None
    """ZeRO-3's all-gathers: `use` (each layer's shards where the layer runs, forward and backward,
    every microbatch; the gather's transpose reduce-scatters the gradient there), `step` (every
    shard once before the microbatch or tick loop, kept for the step), None (no ZeRO-3)."""
    at_use: bool
    """Is every gradient reduced where its parameter is used (per layer inside the backward pass,
    once per microbatch), rather than accumulated unreduced in float32 and reduced once after the
    loop? ZeRO-1/2 reduce-scatter there through a zero seed (`Handout`), ZeRO-0 all-reduces
    through the data-varying cast's transpose, ZeRO-3 through its gather's."""

    master: bool = False
    """`train.master_weights`: what is differentiated (and reduced at use) is float32."""

    @property
    def dp(self) -> bool:
        return self.data > 1

    def gradient(self, sharded: bool, expert: bool = False) -> GradientReduction | None:
        """How the gradient of a leaf is reduced over `data` (None: not at all, one data shard or
        an expert-parallel expert, whose gradient is complete on its rank). `sharded`: the leaf is
        ZeRO-sharded over data (`Layout.zero_dims` not None). The executors (`reduce_after`,
        `hand_out`, the pipeline's W) and the planner (`jaxpar.plan.collectives`, `.memory`) read
        this one rule."""
        if not self.dp or expert:
            return None
        sharded = sharded and self.zero >= 1
        # A pipeline's unsharded leaves are data-varying already when its actions use them (no
        # cast to transpose): summed in its float32 accumulators and reduced after the loop.
        use = self.at_use and (sharded or not self.pipeline)
        return GradientReduction(
            op="reduce-scatter" if sharded else "all-reduce", when="use" if use else "after",
            # At use: the differentiated dtype. After the loop: the pipeline's float32 accumulators;
            # data parallelism's accumulator is cast back to the differentiated dtype first.
            float32=self.master or (self.pipeline and not use),
            per_step=self.microbatches if use else 1)

    def reduce_after(self, g: jax.Array, dim: int | None, expert: bool = False) -> jax.Array:
        """The reduction after the microbatch or tick loop of a gradient whose ZeRO dim is `dim`
        (`gradient(...).when == "after"`; one reduced at use, or not at all, comes back as is):
        the one call of both executors."""
        rule = self.gradient(dim is not None, expert)
        if rule is None or rule.when == "use":
            return g
        if rule.op == "all-reduce":
            return jax.lax.psum(g, DATA)
        return jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)

    @property
    def scatter(self) -> bool:
        """ZeRO-1/2 reduce-scatter at use: each sharded leaf is handed out with a zero seed
        (`Handout`) whose gradient receives its reduced shard (in a pipeline: ZeRO-2 per microbatch,
        in every B)."""
        return self.at_use and self.zero in (1, 2)

    def describe(self) -> str:
        """The policy in words (the CLI's `gradients:` line)."""
        m, loop = self.microbatches, "tick loop" if self.pipeline else f"{self.microbatches} microbatch(es)"
        if not self.dp:
            return "one data shard: nothing reduced over data"
        op = "reduce-scattered" if self.zero >= 1 else "all-reduced"
        mb = f" in each of {m} microbatches" if m > 1 else ""
        where = "in each B of the tick loop" if self.pipeline else f"inside the backward layer scan{mb}"
        if self.gather == "use":
            return f"ZeRO-3: parameters all-gathered per layer where used; gradients reduce-scattered there, {where}"
        if self.at_use:
            return f"{op} per layer where each parameter is used, {where}"
        prefix = "ZeRO-3: parameters all-gathered once per step; " if self.gather == "step" else ""
        return (f"{prefix}accumulated unreduced in float32 over {'the ' if self.pipeline else ''}{loop}, "
                f"{op} over data once after {'it' if self.pipeline else 'them'}")


def reduction(cfg: Config, data: int, stage: int) -> Reduction:
    """The `Reduction` of `cfg` on a mesh of `data` x `stage` (x any model) devices."""
    par, m = cfg.parallel, cfg.parallel.microbatches
    zero = par.zero if data > 1 else 0
    pipeline = stage > 1
    gather = zero3_gathers(cfg, stage) if zero == 3 else None
    at_use = data > 1 and (gather == "use" or (zero == 2 and par.zero2_reduce == "microbatch")
                           or (zero in (0, 1, 2) and m == 1 and not pipeline))
    return Reduction(data=data, zero=zero, pipeline=pipeline, microbatches=m, gather=gather, at_use=at_use,
                     master=cfg.train.master_weights != "none")


def zero3_gathers(cfg: Config, stage: int) -> str:
    """Where ZeRO-3 gathers its shards (`Reduction.gather`): once per step (`step`) where
    `parallel.zero3_gather: step` and the step loops (microbatches or a pipeline), else at each use."""
    par = cfg.parallel
    return "step" if par.zero3_gather == "step" and (par.microbatches > 1 or stage > 1) else "use"


def describe_reduction(cfg: Config, data: int, stage: int) -> str:
    """Where the data-axis gradient reduction happens for `cfg` on this mesh, in words (the CLI)."""
    return reduction(cfg, data, stage).describe()


def _seed(x: jax.Array, dim: int, data: int, dtype=None) -> jax.Array:
    """Zeros shaped like x's data shard along `dim` (in x's dtype, or `dtype`: the gradient's),
    varying over `data` (and whatever x varies over)."""
    shape = x.shape[:dim] + (x.shape[dim] // data,) + x.shape[dim + 1:]
    return vary(jnp.zeros(shape, dtype or x.dtype), (*varying_axes(x), DATA))


def make_loss_and_grads(cfg: Config, mesh: Mesh, layout: Layout, loss_fn: Callable, maxima: bool = False) -> Callable:
    """`(params, batch) -> (loss, grads)` on the global batch, with params and grads laid out by
    `layout`. `loss_fn(params, batch_rows, n_tokens)` is the summed loss of some rows divided by
    `n_tokens`, so that losses and gradients of disjoint rows add up to those of the whole batch.

    The shard_map is manual over `data` (when it has more than one shard) and over `model` (when
    tensor parallelism is on: Megatron's explicit collectives, `jaxpar.sharding.enter_tp` etc.).
    A manual axis of size 1 is left out: beside an automatic axis it trips XLA's SPMD
    partitioner on jax 0.10.2 ("Cross-partition allreduce must be in (partial) manual
    partitioning mode"), and there is nothing to reduce over it anyway.

    With `maxima` (train.qk_clip), `loss_fn` returns (loss, maxima [layers, N]: each layer's
    per-head largest attention logit, `jaxpar.model.qk_clip`) and so does the loss here: the
    largest over microbatches (`microbatches.accumulate`) and data ranks (`pmax`), the heads this
    model rank holds assembled into all N by the out_specs (a tiled concatenation over `model`).
    """
    zero, m, d = layout.zero, cfg.parallel.microbatches, mesh.shape[DATA]
    n_tokens = microbatches.loss_tokens(cfg)
    dp = d > 1
    manual, rules, tp = manual_region(cfg, mesh)
    red = reduction(cfg, d, 1)
    at_use = red.at_use
    master = cfg.train.master_weights != "none"
    # Otherwise no hook: `use_params` still hands matrices out in the compute dtype (`recast`).
    param_fn = hand_out(upcast=master, fp8_gathers=cfg.model.fp8) if at_use else None
    # ZeRO-1/2 leaves sharded over data: handed out with a seed when reduced at use.
    scatter = jax.tree.map(lambda dim: red.scatter and dim is not None, layout.zero_dims,
                           is_leaf=lambda x: x is None or isinstance(x, int))

    def grads_of(diff, params, rows):
        def loss_of(diff):
            return loss_fn(mark_for_use(red, diff, params, layout.zero_dims), rows, n_tokens)
        # (ZeRO-3's gathers one after another on simulated devices, `sharding._after`: +3% temp
        # here; a pipeline's tick, where it cost +32% on tests/test_composition.py's model, does
        # without, DESIGN.md §9.)
        with activation_rules(mesh, rules, param_fn=param_fn, tp=tp, compute_dtype=cfg.model.dtype,
                              serial_gathers=True):
            return jax.value_and_grad(loss_of, has_aux=maxima)(diff)

    def accumulate(diff, params, batch):
        return microbatches.accumulate(lambda rows: grads_of(diff, params, rows), diff, batch, m, maxima)

    def local(params, batch):
        if at_use:  # reduced where used: ZeRO-1/2 through seeds, ZeRO-0 and ZeRO-3 through param_fn
            diff = jax.tree.map(lambda x, dim, s: _seed(x, dim, d, jnp.float32 if master else None) if s else x,
                                params, layout.zero_dims, scatter,
                                is_leaf=lambda x: x is None or isinstance(x, int))
            return _finish(*accumulate(diff, params, batch))
        if dp:  # accumulated unreduced over microbatches, reduced once after the loop
            if zero == 3:  # ZeRO-3, gathered once per step: the gathered copies are data-varying
                params = gather_for_step(cfg, params, layout.zero_dims)
            params = jax.tree.map(_varying, params)
        loss, g = accumulate(params, params, batch)
        g = jax.tree.map(red.reduce_after, g, layout.zero_dims, layout.experts,
                         is_leaf=lambda x: x is None or isinstance(x, int))
        return _finish(loss, g)

    def _finish(loss, g):
        if maxima:
            loss, top = loss
            return ((jax.lax.psum(loss, DATA), jax.lax.pmax(top, DATA)) if dp else (loss, top)), g
        return (jax.lax.psum(loss, DATA) if dp else loss), g

    if not manual:
        return lambda params, batch: accumulate(params, params, batch)
    batch_spec = P(DATA) if dp else P()
    # (The maxima [layers, N]: each model rank's own heads, N / t of them, in rank order.)
    loss_spec = (P(), P(None, MODEL) if MODEL in manual else P()) if maxima else P()
    return jax.shard_map(local, mesh=mesh, in_specs=(layout.manual_specs("params", manual), batch_spec),
                         out_specs=(loss_spec, layout.manual_specs("grads", manual)), axis_names=manual)


def gather_for_step(cfg: Config, params, zero_dims):
    """ZeRO-3 with `parallel.zero3_gather: step` (`Reduction.gather == "step"`), both executors:
    every shard all-gathered over `data` along its sharded dim once, before the microbatch or tick
    loop (a replicated leaf as is). With `model.fp8` the FP8 matmuls' weights (`fp8.gathered`)
    travel as float8 bytes (`fp8.gather`: a quarter of float32's, half of bf16's), dequantized in
    the compute dtype (as gathered at use) and kept in their stored dtype; the matmul quantizes
    them again to the same values."""
    names = param_names(cfg.model)

    def one(x, dim, n):
        if dim is None:
            return x
        gather = lambda q: jax.lax.all_gather(q, DATA, axis=dim, tiled=True)  # noqa: E731
        if not (cfg.model.fp8 and fp8.gathered(n)):
            return gather(x)
        # A scale per layer of a stack: every leading dim but the weight's own (a pipeline's
        # chunk and slot dims too).
        own = len(tuple(itertools.dropwhile(lambda a: a in ("layers", "mtp"), n)))
        # (Dequantized in the compute dtype, as at use, kept in the stored one: the same values.)
        return fp8.gather(x, gather, jnp.dtype(cfg.model.dtype), x.ndim - own).astype(x.dtype)
    return jax.tree.map(one, params, zero_dims, names, is_leaf=lambda x: x is None or isinstance(x, int))
