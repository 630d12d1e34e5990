"""ZeRO over `data`: which leaves of parameters, gradients and optimizer state are sharded, per stage.

Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters
(FSDP). The sharded dim of every leaf comes from its logical names, never from per-tensor code:

- the dim named `embed` goes to `data` (the storage rule);
- fallback, for a leaf without an `embed` dim (biases) or whose `embed` size the data size does
  not divide: its largest other dim that the data size divides, never `layers` (scanned);
- a leaf with fewer than `parallel.zero_min_elements` elements (default 16384: norm scales,
  small biases) stays replicated: sharding it would save a few bytes and cost one collective;
- a leaf with no dim to shard stays replicated; under ZeRO-3 a large one (at least
  `zero_min_elements`) is refused with a ConfigError before compiling, never silently replicated.

With a pipeline (`stage` > 1) the leaves outside the layer stack (embeddings, final norm, head),
which only the end stages use, are also stored sharded over `stage` (`Layout.stage_dims`: the
largest dim other than the ZeRO dim that the stage size divides, at least `zero_min_elements`
elements) with their optimizer state: the pipeline all-gathers them over `stage` before its tick
loop and reduce-scatters their gradients over `stage` after it, the same bytes as the all-reduce
over `stage` that replicated leaves need, and each device keeps 1/p of them and of their moments
(DESIGN.md §4).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.config import Config, ConfigError
from jaxpar.parallel.pipeline.placement import placement_of
from jaxpar.parallel.stages import valid_stage_layout
from jaxpar.sharding import expert_replicas, Rules, storage_rules


ZERO_DIM_NAME = "embed"


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple)


def zero_dim(names: tuple[str, ...], shape: tuple[int, ...], split: tuple[int, ...], data: int,
             min_elements: int) -> int | None:
    """The dim of a leaf that ZeRO shards over `data`, or None if the leaf stays replicated.

    `split[i]` is how many ways other axes already split dim i (e.g. `model` for `mlp`); the data
    size must divide what is left of it.
    """
    if data == 1 or math.prod(shape) < min_elements:
        return None
    # (`fp8`: the FP8 amax history, whose reduction sums one rank's report: kept whole everywhere.)
    fits = [i for i, n in enumerate(names) if n not in ("layers", "mtp", "fp8") and shape[i] % (split[i] * data) == 0]
    if ZERO_DIM_NAME in names and names.index(ZERO_DIM_NAME) in fits:
        return names.index(ZERO_DIM_NAME)
    return max(fits, key=lambda i: (shape[i], -i)) if fits else None


@dataclasses.dataclass(frozen=True)
class Layout:
    """PartitionSpecs (full mesh) of parameters, gradients and optimizer-state moments, and for each
    leaf the dim sharded over `data` (None: replicated over `data`)."""

    zero: int
    params: Any
    grads: Any
    moments: Any
    zero_dims: Any
    stage_dims: Any = None  # per leaf, the dim sharded over `stage` (shared leaves of a pipeline) or None
    # Per leaf, whether its storage splits it over `data` already (MoE expert parallelism): each
    # data rank holds its own experts (or, with more ranks than experts, a slice of every expert),
    # whose gradients are complete there and never reduced.
    experts: Any = None

    def manual_specs(self, which: str, axes: set[str]) -> Any:
        """Specs of `which` ("params" or "grads") restricted to the manual `axes` of a shard_map."""
        tree = self.params if which == "params" else self.grads

        def keep(ax):  # ("model", "data") -> "data" when only data is manual
            kept = tuple(a for a in ((ax,) if isinstance(ax, str) else ax or ()) if a in axes)
            return None if not kept else kept[0] if len(kept) == 1 else kept
        return jax.tree.map(lambda s: P(*map(keep, s)), tree, is_leaf=lambda x: isinstance(x, P))


def _with_data(spec: P, dim: int | None) -> P:
    if dim is None:
        return spec
    axes = list(spec)
    current = axes[dim]
    if current is None:
        axes[dim] = "data"
    else:
        # The dim is also split by another axis (e.g. `model`): data innermost, so that each
        # model rank's slice is gathered (and its gradient reduce-scattered) over `data` as a
        # contiguous block inside a shard_map manual over both axes. With data outermost a tiled
        # all_gather of the model slice would interleave the wrong blocks.
        axes[dim] = ((current,) if isinstance(current, str) else tuple(current)) + ("data",)
    return P(*axes)


def make_layout(cfg: Config, mesh: Mesh, names: Any, shapes: Any) -> Layout:
    """The layout of `cfg.parallel.zero` for parameters with logical `names` and `shapes`."""
    zero, data, min_elements = cfg.parallel.zero, mesh.shape["data"], cfg.parallel.zero_min_elements
    rules: Rules = storage_rules(cfg, mesh)
    base = jax.tree.map(rules.spec, names, is_leaf=_is_names)
    p = mesh.shape["stage"]
    # Where the pipeline's chunks are not an even split of the stacks (uneven stages, a mixed
    # model's dense first layers: `jaxpar.parallel.stages`), every stack is stored with its
    # `layers` whole and `stage` on another dim (`_stage_dim`), and the step hands each stage its
    # chunks' layers by an all-to-all over `stage`.
    slots = _gathers_slots(cfg, p)
    if slots:
        base = jax.tree.map(lambda n, b: _without_stage(b) if n[:1] == ("layers",) else b, names, base,
                            is_leaf=_is_names)

    def split(spec: P) -> tuple[int, ...]:
        return tuple(math.prod(mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else ax or ())) for ax in spec)

    if expert_replicas(cfg, data) > 1:
        # More data ranks than experts: every rank stores a 1/data slice of every expert's `embed`
        # dim, whatever the ZeRO stage, and assembles its own expert where it is used (an
        # all-to-all, `jaxpar.model.moe.own_expert`, whose transpose sums each expert's gradient
        # over its replicas): less than a whole expert per rank, and no further reduction.
        base = jax.tree.map(lambda n, b: _with_data(b, n.index("embed")) if "experts" in n else b, names, base,
                            is_leaf=_is_names)
    # Leaves that expert parallelism splits over `data` already take no ZeRO dim.
    experts = jax.tree.map(lambda b: "data" in _axes_of(b), base, is_leaf=lambda x: isinstance(x, P))
    dims = jax.tree.map(lambda n, s, b, e: None if e else zero_dim(n, s.shape, split(b), data, min_elements),
                        names, shapes, base, experts, is_leaf=_is_names)
    if zero == 3 and data > 1:  # on one data shard there is nothing to shard: ZeRO-3 is plain replication
        _refuse_replicated(names, shapes, dims, data, min_elements, experts)

    def stage(min_zero: int) -> Any:
        return jax.tree.map(lambda b, d: _with_data(b, d) if zero >= min_zero else b, base, dims,
                            is_leaf=lambda x: isinstance(x, P))

    # Gradients leave the step reduce-scattered from ZeRO-1 on (each device updates its shard;
    # DeepSpeed stage 1, Megatron's distributed optimizer); ZeRO-1 and 2 differ in whether the
    # full gradient is accumulated before its reduction (`jaxpar.parallel.gradients`).
    moments = stage(1)
    sdims = jax.tree.map(lambda n, s, b, d: _stage_dim(n, s.shape, split(_with_data(b, d)), d, p, min_elements,
                                                       slots),
                         names, shapes, base, dims, is_leaf=_is_names)
    with_stage = lambda tree: jax.tree.map(_with_stage, tree, sdims, is_leaf=lambda x: isinstance(x, P))  # noqa: E731
    return Layout(zero=zero, params=with_stage(stage(3)), grads=with_stage(moments), moments=with_stage(moments),
                  zero_dims=dims, stage_dims=sdims, experts=experts)


def _axes_of(spec: P) -> tuple[str, ...]:
    return tuple(a for ax in spec for a in ((ax,) if isinstance(ax, str) else ax or ()))


def _gathers_slots(cfg: Config, p: int) -> bool:
    """Does the pipeline gather its chunks' layer slots (`jaxpar.parallel.stages.StageLayout.gather`)?"""
    if p == 1:
        return False
    slots = valid_stage_layout(cfg.model, p, cfg.parallel.virtual_stages, cfg.parallel.stage_layers,
                               placement_of(cfg.parallel.schedule))
    return slots is not None and slots.gather


