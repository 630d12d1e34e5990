"""Pipeline parallelism over `stage`: one executor that runs any valid schedule table.

Layers are cut into p contiguous chunks (stage s holds layers [s·L/p, (s+1)·L/p): a reshape of the
canonical `[layers, ...]` parameters, whose `layers` dim the storage rules already place on
`stage`). Uneven stages and a mixed model's dense first layers run as layer slots
(`jaxpar.parallel.stages`): the stacks are then stored with `stage` on another dim, one all-to-all
hands each stage its slots (`buffers.to_slots`) and an unfilled slot is skipped. The executor is a
`lax.scan` over the table's ticks inside one shard_map manual over `stage` (and over `data` and
`model` where they have more than one shard): `Setup` holds what every stage knows before tracing,
`_stage_step` is one stage's step, `StageRun.tick` the scan body over a `Carry`, and
`StageRun.forward` / `backward` / `weight_grads` its actions. In each tick every stage looks up its
actions: F runs its chunk forward on a received activation one layer at a time, each layer under
`jax.vjp`, and writes the residuals the remat policy keeps straight into the layer's row of its
stash slot (the first stage embeds the microbatch's tokens; the last adds the head, the loss and
their backward); B runs the layers backward, rebuilding each layer's pullback from its row (no
second forward, no copy of the slot), and accumulates its parameter gradients in float32. With a
split backward, I does B's input-gradient half and writes what W needs (each weight matmul's
output cotangent, and its input where F did not stash it, `stashes_inputs`) into the same stash
slot, over residuals it has consumed; W computes the weight gradients from there and frees the
slot (DESIGN.md §5). Each action reads its stash slot, computes and writes inside its own `lax.cond`: an
idle action reads and writes no stash slot and adds to no accumulator (only the small
receive-buffer rows are read every tick; its branch returns zeros of the hop's message and of the
shared leaves' gradients, §5.3). One forward and one backward `ppermute` per tick move activations
and their gradients to the neighbouring stages; received messages wait in small buffers until their
action's tick. Buffers and stash have the sizes the table declares, so a 1F1B table keeps O(p)
microbatches of activations whatever m is.

Gradients stay unreduced over `data` inside the tick loop and are reduced once after it
(DESIGN.md decision 5): all-reduced (ZeRO-0/1) or reduce-scattered (ZeRO-2); the parameters
shared by the end stages (embeddings, final norm, head) are summed over `stage` after the loop too.

ZeRO-3 (parameters stored as `data` shards) gathers them where `parallel.zero3_gather` says:

- `step`: every sharded leaf is all-gathered once, before the tick loop, and the gathered stage
  parameters are kept for the whole step (their memory, 4 bytes per parameter of this stage,
  plus the float32 gradient accumulator of the same size); gradients accumulate unreduced and
  are reduce-scattered once after the loop, as under ZeRO-2. Traffic: one gather and one
  reduce-scatter of every leaf per step.
- `microbatch`: each layer's shards are all-gathered where the layer runs, in every F and in
  the recomputation and the backward pass of every B (the remat policy never saves gathered
  parameters, so the backward gathers them again), and the transpose of each gather
  reduce-scatters that microbatch's gradient at once, so the accumulator holds only shards.
  Memory: one layer's gathered parameters at a time; traffic: three gathers and one
  reduce-scatter of every leaf per microbatch. The embedding and head are gathered only by the
  stages (and in the actions) that use them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar import model
from jaxpar.config import Config
from jaxpar.model.layers import split_backward, weight_gradient
from jaxpar.model.transformer import block_bodies, block_kinds, scan_layers, stack, stack_prefix
from jaxpar.parallel import microbatches
from jaxpar.parallel.pipeline import stash as buffers
from jaxpar.parallel.pipeline.table import Table, stashes_inputs
from jaxpar.parallel.stages import chunk_model, stage_layout
from jaxpar.parallel.zero import Layout
from jaxpar.parallel.gradients import Reduction, _gather, _seed, hand_out, manual_region, mark_for_use, reduction
from jaxpar.sharding import activation_rules, aval_varying_axes, vary, varying_axes, zeros_like_varying

DATA, STAGE, MODEL = "data", "stage", "model"

class Carry(NamedTuple):
    """What the tick loop carries from tick to tick, per stage."""

    fwd_buf: jax.Array   # [fwd_slots, *activation]: received activations waiting for their F
    bwd_buf: jax.Array   # [bwd_slots, *activation]: received gradients waiting for their B (or I)
    stash: dict          # what F saved for B / I (and I for W): "layers": kind -> per residual leaf of one layer,
                         # [stash slots, layers, size]; "ends": the embedding's residuals, the head's cotangent
    wstash: dict         # (tap, 0 | 1) -> [wstash slots, ...]: what I saved for W that the stash slot cannot hold
    g_blocks: dict       # block leaf path -> float32 [v, layers per chunk, ...]: unreduced gradients
    g_shared: dict       # float32 gradients of the embedding, final norm and head (end stages' only)
    loss: jax.Array      # the summed loss of the microbatches this stage finished


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every stage knows before it traces anything: the config, the mesh's sizes and the
    policies derived from them. Built once per step function by `make_pipeline_loss_and_grads`."""

    cfg: Config
    layout: Layout
    table: Table
    loss_sum: Callable
    poison_idle: bool
    p: int              # stages
    v: int              # chunks per stage
    t: int              # model (tensor-parallel) shards
    d: int              # data shards
    m: int              # microbatches
    slots: object       # `jaxpar.parallel.stages.StageLayout`: the layer slots of every chunk
    chunk_cfg: object   # the model of one chunk (`stages.chunk_model`)
    n_tokens: int       # tokens of the global batch: the loss's one divisor
    sp: bool            # sequence parallelism on
    data_axes: tuple    # ("data",) where data has more than one shard, else ()
    reduction: Reduction  # where gradients are reduced and ZeRO-3's shards gathered (gradients.reduction)
    fwd_pairs: tuple    # ppermute pairs of the forward hop (interleaved: round the ring)
    bwd_pairs: tuple

    @property
    def dp(self) -> bool:
        return bool(self.data_axes)

    @property
    def zero(self) -> int:
        """The ZeRO stage in effect (0 on one data shard: nothing is sharded)."""
        return self.reduction.zero

    @property
    def gather(self) -> str | None:
        return self.reduction.gather

    def reduce_data(self, g: jax.Array, dim: int | None) -> jax.Array:
        """The data-axis reduction after the loop of one gradient whose ZeRO dim is `dim`."""
        if not self.dp:
            return g
        if dim is None or self.zero < 1:
            return jax.lax.psum(g, DATA)
        if self.reduction.at_use:
            return g  # reduce-scattered per microbatch, where its gather (or its seed) was transposed
        return jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)


