"""One stage's plan (`StagePlan`): everything about the stage's step that is fixed before its tick
loop runs, built once by `make_plan` and never written after. The actions (`actions`), the first
carry and the tick (`tick`) read it; none of them fills it.

What it fixes, in the order `make_plan` finds it:

1. From the parameters' structure: the block leaves' paths and stacks (`paths`, `kinds`,
   `kind_paths`), their ZeRO dims and what is differentiated (`block_dims`, `block_mask` ...),
   the shape of a message (`act_shape`) and what the table holds (`split_i`, `fused_b`,
   `stash_inputs`).
2. With a split table, from a recording trace of the chunk: each weight matmul's tap (`taps`: the
   shapes of its input and output cotangent, their manual axes, the weight's shape).
3. From an abstract trace of F (`actions.forward` with a `Recording`): what each pullback keeps
   (`residuals`: per layer kind and for the embedding, its structure and which leaves are
   parameters), the stash leaves' types (`layer_avals`, `end_avals`) and where F stashed each
   tapped matmul's input (`x_source`).
4. From those types: where I's outputs for W go in the stash slot (`packing`, `stash.pack`) and
   what does not fit, the wstash (`wstash_items`).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import NamedTuple

import jax

from jaxpar.model.layers import split_backward
from jaxpar.model.transformer import block_kinds, stack, stack_prefix
from jaxpar.parallel import microbatches
from jaxpar.parallel.pipeline import actions
from jaxpar.parallel.pipeline.setup import MODEL, STAGE, Setup
from jaxpar.parallel.pipeline.stash import pack
from jaxpar.parallel.pipeline.table import stashes_inputs
from jaxpar.sharding import aval_varying_axes, vary, varying_axes


class Stage(NamedTuple):
    """This stage's traced inputs, the same in every tick: its index along `stage`, its chunks'
    parameters and its microbatches."""

    index: jax.Array  # axis_index("stage")
    blocks: dict      # [v, layers per chunk, ...] per block leaf, data-varying (unreduced in the loop)
    shared: dict      # embedding, final norm, head: data- and stage-varying
    micro: jax.Array  # [m, b, seq + 1] token ids (context parallelism: [m, 2b, seq / 2 + 1] chunk windows)


def stage_inputs(setup: Setup, index: jax.Array, params: dict, batch: jax.Array) -> Stage:
    v = setup.v
    # This stage's v chunks, [v, layers per chunk, ...] (the blocks arrive in pipeline order).
    blocks = jax.tree.map(lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]), params["blocks"])
    shared = {k: w for k, w in params.items() if k != "blocks"}
    # Unreduced inside the loop: blocks vary over `data`; shared parameters over `data` and
    # `stage` too (only the end stages use them); both are reduced once after the loop.
    # (ZeRO-3's shards, and what was gathered from them, vary over `data` already.)
    return Stage(index, jax.tree.map(lambda w: vary(w, setup.data_axes), blocks),
                 jax.tree.map(lambda w: vary(w, (*setup.data_axes, STAGE)), shared),
                 microbatches.split(batch, setup.m))


def _from_traces():
    """A field `make_plan`'s traces fill (empty until then)."""
    return dataclasses.field(default_factory=lambda: MappingProxyType({}))