def _stage_dim(names: tuple[str, ...], shape: tuple[int, ...], split: tuple[int, ...], zero_dim: int | None,
               stages: int, min_elements: int, slots: bool = False) -> int | None:
    """The dim of a leaf stored sharded over `stage` besides a stack's `layers` (None: replicated
    over `stage`): for a shared leaf, or a stack of a pipeline that gathers its layer slots
    (`slots`), the largest dim, other than the ZeRO dim and `layers`, that the stage size divides
    after the other axes' split; none for a stack split evenly (its `layers` dim is on `stage`
    already), one stage, or a leaf under `min_elements`."""
    if stages == 1 or math.prod(shape) < min_elements:
        return None
    if names[:1] == ("layers",) and not slots:
        return None
    fits = [i for i in range(len(shape)) if i != zero_dim and names[i] not in ("layers", "mtp", "fp8")
            and shape[i] % (split[i] * stages) == 0]
    return max(fits, key=lambda i: (shape[i], -i)) if fits else None


def _without_stage(spec: P) -> P:
    """`spec` with `stage` dropped from every dim."""
    return _without(spec, "stage")


def _without(spec: P, axis: str) -> P:
    """`spec` with `axis` dropped from every dim."""
    def drop(ax):
        kept = tuple(a for a in ((ax,) if isinstance(ax, str) else ax or ()) if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*map(drop, spec))