def make_pipeline_loss_and_grads(cfg: Config, mesh: Mesh, layout: Layout, table: Table,
                                 loss_sum: Callable, *, poison_idle: bool = False) -> Callable:
    """`(params, batch) -> (loss, grads)` of the global batch through the pipeline.

    `loss_sum(logits, targets)` is the summed token loss of a microbatch; it is divided once by
    the global token count. With `poison_idle`, what a stage sends on a tick without F (or
    without B and I) is NaN: a test that an idle tick's send never lands in a buffer, so bubbles
    never leak into gradients (every action reads its input row and stash slot inside its own
    cond, so an idle tick reads neither).
    """
    p, t = mesh.shape[STAGE], mesh.shape[MODEL]
    v = table.chunks
    dp = mesh.shape[DATA] > 1
    # Every chunk runs the same slots per stack; a slot that holds none of its layers is skipped
    # and receives no gradient (`jaxpar.parallel.stages`: uneven stages, dense first layers).
    slots = stage_layout(cfg.model, p, v, cfg.parallel.stage_layers)
    chunk_cfg = chunk_model(cfg.model, slots)
    model.param_names(chunk_cfg)  # build (and cache) the chunk model's abstract state outside any mesh context
    setup = Setup(
        cfg=cfg, layout=layout, table=table, loss_sum=loss_sum, poison_idle=poison_idle, p=p, v=v, t=t,
        d=mesh.shape[DATA], m=cfg.parallel.microbatches, slots=slots, chunk_cfg=chunk_cfg,
        n_tokens=microbatches.loss_tokens(cfg), sp=cfg.parallel.sequence_parallel and t > 1,
        data_axes=(DATA,) if dp else (),
        # ZeRO-2, per microbatch: every B reduce-scatters its sharded gradients where they arise (a
        # seed per leaf, `jaxpar.sharding.Handout`), and the accumulator holds shards only.
        reduction=reduction(cfg, mesh.shape[DATA], p),
        # Interleaved chunks travel round the ring (the last stage's chunk k feeds stage 0's chunk k+1).
        fwd_pairs=tuple((i, (i + 1) % p) for i in range(p if v > 1 else p - 1)),
        bwd_pairs=tuple(((i + 1) % p, i) for i in range(p if v > 1 else p - 1)))
    manual, rules, tp = manual_region(cfg, mesh, STAGE)

    def local(params, batch):
        return _stage_step(setup, mesh, rules, tp, params, batch)

    batch_spec = P(DATA) if dp else P()
    in_specs, out_specs = layout.manual_specs("params", manual), layout.manual_specs("grads", manual)
    run = jax.shard_map(local, mesh=mesh, in_specs=(in_specs, batch_spec), out_specs=(P(), out_specs),
                        axis_names=manual)
    if v == 1 or slots.gather:  # (the slots are in pipeline order already)
        return run

    def interleaved(params, batch):
        # Stage s runs chunks s, s + p, ..., s + (v-1)p: reorder the canonical [layers, ...] so
        # that each stage's contiguous slice holds them (a resharding of the block parameters
        # over `stage` every step, and of their gradients back; see README).
        loss, grads = run({**params, "blocks": jax.tree.map(lambda w: buffers.reorder(w, v, p), params["blocks"])}, batch)
        return loss, {**grads, "blocks": jax.tree.map(lambda g: buffers.reorder(g, p, v), grads["blocks"])}

    return interleaved