@dataclasses.dataclass(frozen=True, eq=False)
class StagePlan:
    """One stage's step, fixed before its tick loop (module docstring: what and from where)."""

    setup: Setup
    # A message (F's output, B's input gradient): its shape and the manual axes it varies over.
    act_shape: tuple
    act_axes: tuple
    # The block parameters: trees of ZeRO dims and of "is this leaf differentiated as a seed"
    # (ZeRO-2 per microbatch), and the shared leaves' alike.
    block_dims: object
    block_mask: object
    shared_dims: dict
    shared_mask: dict
    # Block leaves as a flat dict keyed by their path (the split backward's taps are keyed so).
    block_def: object        # treedef of one chunk's blocks
    paths: tuple             # the leaves' paths, in tree order
    chunk_layers: dict       # path -> layers of a chunk in that leaf's stack
    dim_of: dict             # path -> ZeRO dim of the stacked leaf (-1: none)
    block_mask_flat: dict    # path -> differentiated as a seed?
    acc_axes: dict           # path -> manual axes of its gradient accumulator
    # Per stack kind ("" for one kind of block; a mixed model's "dense" and "moe").
    kinds: tuple
    kind_paths: dict         # kind -> its leaves' paths
    kind_def: dict           # kind -> treedef of one layer
    layer_dims: dict         # kind -> ZeRO dims counted in one layer's leaf (the stacked dim less one)
    n_layers: dict           # kind -> layers of that stack in a chunk
    # What the table holds.
    split_i: bool            # a split table without fused Bs: I writes W's pairs inside its own cond
    fused_b: bool            # the table holds fused Bs
    stash_inputs: bool       # F stashes each tapped matmul's input for W (`table.stashes_inputs`)
    # From the traces (module docstring, steps 2-4).
    taps: MappingProxyType = _from_traces()         # path -> (x shape, x dtype, g shape, g dtype, axes, w shape)
    residuals: MappingProxyType = _from_traces()    # name -> (treedef, where): ("p", i) a parameter, ("s", j) a stash leaf
    x_source: MappingProxyType = _from_traces()     # tapped path -> (kind, stash leaf) of its stashed input
    layer_avals: MappingProxyType = _from_traces()  # kind -> the types of one layer's stash leaves
    end_avals: tuple = ()                           # the embedding's residuals' and the head cotangent's types
    packing: MappingProxyType = _from_traces()      # (path, 0 | 1) -> (kind, leaf, offset, shape) in the stash slot
    wstash_items: MappingProxyType = _from_traces()  # (path, 0 | 1) -> (shape, dtype, axes): the wstash's
    maxima: MappingProxyType = _from_traces()       # train.qk_clip: kind | "mtp" -> the type of F's report

    def flat(self, tree) -> dict:
        return dict(zip(self.paths, jax.tree.leaves(tree)))

    def unflat(self, d: dict):
        return jax.tree.unflatten(self.block_def, [d[k] for k in self.paths])

    def flat_kind(self, kind, tree) -> dict:
        return dict(zip(self.kind_paths[kind], jax.tree.leaves(tree)))

    def unflat_kind(self, kind, d: dict):
        return jax.tree.unflatten(self.kind_def[kind], [d[k] for k in self.kind_paths[kind]])


@dataclasses.dataclass
class Recording:
    """What an abstract trace of F records (`make_plan`, step 3): filled by `actions.forward`
    while it traces, then frozen into the plan."""

    residuals: dict = dataclasses.field(default_factory=dict)
    x_source: dict = dataclasses.field(default_factory=dict)
    layer_avals: dict = dataclasses.field(default_factory=dict)
    end_avals: tuple = ()
    maxima: dict = dataclasses.field(default_factory=dict)