def _with_stage(spec: P, dim: int | None) -> P:
    """`spec` with `stage` innermost on `dim` (after `model`: a model rank's slice is gathered over
    `stage` as a contiguous block, as `_with_data` does for `data`)."""
    if dim is None:
        return spec
    axes = list(spec)
    current = axes[dim]
    axes[dim] = "stage" if current is None else ((current,) if isinstance(current, str) else tuple(current)) + ("stage",)
    return P(*axes)


def _refuse_replicated(names, shapes, dims, data, min_elements, experts) -> None:
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_names = jax.tree.leaves(names, is_leaf=_is_names)
    flat_dims = jax.tree.leaves(dims, is_leaf=lambda x: x is None or isinstance(x, int))
    for (path, shape), n, d, e in zip(flat, flat_names, flat_dims, jax.tree.leaves(experts)):
        # (An MoE router's bias and report, a few numbers per expert, the MTP report, one per
        # depth, and an FP8 amax history stay replicated; experts split over `data` by expert
        # parallelism are sharded.)
        if (d is None and not e and math.prod(shape.shape) >= min_elements
                and tuple(x for x in n if x not in ("layers", "mtp")) not in (("router",), ("fp8",), ())):
            leaf = jax.tree_util.keystr(path, simple=True, separator=".")
            raise ConfigError(
                f"parameter {leaf} {tuple(shape.shape)} (dims {', '.join(n)}) would stay replicated under "
                f"parallel.zero = 3: none of its dims is divisible by mesh.data = {data}; choose a data size "
                f"that divides model.d_model, or use parallel.zero = 2.")


def state_bytes(layout: Layout, shapes: Any, mesh: Mesh, moments_per_param: int = 2) -> dict[str, dict[str, int]]:
    """Per-device and fully replicated bytes of parameters, gradients and optimizer state (Adam: two
    moments per parameter, in the parameter dtype).

    Per device, every axis of a leaf's spec divides it: `stage` (the layer stacks, and the shared
    leaves a pipeline stores split), `model` (tensor-parallel leaves), `data` (ZeRO-3 parameters,
    ZeRO-1+ optimizer state, ZeRO-2+ gradients, and expert-parallel leaves). ZeRO-1's gradients are
    counted whole over `data` (held so before their reduce-scatter), still split by the others."""

    def per_device(specs: Any) -> int:
        def leaf(spec: P, s) -> int:
            split = 1
            for ax in spec:
                for a in (() if ax is None else (ax,) if isinstance(ax, str) else ax):
                    split *= mesh.shape[a]
            return s.size * s.dtype.itemsize // split
        return sum(jax.tree.leaves(jax.tree.map(leaf, specs, shapes, is_leaf=lambda x: isinstance(x, P))))

    full = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes))
    # ZeRO-1 reduce-scatters its gradients too, but (with microbatches) holds them whole first; an
    # expert-parallel leaf's gradient is this rank's experts' only, whatever the ZeRO stage.
    experts = layout.experts if layout.experts is not None else jax.tree.map(lambda _: False, shapes)
    held = layout.grads if layout.zero >= 2 else jax.tree.map(
        lambda spec, e: spec if e else _without(spec, "data"), layout.grads, experts,
        is_leaf=lambda x: isinstance(x, P))
    return {
        "params": {"per_device": per_device(layout.params), "replicated": full},
        "grads": {"per_device": per_device(held), "replicated": full},
        "optimizer": {"per_device": moments_per_param * per_device(layout.moments),
                      "replicated": moments_per_param * full},
    }