def _stage_step(setup: Setup, mesh: Mesh, rules, tp, params, batch):
    """One stage's whole step inside the shard_map: its parameters made ready (layer slots,
    gathers), the tick loop over the table (`StageRun.tick`), and the one reduction after it."""
    layout, p, gather = setup.layout, setup.p, setup.gather
    stage = jax.lax.axis_index(STAGE)
    slots = setup.slots
    if slots.gather:  # this stage's chunks' layer slots, from the stacks stored over `stage` otherwise
        params = {**params, "blocks": buffers.by_kind(slots, params["blocks"], layout.stage_dims["blocks"],
                                               lambda w, kind, sd: buffers.to_slots(w, sd, slots.slots[kind], p, stage))}
    # The shared leaves (embeddings, final norm, head) are stored sharded over `stage` where
    # they are large (`Layout.stage_dims`): gathered here, for the step.
    params = {k: w if k == "blocks" else jax.tree.map(buffers.gather_stage, w, layout.stage_dims[k],
                                                         is_leaf=lambda x: x is None or isinstance(x, int))
              for k, w in params.items()}
    param_fn = hand_out() if setup.reduction.at_use else None  # (ZeRO-3 gathers or ZeRO-2 scatters at use)
    if gather == "step":  # every sharded leaf once per step, kept for the step
        params = jax.tree.map(_gather, params, layout.zero_dims)
    run = StageRun(setup, stage, params, batch)
    rows = {k: jnp.asarray(a) for k, a in setup.table.rows.items()}
    cfg = setup.cfg
    with activation_rules(mesh, rules, param_fn=param_fn, tp=tp, compute_dtype=cfg.model.dtype):
        done, _ = jax.lax.scan(run.tick, run.initial_carry(rows), rows)
    g_blocks = run.unflat(done.g_blocks)
    # The one reduction per step, after the tick loop.
    # (An expert-parallel leaf's gradient is complete on its data rank: not reduced.)
    g_blocks = jax.tree.map(lambda g, w, dim, e: (g.reshape(-1, *g.shape[2:]) if e else
                                                  setup.reduce_data(g.reshape(-1, *g.shape[2:]), dim)).astype(w.dtype),
                            g_blocks, params["blocks"], layout.zero_dims["blocks"], layout.experts["blocks"],
                            is_leaf=lambda x: x is None or isinstance(x, int))
    if slots.gather:  # back from the slots to the stacks' storage (a padding slot's gradient dropped)
        g_blocks = buffers.by_kind(slots, g_blocks, layout.stage_dims["blocks"],
                            lambda g, kind, sd: buffers.from_slots(g, sd, slots.layer_slot[kind], p, stage))
    g_shared = {k: jax.tree.map(lambda g, w, dim, sdim: buffers.reduce_stage(setup.reduce_data(g, dim), sdim).astype(w.dtype),
                                done.g_shared[k], params[k], layout.zero_dims[k], layout.stage_dims[k])
                for k in done.g_shared}
    return jax.lax.psum(done.loss, (*setup.data_axes, STAGE)), {**g_shared, "blocks": g_blocks}