def _layout(setup: Setup, st: Stage) -> StagePlan:
    """Step 1: the plan from the parameters' structure and the table (no trace yet)."""
    s, layout, cfg = setup, setup.layout, setup.cfg
    b, seq = actions.microbatch(s, st, 0)[0].shape
    is_dim = lambda x: x is None or isinstance(x, int)  # noqa: E731
    block_dims = layout.zero_dims["blocks"]
    # What is differentiated: the parameters, or (ZeRO-2 per microbatch) the seeds of the
    # sharded ones, each handed to the model beside its parameter.
    block_mask = jax.tree.map(lambda dim: s.reduction.scatter and dim is not None, block_dims, is_leaf=is_dim)
    shared_mask = {k: jax.tree.map(lambda dim: s.reduction.scatter and dim is not None, layout.zero_dims[k],
                                   is_leaf=is_dim) for k in st.shared}
    one = jax.tree.map(lambda w: w[0], st.blocks)
    paths = tuple(jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(one))
    flat = lambda tree: dict(zip(paths, jax.tree.leaves(tree)))  # noqa: E731
    chunk_layers = {k: w.shape[0] for k, w in flat(one).items()}
    kinds = tuple(block_kinds(s.chunk_cfg))
    kind_paths = {kind: [stack_prefix(kind) + jax.tree_util.keystr(k_)
                         for k_, _ in jax.tree_util.tree_leaves_with_path(stack(one, kind))] for kind in kinds}
    fused_b = bool(s.table.rows["b_valid"].any())
    return StagePlan(
        setup=setup, act_shape=(b, seq // s.t if s.sp else seq, cfg.model.d_model),
        act_axes=(*s.data_axes, STAGE, *((MODEL,) if s.sp else ())),
        block_dims=block_dims, block_mask=block_mask, shared_dims={k: layout.zero_dims[k] for k in st.shared},
        shared_mask=shared_mask, block_def=jax.tree.structure(one), paths=paths, chunk_layers=chunk_layers,
        dim_of=flat(jax.tree.map(lambda dim: -1 if dim is None else dim, block_dims, is_leaf=is_dim)),
        block_mask_flat=flat(block_mask),
        acc_axes={k: (*s.data_axes, *varying_axes(w)) for k, w in flat(one).items()},
        kinds=kinds, kind_paths=kind_paths,
        kind_def={kind: jax.tree.structure(stack(one, kind)) for kind in kinds},
        layer_dims={kind: jax.tree.map(lambda dim: None if dim is None else dim - 1, stack(block_dims, kind),
                                       is_leaf=is_dim) for kind in kinds},
        n_layers={kind: chunk_layers[kind_paths[kind][0]] for kind in kinds},
        split_i=s.table.split and not fused_b, fused_b=fused_b,
        stash_inputs=stashes_inputs(cfg.parallel.remat, s.table.split, fused_b, s.slots.gather))


def _taps(plan: StagePlan, st: Stage, z: jax.Array) -> dict:
    """Step 2: the taps' shapes, from a recording trace of the chunk (split tables only)."""
    s = plan.setup
    with split_backward(None) as rec:
        full_bl = actions.chunk_params(st, z)

        def chunk(x):
            return actions.chunk_forward(plan, st, actions.handed_blocks(plan, actions.diff_blocks(plan, full_bl), full_bl),
                                         actions.handed_shared(plan, st, actions.diff_shared(plan, st)), x,
                                         actions.microbatch(s, st, z)[0], z > 0, z)
        jax.make_jaxpr(chunk)(actions.zeros(plan, plan.act_shape))
    return {k_: (xs, xd, gs, gd, tuple(sorted({*ax, *s.data_axes, STAGE})), ws)
            for k_, (xs, xd, gs, gd, ax, ws) in rec.shapes.items()}


def _packing(plan: StagePlan) -> tuple[dict, dict]:
    """Step 4: what I keeps for W (each tapped matmul's input and output cotangent, per layer) goes
    into its stash slot, over residuals of the same layer that I has consumed; the wstash holds
    what does not fit. (Not the inputs W reads where F stashed them, `x_source`: those residual
    leaves stay.) Returns (packing, wstash items)."""
    s = plan.setup
    items = {(k_, j): (shape, dtype, ax)
             for k_, (xs, xd, gs, gd, ax, _) in plan.taps.items()
             for j, (shape, dtype) in enumerate(((xs, xd), (gs, gd)))
             if not (j == 0 and k_ in plan.x_source)}
    kept = set(plan.x_source.values())
    packing = {}
    for kind in plan.kinds:
        # (A stash leaf's slot row holds a.size elements; it varies over its aval's axes, `data`
        # and `stage`: `tick.initial_carry`.)
        bins = [((0,) if (kind, j) in kept else (a.size,), a.dtype,
                 tuple(sorted({*aval_varying_axes(a), *s.data_axes, STAGE})))
                for j, a in enumerate(plan.layer_avals[kind])]
        packed = pack({key: it for key, it in items.items() if key[0] in plan.kind_paths[kind]}, bins)
        packing.update({key: (kind, *where) for key, where in packed.items()})
    return packing, {key: it for key, it in items.items() if key not in packing}


def make_plan(setup: Setup, st: Stage, rows: dict) -> StagePlan:
    """This stage's plan: its layout, then the traces (module docstring). Called once per step
    trace, inside the step's activation rules (the traces run the model as the tick will)."""
    plan = _layout(setup, st)
    z = rows["f_mb"][0][st.index] * 0  # an index that varies over `stage` as the tick's do
    if setup.table.split:
        plan = dataclasses.replace(plan, taps=MappingProxyType(_taps(plan, st, z)))
    # The stash's leaves: types from an abstract trace of F.
    rec = Recording()
    jax.make_jaxpr(lambda x: actions.forward(plan, st, x, z, z, None, z,
                                             microbatches.f32_zeros(actions.diff_shared(plan, st)), rec)[0])(
        actions.zeros(plan, plan.act_shape))
    plan = dataclasses.replace(plan, residuals=MappingProxyType(rec.residuals),
                               x_source=MappingProxyType(rec.x_source),
                               layer_avals=MappingProxyType({k: tuple(a) for k, a in rec.layer_avals.items()}),
                               end_avals=tuple(rec.end_avals), maxima=MappingProxyType(rec.maxima))
    packing, wstash_items = _packing(plan)
    return dataclasses.replace(plan, packing=MappingProxyType(packing), wstash_items=MappingProxyType(wstash_items))
