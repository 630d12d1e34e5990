"""The pipeline's step (`make_pipeline_loss_and_grads`): a shard_map manual over `stage` (and over
`data` and `model` where they have more than one shard) around one stage's step (`stage_step`):
its parameters made ready (layer slots, gathers), its plan (`plan.make_plan`), the tick loop over
the table (`tick.tick`), and the one reduction after it.

Layers are cut into p contiguous chunks (stage s holds layers [s·L/p, (s+1)·L/p): a reshape of the
canonical `[layers, ...]` parameters, whose `layers` dim the storage rules already place on
`stage`). Uneven stages and a mixed model's dense first layers run as layer slots
(`jaxpar.parallel.stages`): the stacks are then stored with `stage` on another dim, one all-to-all
hands each stage its slots (`stash.to_slots`) and an unfilled slot is skipped.

Gradients stay unreduced over `data` inside the tick loop and are reduced once after it
(DESIGN.md decision 5): all-reduced (ZeRO-0/1) or reduce-scattered (ZeRO-2), `Setup.reduce_data`;
the parameters shared by the end stages (embeddings, final norm, head) are summed over `stage`
after the loop too.

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

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.config import Config
from jaxpar.parallel.gradients import gather_for_step, hand_out, manual_region
from jaxpar.parallel.pipeline.plan import make_plan, stage_inputs
from jaxpar.model.transformer import layer_order
from jaxpar.parallel.pipeline.setup import DATA, MODEL, STAGE, Setup, make_setup
from jaxpar.parallel.pipeline.stash import by_kind, from_slots, gather_stage, reduce_stage, reorder, to_slots, v_chunks
from jaxpar.parallel.pipeline.table import Table
from jaxpar.parallel.pipeline.tick import initial_carry, tick
from jaxpar.parallel.zero import Layout
from jaxpar.sharding import activation_rules


def make_pipeline_loss_and_grads(cfg: Config, mesh: Mesh, layout: Layout, table: Table,
                                 loss_sum: Callable, *, poison_idle: bool = False, eos: int | None = None) -> Callable:
    """`(params, batch) -> (loss, grads)` of the global batch through the pipeline.

    `loss_sum(logits, targets)` is the summed token loss of a microbatch; it is divided once by
    the global token count. With `poison_idle`, what a stage sends on a tick without F (or
    without B and I) is NaN: a test that an idle tick's send never lands in a buffer, so bubbles
    never leak into gradients (every action reads its input row and stash slot inside its own
    cond, so an idle tick reads neither). With `eos` (`data.document_mask`), every F runs its
    microbatch's packed documents on their own (`jaxpar.model.layers.packed`).
    """
    setup = make_setup(cfg, mesh, layout, table, loss_sum, poison_idle, eos)
    v, p, dp = setup.v, setup.p, setup.dp
    manual, rules, tp = manual_region(cfg, mesh, STAGE)

    def local(params, batch):
        return stage_step(setup, mesh, rules, tp, params, batch)

    batch_spec = P(DATA) if dp else P()
    in_specs, out_specs = layout.manual_specs("params", manual), layout.manual_specs("grads", manual)
    # (train.qk_clip: the loss comes with the maxima [layers + mtp_depth, N], each model rank's own
    # heads in rank order, as `jaxpar.parallel.gradients.make_loss_and_grads` returns them.)
    loss_spec = (P(), P(None, MODEL) if MODEL in manual else P()) if setup.clipping else P()
    run = jax.shard_map(local, mesh=mesh, in_specs=(in_specs, batch_spec), out_specs=(loss_spec, out_specs),
                        axis_names=manual)
    if v == 1 or setup.slots.gather or table.placement == "v":  # (V: `v_chunks`, inside `stage_step`)
        return run
    # Stage s runs its interleaved chunks s, s + p, ..., s + (v-1)p: the canonical [layers, ...]
    # reordered so that each stage's contiguous slice holds them (as a transpose, [v, p] -> [p, v]:
    # GSPMD's all-to-all over `stage` of the block parameters every step, and of their gradients
    # back). Storage, and so checkpoints, stay in model order.
    to_stages, from_stages = (lambda w: reorder(w, v, p)), (lambda g: reorder(g, p, v))

    def staged(params, batch):
        loss, grads = run({**params, "blocks": jax.tree.map(to_stages, params["blocks"])}, batch)
        return loss, {**grads, "blocks": jax.tree.map(from_stages, grads["blocks"])}

    return staged


def stage_step(setup: Setup, mesh: Mesh, rules, tp, params, batch):
    """One stage's whole step inside the shard_map: its parameters made ready (layer slots,
    gathers), its plan, the tick loop over the table (`tick.tick`), and the one reduction after it."""
    layout, p, gather = setup.layout, setup.p, setup.gather
    stage = jax.lax.axis_index(STAGE)
    slots = setup.slots
    v_placed = setup.table.placement == "v" and not slots.gather
    if v_placed:  # stored in model order: this stage's V chunks, s and 2p-1-s (`stash.v_chunks`)
        params = {**params, "blocks": jax.tree.map(lambda w: v_chunks(w, p, stage), params["blocks"])}
    if slots.gather:  # this stage's chunks' layer slots, from the stacks stored over `stage` otherwise
        params = {**params, "blocks": by_kind(slots, params["blocks"], layout.stage_dims["blocks"],
                                              lambda w, kind, sd: to_slots(w, sd, slots.slots[kind], p, stage))}
    # The shared leaves (embeddings, final norm, head) are stored sharded over `stage` where
    # they are large (`Layout.stage_dims`): gathered here, for the step.
    params = {k: w if k == "blocks" else jax.tree.map(gather_stage, w, layout.stage_dims[k],
                                                         is_leaf=lambda x: x is None or isinstance(x, int))
              for k, w in params.items()}
    param_fn = hand_out(fp8_gathers=setup.cfg.model.fp8) if setup.reduction.at_use else None  # (ZeRO-3 gathers or ZeRO-2 scatters at use)
    if gather == "step":  # every sharded leaf once per step, kept for the step
        params = gather_for_step(setup.cfg, params, layout.zero_dims)
    st = stage_inputs(setup, stage, params, batch)
    rows = {k: jnp.asarray(a) for k, a in setup.table.rows.items()}
    cfg = setup.cfg
    with activation_rules(mesh, rules, param_fn=param_fn, tp=tp, compute_dtype=cfg.model.dtype):
        plan = make_plan(setup, st, rows)  # (its traces run the model as the tick will: inside the rules)
        done, _ = jax.lax.scan(functools.partial(tick, plan, st), initial_carry(plan, st), rows)
    g_blocks = plan.unflat(done.g_blocks)
    # The one reduction per step, after the tick loop.
    # (An expert-parallel leaf's gradient is complete on its data rank: not reduced.)
    g_blocks = jax.tree.map(lambda g, w, dim, e: (g.reshape(-1, *g.shape[2:]) if e else
                                                  setup.reduce_data(g.reshape(-1, *g.shape[2:]), dim)).astype(w.dtype),
                            g_blocks, params["blocks"], layout.zero_dims["blocks"], layout.experts["blocks"],
                            is_leaf=lambda x: x is None or isinstance(x, int))
    if v_placed:  # back to model order, after their reduction over `data` (ZeRO-2/3: shards)
        g_blocks = jax.tree.map(lambda g: v_chunks(g, p, stage, back=True), g_blocks)
    if slots.gather:  # back from the slots to the stacks' storage (a padding slot's gradient dropped)
        g_blocks = by_kind(slots, g_blocks, layout.stage_dims["blocks"],
                           lambda g, kind, sd: from_slots(g, sd, slots.layer_slot[kind], p, stage))
    # (Shared leaves with experts: the MTP modules' MoE block, `jaxpar.model.mtp`; complete per data
    # rank as the blocks' experts are.)
    # (`Table.overlap`: F's own accumulator of the shared leaves' gradients, added in here.)
    g_done = jax.tree.map(jnp.add, done.g_shared, done.g_head) if done.g_head else done.g_shared
    g_shared = {k: jax.tree.map(lambda g, w, dim, sdim, e: reduce_stage(g if e else setup.reduce_data(g, dim),
                                                                        sdim).astype(w.dtype),
                                g_done[k], params[k], layout.zero_dims[k], layout.stage_dims[k],
                                layout.experts[k], is_leaf=lambda x: x is None or isinstance(x, int))
                for k in done.g_shared}
    loss = jax.lax.psum(done.loss, (*setup.data_axes, STAGE))
    if setup.clipping:
        loss = (loss, jax.lax.pmax(layer_maxima(setup, done.maxima, stage), (*setup.data_axes, STAGE)))
    return loss, {**g_shared, "blocks": g_blocks}


def layer_maxima(setup: Setup, maxima: dict, stage: jax.Array) -> jax.Array:
    """train.qk_clip: this stage's largest logits (the tick loop's `Carry.maxima`: per chunk and
    layer slot, and the MTP blocks') placed at their model layers, [layers + mtp_depth, N], -inf
    for the layers other stages hold (the step takes the max over `stage` and `data`)."""
    m, slots = setup.cfg.model, setup.slots
    L = m.n_layers
    order = layer_order(m)
    n = next(iter(maxima.values())).shape[-1]
    top = jnp.full((L + m.mtp_depth, n), -jnp.inf, jnp.float32)
    for kind, width in slots.width.items():
        # The model layer of each (stage, local chunk, slot); L (out of range: dropped) where inactive.
        where = np.where(slots.active[kind], order[kind][slots.slots[kind].reshape(slots.p, slots.v, width)], L)
        top = top.at[jnp.asarray(where)[stage].reshape(-1)].max(maxima[kind].reshape(-1, n), mode="drop")
    if m.mtp_depth:
        top = top.at[L:].max(maxima["mtp"])
    return top