class StageRun:
    """One stage's step as the tick loop sees it: its chunks' parameters, its microbatches, and
    the actions of a tick (`forward` = F, `backward` = B or I, `weight_grads` = W) as methods over
    them; `tick` is the `lax.scan` body over the table's rows, on a `Carry`.

    F saves what B needs: the residuals of each layer's `jax.vjp` (what the remat policy keeps),
    less the parameters among them (B takes those from the parameters themselves, so the stash
    holds activations only), in the layer's row of its stash slot; the embedding's residuals and
    the head's cotangent beside them. `residuals` (per stack kind, and "embed") is fixed by the
    abstract trace of F in `initial_carry`.
    With a split table the weight matmuls are not differentiated: they take taps, whose cotangents
    (input, output cotangent) I saves for W (`jaxpar.model.layers.split_backward`); where F
    stashes the inputs itself (`stashes_inputs`), the taps carry output cotangents only."""

    def __init__(self, setup: Setup, stage: jax.Array, params: dict, batch: jax.Array):
        s, layout, cfg = setup, setup.layout, setup.cfg
        self.s, self.stage = s, stage
        v = s.v
        # This stage's v chunks, [v, layers per chunk, ...] (the blocks arrive in pipeline order).
        blocks = jax.tree.map(lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]), params["blocks"])
        shared = {k: w for k, w in params.items() if k != "blocks"}
        # Unreduced inside the loop: blocks vary over `data`; shared parameters over `data` and
        # `stage` too (only the end stages use them); both are reduced once after the loop.
        # (ZeRO-3's shards, and what was gathered from them, vary over `data` already.)
        self.blocks = jax.tree.map(lambda w: vary(w, s.data_axes), blocks)
        self.shared = jax.tree.map(lambda w: vary(w, (*s.data_axes, STAGE)), shared)
        self.micro = microbatches.split(batch, s.m)
        b, seq = self.micro.shape[1], self.micro.shape[2] - 1
        self.act_shape = (b, seq // s.t if s.sp else seq, cfg.model.d_model)
        self.act_axes = (*s.data_axes, STAGE, *((MODEL,) if s.sp else ()))
        # What is differentiated: the parameters, or (ZeRO-2 per microbatch) the seeds of the
        # sharded ones, each handed to the model beside its parameter.
        is_dim = lambda x: x is None or isinstance(x, int)  # noqa: E731
        self.block_dims = layout.zero_dims["blocks"]
        self.shared_dims = {k: layout.zero_dims[k] for k in shared}
        self.block_mask = jax.tree.map(lambda dim: s.reduction.scatter and dim is not None, self.block_dims,
                                       is_leaf=is_dim)
        self.shared_mask = {k: jax.tree.map(lambda dim: s.reduction.scatter and dim is not None, layout.zero_dims[k],
                                            is_leaf=is_dim) for k in shared}
        # Block leaves as a flat dict keyed by their path (the split backward's taps are keyed so).
        one = jax.tree.map(lambda w: w[0], self.blocks)
        self.block_def = jax.tree.structure(one)
        self.paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(one)]
        # The layers of a chunk in each leaf's stack (a mixed model's dense and MoE stacks differ).
        self.chunk_layers = {k: w.shape[0] for k, w in self.flat(one).items()}
        self.dim_of = self.flat(jax.tree.map(lambda dim: -1 if dim is None else dim, self.block_dims, is_leaf=is_dim))
        self.block_mask_flat = self.flat(self.block_mask)
        self.acc_axes = {k: (*s.data_axes, *varying_axes(w)) for k, w in self.flat(one).items()}
        self.scatter_at_w = s.reduction.at_use  # W reduce-scatters a sharded weight's gradient
        # Per stack kind ("" for one kind of block; a mixed model's "dense" and "moe"): its leaves'
        # paths, its tree, its ZeRO dims counted in one layer's leaf (the stacked dim less one).
        self.kinds = block_kinds(s.chunk_cfg)
        self.kind_paths = {kind: [stack_prefix(kind) + jax.tree_util.keystr(k_)
                                  for k_, _ in jax.tree_util.tree_leaves_with_path(stack(one, kind))]
                           for kind in self.kinds}
        self.kind_def = {kind: jax.tree.structure(stack(one, kind)) for kind in self.kinds}
        self.layer_dims = {kind: jax.tree.map(lambda dim: None if dim is None else dim - 1, stack(self.block_dims, kind),
                                              is_leaf=is_dim) for kind in self.kinds}
        self.residuals, self.taps = {}, {}  # name -> (treedef, where): `stash_residuals`; the split's taps
        # With a table of I and W: F stashes each tapped matmul's input (once, beside the layer's
        # residuals; the matmul's pullback then keeps no copy) and W reads it there, so I neither
        # copies it nor writes it for W. `x_source`: tapped path -> (kind, stash leaf), set by F's
        # traces. (Where the layer body returns its inputs whole: `remat: none`, every slot
        # active; a checkpoint policy or a skipped slot keeps them inside, and I copies them.)
        self.x_source = {}
        self.stash_inputs = stashes_inputs(cfg.parallel.remat, setup.table.split,
                                           bool(setup.table.rows["b_valid"].any()), setup.slots.gather)
        self.layer_avals, self.end_avals, self.packing = {}, None, None  # set by `initial_carry`

    # -- trees and zeros ---------------------------------------------------------------------

    def flat(self, tree) -> dict:
        return dict(zip(self.paths, jax.tree.leaves(tree)))

    def unflat(self, d: dict):
        return jax.tree.unflatten(self.block_def, [d[k] for k in self.paths])

    def flat_kind(self, kind, tree) -> dict:
        return dict(zip(self.kind_paths[kind], jax.tree.leaves(tree)))

    def unflat_kind(self, kind, d: dict):
        return jax.tree.unflatten(self.kind_def[kind], [d[k] for k in self.kind_paths[kind]])

    def kind_taps(self) -> dict:
        """kind -> the zero taps of that stack's tapped weights, [n, ...] (`zero_taps`)."""
        taps = self.zero_taps()
        return {kind: {k_: taps[k_] for k_ in self.kind_paths[kind] if k_ in taps} for kind in self.kinds}

    def bodies(self, k):
        """kind -> one layer of chunk k (`jaxpar.model.transformer.block_bodies`), under the remat policy."""
        s = self.s
        blocks = model.bind(s.chunk_cfg, {"blocks": self.chunk_params(k)}).blocks
        return block_bodies(s.chunk_cfg, blocks, s.cfg.parallel.remat, self.active(k))[1]

    def zeros(self, shape, dtype=None, axes=None):
        """Zeros that vary over the manual axes their contents vary on (default: an activation's)."""
        dtype = self.s.cfg.model.dtype if dtype is None else dtype
        axes = self.act_axes if axes is None else axes
        return jax.lax.pcast(jnp.zeros(shape, dtype), axes, to="varying") if axes else jnp.zeros(shape, dtype)

    def zero_taps(self) -> dict:
        return {k: (None if self.stash_inputs else self.zeros((self.chunk_layers[k], *xs), xd, ax),
                    self.zeros((self.chunk_layers[k], *gs), gd, ax))
                for k, (xs, xd, gs, gd, ax, _) in self.taps.items()}

    def chunk_params(self, k):
        return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, k, 0, keepdims=False), self.blocks)

    def diff_blocks(self, full_bl):  # one chunk: [layers per chunk, ...]; its zero dim is the stacked one's
        return jax.tree.map(lambda w, dim, s: _seed(w, dim, self.s.d) if s else w, full_bl, self.block_dims,
                            self.block_mask)

    def diff_shared(self):
        return jax.tree.map(lambda w, dim, s: _seed(w, dim, self.s.d) if s else w, self.shared, self.shared_dims,
                            self.shared_mask)

    def handed_blocks(self, diff, full):
        """One chunk's blocks as `hand_out` receives them (`gradients.mark_for_use`)."""
        return mark_for_use(self.s.reduction, diff, full, self.block_dims)

    def handed_shared(self, diff):
        return mark_for_use(self.s.reduction, diff, self.shared, self.shared_dims)

    def ends(self, k):
        """Does this (stage, local chunk) hold the first / the last chunk of the model?"""
        return (self.stage == 0) & (k == 0), (self.stage == self.s.p - 1) & (k == self.s.v - 1)

    # -- the actions -------------------------------------------------------------------------

    def chunk_forward(self, blocks, shared, x_in, tokens, first, k):
        # (The taps' recording trace in `initial_carry`: the chunk as the unpipelined model runs it.)
        s = self.s
        x = jax.lax.cond(first, lambda: model.bind(s.chunk_cfg, shared).embed_tokens(tokens), lambda: x_in)
        return model.bind(s.chunk_cfg, {"blocks": blocks}).backbone(x, remat=s.cfg.parallel.remat,
                                                                    active=self.active(k))

    def active(self, k):
        """This (stage, local chunk)'s active layer slots per stack (None: every slot is)."""
        if not self.s.slots.gather:
            return None
        return {kind: jnp.asarray(a)[self.stage, k] for kind, a in self.s.slots.active.items()}

    def kind_stacks(self, k) -> dict:
        """kind -> (parameters, what is differentiated) of chunk k's layers of that stack, [n, ...]."""
        full_bl = self.chunk_params(k)
        diff_bl = self.diff_blocks(full_bl)
        return {kind: (stack(full_bl, kind), stack(diff_bl, kind)) for kind in self.kinds}

    def stash_residuals(self, name: str, pullback, known: list) -> tuple:
        """A pullback's residuals to stash: each is a parameter ("p", its index in `known`) or an
        activation ("s", its stash leaf), stashed once however many times the pullback refers to
        it (e.g. one layer input saved by the q, k and v matmuls). The structure, per `name`, is
        what B unflattens; every trace of F must find the same."""
        leaves, treedef = jax.tree.flatten(pullback)
        ids = {id(w): i for i, w in enumerate(known)}
        stashed, where = {}, []
        for r in leaves:
            if id(r) in ids:
                where.append(("p", ids[id(r)]))
            else:
                where.append(("s", stashed.setdefault(id(r), (len(stashed), r))[0]))
        where = tuple(where)
        if name in self.residuals and where != self.residuals[name][1]:
            raise AssertionError(f"the residuals of {name!r} differ between traces of F")
        self.residuals[name] = (treedef, where)
        return tuple(r for _, r in stashed.values())

    def stash_inputs_of(self, kind: str, saved: tuple, inputs: dict) -> tuple:
        """The tapped matmuls' inputs to stash beside a layer's residuals (`stash_inputs`: path ->
        x, each once however many matmuls share it, e.g. q, k and v), their leaves numbered after
        the residuals': `x_source`, path -> (kind, leaf). Every trace of F must find the same."""
        extra, where = {}, {}
        for path, x in sorted(inputs.items()):
            where[path] = (kind, len(saved) + extra.setdefault(id(x), (len(extra), x))[0])
        known = {path: w for path, w in self.x_source.items() if w[0] == kind}
        if known and known != where:
            raise AssertionError(f"the tapped inputs of {kind!r} differ between traces of F")
        self.x_source.update(where)
        return tuple(x for _, x in extra.values())

    def pullback(self, name: str, saved, known: list):
        """The pullback `stash_residuals` took apart, from the stashed leaves and the parameters."""
        treedef, where = self.residuals[name]
        return jax.tree.unflatten(treedef, [known[i] if kind == "p" else saved[i] for kind, i in where])

    def forward(self, x_in, mb, k, stash, slot, g_shared):
        """F: the chunk's output, run one layer at a time under `jax.vjp`, each layer's residuals
        written straight into row (slot, layer) of the stash (no stacked copy: DESIGN.md §5.3);
        on the first chunk the embedding, on the last the loss and its backward through the head
        (the chunk output's cotangent, stashed too, and the head's gradients, added to the float32
        `g_shared` inside the head's `cond`). `stash` None: a trace that records the residuals'
        types (`initial_carry`). Returns (y, stash, g_shared, loss)."""
        s = self.s
        first, last = self.ends(k)
        tokens, targets = self.micro[mb, :, :-1], self.micro[mb, :, 1:]
        sh = self.diff_shared()
        # Only the first chunk embeds (a cond, not a select: under tensor parallelism the lookup
        # ends in a collective, under ZeRO-3 the embedding's gather, that the other stages must
        # not pay for). The shared parameters are bound inside the branch for that reason.
        x, pull_embed = jax.vjp(lambda sh: jax.lax.cond(
            first, lambda: model.bind(s.chunk_cfg, self.handed_shared(sh)).embed_tokens(tokens), lambda: x_in), sh)
        embed_saved = self.stash_residuals("embed", pull_embed, buffers.param_leaves(self.shared, sh))
        split = s.table.split

        def layer(kind, xs, tap, i, carry):
            x, st = carry
            full_l, diff_l = xs
            diff = self.flat_kind(kind, diff_l)
            fixed = {p_: w for p_, w in diff.items() if p_ in self.taps}  # (split: the taps differentiate these)

            def f(rest, x, tap):
                handed = mark_for_use(s.reduction, self.unflat_kind(kind, {**fixed, **rest}), full_l,
                                      self.layer_dims[kind])
                # (With `stash_inputs` the body returns the tapped matmuls' inputs beside y: their
                # pullbacks do not keep them.)
                out = bodies[kind](x, (handed, tap, i))
                return out if self.stash_inputs else (out, {})

            y, pull, inputs = jax.vjp(f, {p_: w for p_, w in diff.items() if p_ not in fixed}, x, tap, has_aux=True)
            saved = self.stash_residuals(kind, pull, buffers.param_leaves(full_l, diff_l))
            if self.stash_inputs:
                saved = (*saved, *self.stash_inputs_of(kind, saved, inputs))
            if st is None:
                self.layer_avals[kind] = [jax.typeof(r) for r in saved]
                return (y, None), None
            return (y, {**st, kind: tuple(jax.lax.dynamic_update_slice(
                b, vary(r, varying_axes(b)).reshape(1, 1, -1).astype(b.dtype), (slot, i, 0))
                for b, r in zip(st[kind], saved))}), None

        # (Under a split table each weight matmul takes its tap from the layer's `linear`: the
        # bodies are built, and traced, inside the split context.)
        with split_backward({}, self.stash_inputs) if split else contextlib.nullcontext():
            bodies = self.bodies(k)
            (y, layers), _ = scan_layers(s.chunk_cfg, self.kind_stacks(k),
                                               (x, None if stash is None else stash["layers"]), layer,
                                               self.kind_taps() if split else None)

        # (The head's gradients are added inside its `cond`: the other chunks' F fills no
        # vocabulary-sized zeros.)
        def head(g):
            loss, pull = jax.vjp(lambda sh, y: s.loss_sum(
                model.bind(s.chunk_cfg, self.handed_shared(sh)).head(y), targets) / s.n_tokens,
                sh, y)
            dsh, dy = pull(jnp.ones_like(loss))
            return loss, microbatches.add_f32(g, dsh), dy

        def no_head(g):
            return self.zeros((), jnp.float32, (*s.data_axes, STAGE)), g, zeros_like_varying(y)

        loss, g_shared, dy = jax.lax.cond(last, head, no_head, g_shared)
        ends = (*embed_saved, dy)
        if stash is None:
            self.end_avals = [jax.typeof(r) for r in ends]
            return y, None, g_shared, loss
        ends = tuple(buffers.set_row(b, vary(r, varying_axes(b)).reshape(-1), slot) for b, r in zip(stash["ends"], ends))
        return y, {"ends": ends, "layers": layers}, g_shared, loss

    def backward(self, stash, slot, cot, k, g_shared):
        """B, or I with a split table: the chunk's gradients from what F saved (no second
        forward), one layer at a time, last to first, each layer's residuals read from row (slot,
        layer) of the stash: (parameter gradients but the tapped weights', [n, ...] per path;
        `g_shared` plus the embedding's on the first chunk; the input's; the taps', (x, g) [n, ...]
        per tapped path). (I writes its
        pairs for W into the slot after this loop, `buffers.write_now`: written inside it, over the
        rows the loop reads, they made XLA copy every stash buffer per layer, measured.)"""
        s = self.s
        first, last = self.ends(k)
        *embed_saved, dy = (buffers.row(b, slot).reshape(a.shape) for b, a in zip(stash["ends"], self.end_avals))

        def layer(kind, xs, _, i, g):
            full_l, diff_l = xs
            saved = [jax.lax.dynamic_slice(b, (slot, i, 0), (1, 1, b.shape[2])).reshape(a.shape)
                     for b, a in zip(stash["layers"][kind], self.layer_avals[kind])]
            d_rest, dx, d_tap = self.pullback(kind, saved, buffers.param_leaves(full_l, diff_l))(g)
            return dx, (d_rest, d_tap)

        dx, outs = scan_layers(s.chunk_cfg, self.kind_stacks(k), jnp.where(last, dy, cot), layer, reverse=True)
        d_rest = {p_: g for kind in self.kinds for p_, g in outs[kind][0].items()}
        d_taps = {p_: xg for kind in self.kinds for p_, xg in (outs[kind][1] or {}).items()}
        sh = self.diff_shared()
        # The embedding's gradient: the first chunk's only (a cond: the others skip its pullback
        # and fill no vocabulary-sized zeros).
        g_shared = jax.lax.cond(first, lambda g: microbatches.add_f32(
            g, self.pullback("embed", embed_saved, buffers.param_leaves(self.shared, sh))(dx)[0]), lambda g: g, g_shared)
        return d_rest, g_shared, dx, d_taps

    def stashed_input(self, stash, slot, path):
        """W's input x of a tapped matmul, [layers, tokens, in], read from the leaf F stashed it in, in `slot`."""
        kind, j = self.x_source[path]
        buf = stash["layers"][kind][j]
        xs, _, _, _, axes, _ = self.taps[path]
        x = jax.lax.dynamic_slice(buf, (slot, 0, 0), (1, *buf.shape[1:])).reshape(buf.shape[1], *xs)
        return vary(x, axes)

    def weight_grads(self, d_taps):
        """W: each tapped weight's gradient x^T g, reduce-scattered where ZeRO reduces per
        microbatch (float32, as the reduction at use would)."""
        s = self.s
        out = {}
        for k_, (x2, g2) in d_taps.items():
            dw = weight_gradient(x2, g2).reshape(self.chunk_layers[k_], *self.taps[k_][5]).astype(jnp.float32)
            # A weight the matmul made varying (e.g. kv heads replicated over `model` under
            # tensor parallelism): summed over those axes, as the cast's transpose would.
            extra = tuple(a for a in varying_axes(dw) if a not in self.acc_axes[k_])
            if extra:
                dw = jax.lax.psum(dw, extra)
            if (self.scatter_at_w and s.dp and self.dim_of[k_] >= 0
                    and (s.gather == "use" or self.block_mask_flat[k_])):
                dw = jax.lax.psum_scatter(dw, DATA, scatter_dimension=self.dim_of[k_], tiled=True)
            out[k_] = dw
        return out

    @staticmethod
    def add(acc, grads, k):
        # (A dynamic-update-slice of the chunk's row, not `.at[k].add`: XLA lowers that scatter
        # to a select over the whole row, reading it twice.)
        return {**acc, **{k_: buffers.set_row(acc[k_], buffers.row(acc[k_], k) + g.astype(jnp.float32), k)
                          for k_, g in grads.items()}}

    # -- the loop ----------------------------------------------------------------------------

    def initial_carry(self, rows) -> Carry:
        """The taps' and the stash's shapes, from abstract traces of the chunk and of F, and the
        loop's first carry: empty buffers and stash, zero float32 accumulators."""
        s = self.s
        taps, table = self.taps, s.table
        z = rows["f_mb"][0][self.stage] * 0  # an index that varies over `stage` as the tick's do
        if table.split:  # the taps' shapes, from a recording trace of the chunk
            with split_backward(None) as rec:
                full_bl = self.chunk_params(z)

                def chunk(x):
                    return self.chunk_forward(self.handed_blocks(self.diff_blocks(full_bl), full_bl),
                                              self.handed_shared(self.diff_shared()), x, self.micro[z, :, :-1],
                                              z > 0, z)
                jax.make_jaxpr(chunk)(self.zeros(self.act_shape))
            for k_, (xs, xd, gs, gd, ax, ws) in rec.shapes.items():
                taps[k_] = (xs, xd, gs, gd, tuple(sorted({*ax, *s.data_axes, STAGE})), ws)
        # The stash's leaves: types from an abstract trace of F (`layer_avals`, `end_avals`).
        jax.make_jaxpr(lambda x: self.forward(x, z, z, None, z, microbatches.f32_zeros(self.diff_shared()))[0])(
            self.zeros(self.act_shape))
        # (A stash slot varies over `stage`, whatever its value does: the tables differ per stage.)
        # A layer's leaf is stored [slots, layers of its stack, size], the embedding's residuals
        # and the head's cotangent [slots, size] (I writes W's inputs into a slot by offset; a
        # reshaped view of the loop's carry there made XLA copy the whole buffer).
        axes = lambda a: tuple(sorted({*aval_varying_axes(a), *s.data_axes, STAGE}))  # noqa: E731
        n_layers = {kind: self.chunk_layers[self.kind_paths[kind][0]] for kind in self.kinds}
        stash = {"ends": tuple(self.zeros((table.stash, a.size), a.dtype, axes(a)) for a in self.end_avals),
                 "layers": {kind: tuple(self.zeros((table.stash, n_layers[kind], a.size), a.dtype, axes(a))
                                        for a in self.layer_avals[kind]) for kind in self.kinds}}
        # What I keeps for W (each tapped matmul's input and output cotangent, per layer) goes
        # into its stash slot, over residuals of the same layer that I has consumed; the wstash
        # holds what does not fit.
        # (Not the inputs W reads where F stashed them, `x_source`: those residual leaves stay.)
        items = {(k_, j): (shape, dtype, ax)
                 for k_, (xs, xd, gs, gd, ax, _) in taps.items()
                 for j, (shape, dtype) in enumerate(((xs, xd), (gs, gd)))
                 if not (j == 0 and k_ in self.x_source)}
        kept = set(self.x_source.values())
        self.packing = {}
        for kind in self.kinds:
            bufs = stash["layers"][kind]
            packed = buffers.pack({key: it for key, it in items.items() if key[0] in self.kind_paths[kind]},
                           [((0,) if (kind, j) in kept else b.shape[2:], b.dtype, varying_axes(b))
                            for j, b in enumerate(bufs)])
            self.packing.update({key: (kind, *where) for key, where in packed.items()})
        wstash = {key: self.zeros((table.wstash, self.chunk_layers[key[0]], *items[key][0]), items[key][1],
                                  items[key][2])
                  for key in items if key not in self.packing}
        g_blocks = self.flat(microbatches.f32_zeros(
            jax.tree.map(lambda w, dim, m: _seed(w, dim + 1, s.d) if m else w, self.blocks, self.block_dims,
                         self.block_mask)))
        return Carry(self.zeros((table.fwd_slots, *self.act_shape)), self.zeros((table.bwd_slots, *self.act_shape)),
                     stash, wstash, g_blocks, microbatches.f32_zeros(self.diff_shared()),
                     self.zeros((), jnp.float32, (*s.data_axes, STAGE)))

    def tick(self, carry: Carry, row):
        """One tick of the table on this stage: B or I, then W, then F (as the row says; F last,
        so that its residuals go into its stash slot inside its own cond, DESIGN.md §5.3), one
        hop each way, and the arrivals into their buffer slots."""
        s, stage, taps, table = self.s, self.stage, self.taps, self.s.table
        packing = self.packing
        fwd_buf, bwd_buf, stash, wstash, g_blocks, g_shared, loss_acc = carry
        fv, fmb, fk = row["f_valid"][stage], row["f_mb"][stage], row["f_chunk"][stage]
        bv, iv, wv = row["b_valid"][stage], row["i_valid"][stage], row["w_valid"][stage]
        bk = row["b_chunk"][stage] + row["i_chunk"][stage]  # at most one of B and I per tick
        # Each action reads its input row (F's activation, B's or I's cotangent) inside its own
        # cond, so an idle tick copies none; it sends `idle()`, which no receiver writes.
        def idle():  # zeros (NaN with `poison_idle`)
            z = self.zeros(self.act_shape)
            return z + jnp.nan if s.poison_idle else z

        # The gradients accumulate inside the action's cond: an idle tick neither fills zeros
        # nor adds them to the float32 accumulators. I writes W's pairs into its stash slot
        # inside the same cond (a tick without I fills no taps' worth of zeros), unless the
        # split table also holds fused Bs, whose W runs at once from the pairs (below).
        split_i = table.split and not table.rows["b_valid"].any()

        def run_b(acc, bufs, g_shared):
            # (The stash slot is read in here, layer by layer, not before the cond: a slice of
            # every residual leaf, megabytes, copied on every tick would cost more than the
            # matmuls of an idle tick.)
            cot = buffers.row(bwd_buf, row["b_in"][stage] + row["i_in"][stage])
            d_rest, g_shared, dx, d_taps = self.backward(bufs[0], row["b_stash"][stage] + row["i_stash"][stage], cot,
                                                         bk, g_shared)
            d_taps = {k_: tuple(None if a is None else vary(a, taps[k_][4]) for a in xg)
                      for k_, xg in (d_taps or {}).items()}
            if split_i:
                new = {(k_, j): a for k_, xg in d_taps.items() for j, a in enumerate(xg) if a is not None}
                bufs = buffers.write_now(bufs, packing, new, row["i_stash"][stage], row["i_wstash"][stage], buffers.after(dx))
                d_taps = {}
            return self.add(acc, d_rest, bk), g_shared, dx, d_taps, bufs if split_i else ()

        def no_b(acc, bufs, g_shared):
            return (acc, g_shared, idle(), {} if split_i else self.zero_taps(),
                    bufs if split_i else ())

        acc_rest, g_shared, dx, d_taps, bufs = jax.lax.cond(
            bv + iv > 0, run_b, no_b, {k_: a for k_, a in g_blocks.items() if k_ not in taps},
            (stash, wstash if split_i else {}), g_shared)
        if split_i:
            stash, wstash = bufs
        g_blocks = {**g_blocks, **acc_rest}
        dw = {}
        if table.split:
            # W: of this tick's fused B (a split table may hold some), and of an earlier I from
            # what it wrote into its stash slot (and the wstash: what did not fit there).
            zero_w = lambda: {k_: zeros_like_varying(g_blocks[k_][0]) for k_ in taps}  # noqa: E731
            if table.rows["b_valid"].any():
                g_blocks = self.add(g_blocks, jax.lax.cond(bv > 0, lambda: self.weight_grads(d_taps), zero_w), bk)
            def run_w(acc, bufs):  # (read and accumulated inside the cond: idle ticks touch neither)
                got = buffers.read_items(*bufs, packing, row["w_stash"][stage], row["w_wstash"][stage])
                got.update({(k_, 0): self.stashed_input(bufs[0], row["w_stash"][stage], k_) for k_ in self.x_source})
                return self.add(acc, self.weight_grads({k_: (got[(k_, 0)], got[(k_, 1)]) for k_ in taps}),
                                row["w_chunk"][stage])

            dw = jax.lax.cond(wv > 0, run_w, lambda acc, bufs: acc, {k_: g_blocks[k_] for k_ in taps},
                              (stash, wstash))
            g_blocks = {**g_blocks, **dw}
        # Every write of the stash and wstash after every read of them has been consumed (else
        # XLA keeps a copy of the whole buffer): I's outputs for W into its own slot, over the
        # residuals it has consumed (and the wstash), then F's residuals into its slot.
        after = buffers.after(dx, *dw.values())
        if table.split and not split_i:
            new = {(k_, j): a for k_, xg in d_taps.items() for j, a in enumerate(xg)}
            stash, wstash = buffers.write_items(stash, wstash, packing, new, iv > 0, row["i_stash"][stage],
                                         row["i_wstash"][stage], after)
        # F last, its residuals written into its slot inside its own cond: a tick without F
        # neither fills a slot's worth of zeros nor writes (B has read its slot above: a slot B
        # frees may be the one F fills in the same tick). The residuals' structure B unflattens
        # was fixed by `initial_carry`'s trace of F.
        # F's input waits for B's and W's results (`buffers.after`): its cond runs after theirs.
        def run_f(stash, g_shared):
            x_f = after(buffers.row(fwd_buf, row["f_in"][stage]))
            return self.forward(x_f, fmb, fk, stash, row["f_stash"][stage], g_shared)

        # (Only the first chunk's B, the embedding, and the last chunk's F, the head, add to the
        # shared leaves' vocabulary-sized float32 accumulators, inside their own conds.)
        y, stash, g_shared, loss = jax.lax.cond(
            fv > 0, run_f,
            lambda stash, g_shared: (idle(), stash, g_shared,
                                     self.zeros((), jnp.float32, (*s.data_axes, STAGE))),
            stash, g_shared)
        # One hop per tick: activations to the next stage, gradients to the previous one; the
        # table says which slot each arrival lands in (-1: nothing arrives).
        recv_f = jax.lax.ppermute(y, STAGE, s.fwd_pairs)
        recv_b = jax.lax.ppermute(dx, STAGE, s.bwd_pairs)
        # (Under a cond, not a select with the row's old contents: a tick where nothing arrives
        # neither reads nor writes the buffer.)
        rf, rb = row["f_recv"][stage], row["b_recv"][stage]
        fwd_buf = jax.lax.cond(rf >= 0, lambda b: buffers.set_row(b, recv_f, rf), lambda b: b, fwd_buf)
        bwd_buf = jax.lax.cond(rb >= 0, lambda b: buffers.set_row(b, recv_b, rb), lambda b: b, bwd_buf)
        return Carry(fwd_buf, bwd_buf, stash, wstash, g_blocks, g_shared, loss_acc + loss), None
