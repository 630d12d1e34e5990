"""Pipeline parallelism over `stage`: one executor that runs any valid schedule table.

Layers are cut into p contiguous chunks (stage s holds layers [s·L/p, (s+1)·L/p): a reshape of
the canonical `[layers, ...]` parameters, whose `layers` dim the storage rules already place on
`stage`). The executor is a `lax.scan` over the table's ticks inside one shard_map manual over
`stage` (and over `data` and `model` where they have more than one shard). In each tick every
stage looks up its actions: F runs its chunk forward on a received activation (the first stage
embeds the microbatch's tokens) and stashes the chunk input; B recomputes the chunk from the
stash under `jax.vjp` (the last stage adds the head and the loss) and accumulates its parameter
gradients in float32. One forward and one backward `ppermute` per tick move activations and
their gradients to the neighbouring stages; received messages wait in small buffers until their
action's tick. Buffers and stash have the sizes the table declares, so a 1F1B table keeps
O(p) microbatches of activations whatever m is.

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

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar import model
from jaxpar.config import Config
from jaxpar.parallel.zero import Layout
from jaxpar.parallel.gradients import _seed, gather_at_use, hand_out, manual_region
from jaxpar.sharding import Handout, activation_rules, vary, zeros_like_varying

DATA, STAGE, MODEL = "data", "stage", "model"


@dataclasses.dataclass(frozen=True)
class Table:
    """A schedule as the executor consumes it: int32 arrays [ticks, p] and buffer sizes."""

    f_valid: np.ndarray
    f_mb: np.ndarray
    f_chunk: np.ndarray  # the stage's local chunk index (global chunk = local * p + stage)
    b_valid: np.ndarray
    b_mb: np.ndarray
    b_chunk: np.ndarray
    chunks: int     # v: chunks per stage
    stash: int      # stash slots per chunk (peak stashed microbatches over stages)
    fwd_slots: int  # received activations waiting for their F, per chunk
    bwd_slots: int  # received gradients waiting for their B, per chunk

    @property
    def ticks(self) -> int:
        return self.f_valid.shape[0]


def table_of(schedule) -> Table:
    """The executor's view of a `jaxpar.parallel.schedules.Schedule`."""
    a = schedule.to_arrays()
    buffered = schedule.peak_buffered()
    return Table(f_valid=a["f_valid"], f_mb=a["f_mb"], f_chunk=a["f_chunk"], b_valid=a["b_valid"], b_mb=a["b_mb"],
                 b_chunk=a["b_chunk"], chunks=schedule.virtual_stages,
                 stash=max(1, max(schedule.declared_stash or schedule.peak_stash())),
                 fwd_slots=max(1, max(f for f, _ in buffered)), bwd_slots=max(1, max(b for _, b in buffered)))


def make_pipeline_loss_and_grads(cfg: Config, mesh: Mesh, layout: Layout, table: Table,
                                 loss_sum: Callable, *, poison_idle: bool = False) -> Callable:
    """`(params, batch) -> (loss, grads)` of the global batch through the pipeline.

    `loss_sum(logits, targets)` is the summed token loss of a microbatch; it is divided once by
    the global token count. With `poison_idle`, the inputs of idle slots are NaN (a test that
    bubbles never leak into gradients).
    """
    p, t = mesh.shape[STAGE], mesh.shape[MODEL]
    v = table.chunks
    dp = mesh.shape[DATA] > 1
    m, L = cfg.parallel.microbatches, cfg.model.n_layers
    counts = cfg.parallel.stage_layers
    uneven = counts is not None and len(set(counts)) > 1
    # Uneven stages hold max(counts) layer slots each; the slots past a stage's count are padding
    # that passes activations through (`n_active`) and receives no gradient.
    chunk_cfg = dataclasses.replace(cfg.model, n_layers=max(counts) if uneven else L // (p * v))
    model.param_names(chunk_cfg)  # build (and cache) the chunk model's abstract state outside any mesh context
    n_tokens = cfg.train.global_batch * cfg.model.seq_len
    sp = cfg.parallel.sequence_parallel and t > 1
    manual, rules, tp = manual_region(cfg, mesh, STAGE)
    remat = cfg.parallel.remat
    data_axes = (DATA,) if dp else ()
    zero = layout.zero if dp else 0  # on one data shard nothing is sharded
    gather = cfg.parallel.zero3_gather if zero == 3 else None
    # ZeRO-2, per microbatch: every B reduce-scatters its sharded gradients where they arise (a
    # seed per leaf, `jaxpar.parallel.gradients.Handout`), and the accumulator holds shards only.
    scatter_mb = zero == 2 and cfg.parallel.zero2_reduce == "microbatch"
    d = mesh.shape[DATA]
    names = model.param_names(cfg.model)
    # Interleaved chunks travel round the ring (the last stage's chunk k feeds stage 0's chunk k+1).
    fwd_pairs = [(i, (i + 1) % p) for i in range(p if v > 1 else p - 1)]
    bwd_pairs = [((i + 1) % p, i) for i in range(p if v > 1 else p - 1)]

    def chunk_forward(blocks, shared, x_in, tokens, first):
        # Only the first chunk embeds (a cond, not a select: under tensor parallelism the lookup
        # ends in a collective, under ZeRO-3 the embedding's gather, that the other stages must
        # not pay for). The shared parameters are bound inside the branch for that reason.
        x = jax.lax.cond(first, lambda: model.bind(chunk_cfg, shared).embed_tokens(tokens), lambda: x_in)
        n_active = jnp.asarray(counts)[jax.lax.axis_index(STAGE)] if uneven else None
        return model.bind(chunk_cfg, {"blocks": blocks}).backbone(x, remat=remat, n_active=n_active)

    def chunk_loss(blocks, shared, x_in, tokens, targets, first):
        y = chunk_forward(blocks, shared, x_in, tokens, first)
        return loss_sum(model.bind(chunk_cfg, shared).head(y), targets) / n_tokens

    def reduce_data(g, dim):
        """The data-axis reduction after the loop of one gradient whose ZeRO dim is `dim`."""
        if not dp:
            return g
        if dim is None or zero < 1:
            return jax.lax.psum(g, DATA)
        if gather == "microbatch" or scatter_mb:
            return g  # reduce-scattered per microbatch, where its gather (or its seed) was transposed
        return jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)

    def local(params, batch):
        stage = jax.lax.axis_index(STAGE)
        param_fn = (_gather_at_use(params, names, layout.zero_dims) if gather == "microbatch"
                    else hand_out(layout) if scatter_mb else None)
        if gather == "step":  # every sharded leaf once per step, kept for the step
            params = jax.tree.map(_gather, params, layout.zero_dims)
        # This stage's v chunks, [v, layers per chunk, ...] (the blocks arrive in pipeline order).
        blocks = jax.tree.map(lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]), params["blocks"])
        shared = {k: w for k, w in params.items() if k != "blocks"}
        # Unreduced inside the loop: blocks vary over `data`; shared parameters over `data` and
        # `stage` too (only the end stages use them); both are reduced once after the loop.
        # (ZeRO-3's shards, and what was gathered from them, vary over `data` already.)
        blocks = jax.tree.map(lambda w: vary(w, data_axes), blocks)
        shared = jax.tree.map(lambda w: vary(w, (*data_axes, STAGE)), shared)
        micro = batch.reshape(m, batch.shape[0] // m, *batch.shape[1:])
        b, seq = micro.shape[1], micro.shape[2] - 1
        act_shape = (b, seq // t if sp else seq, cfg.model.d_model)
        act_axes = (*data_axes, STAGE, *((MODEL,) if sp else ()))

        def zeros(shape):  # a buffer that varies over the manual axes its contents vary on
            return jax.lax.pcast(jnp.zeros(shape, cfg.model.dtype), act_axes, to="varying")

        def chunk_params(k):
            return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, k, 0, keepdims=False), blocks)

        # What B differentiates: the parameters, or (ZeRO-2 per microbatch) the seeds of the
        # sharded ones, each handed to the model beside its parameter.
        block_mask = jax.tree.map(lambda dim: scatter_mb and dim is not None, layout.zero_dims["blocks"],
                                  is_leaf=lambda x: x is None or isinstance(x, int))
        shared_mask = {k: jax.tree.map(lambda dim: scatter_mb and dim is not None, layout.zero_dims[k],
                                       is_leaf=lambda x: x is None or isinstance(x, int)) for k in shared}
        block_dims = layout.zero_dims["blocks"]
        shared_dims = {k: layout.zero_dims[k] for k in shared}

        def diff_blocks(k):  # one chunk: [layers per chunk, ...]; its zero dim is the stacked one's
            return jax.tree.map(lambda w, dim, s: _seed(w, dim, d) if s else w, chunk_params(k), block_dims,
                                block_mask)

        def diff_shared():
            return jax.tree.map(lambda w, dim, s: _seed(w, dim, d) if s else w, shared, shared_dims, shared_mask)

        def handed(diff, full, mask):
            return jax.tree.map(lambda dd, w, s: Handout(w, dd) if s else dd, diff, full, mask)

        def ends(k):  # does this (stage, local chunk) hold the first / the last chunk of the model?
            return (stage == 0) & (k == 0), (stage == p - 1) & (k == v - 1)

        def forward(x_in, mb, k):
            return chunk_forward(chunk_params(k), shared, x_in, micro[mb, :, :-1], ends(k)[0])

        def backward(x_in, cot, mb, k, no_loss):
            tokens, targets = micro[mb, :, :-1], micro[mb, :, 1:]
            first, last = ends(k)

            full_bl = chunk_params(k)

            def at_last():
                loss, vjp = jax.vjp(lambda bl, sh, x: chunk_loss(handed(bl, full_bl, block_mask),
                                                                 handed(sh, shared, shared_mask), x, tokens, targets,
                                                                 first),
                                    diff_blocks(k), diff_shared(), x_in)
                return (*vjp(jnp.ones_like(loss)), loss)

            def inside():
                _, vjp = jax.vjp(lambda bl, sh, x: chunk_forward(handed(bl, full_bl, block_mask),
                                                                 handed(sh, shared, shared_mask), x, tokens, first),
                                 diff_blocks(k), diff_shared(), x_in)
                return (*vjp(cot), no_loss)

            return jax.lax.cond(last, at_last, inside)

        def tick(carry, row):
            fwd_buf, bwd_buf, stash, g_blocks, g_shared, loss_acc = carry
            fv, fmb, fk = row["f_valid"][stage], row["f_mb"][stage], row["f_chunk"][stage]
            bv, bmb, bk = row["b_valid"][stage], row["b_mb"][stage], row["b_chunk"][stage]
            # B first: it reads its stash slot before this tick's F may reuse it.
            x_b = stash[bk * table.stash + bmb % table.stash]
            cot = bwd_buf[bk * table.bwd_slots + bmb % table.bwd_slots]
            f_slot = fk * table.fwd_slots + fmb % table.fwd_slots
            x_f = fwd_buf[f_slot]
            if poison_idle:
                x_b = jnp.where(bv > 0, x_b, jnp.nan)
                x_f = jnp.where(fv > 0, x_f, jnp.nan)
            no_loss = zeros_like_varying(loss_acc)
            dbl, dsh, dx, loss = jax.lax.cond(
                bv > 0, lambda: backward(x_b, cot, bmb, bk, no_loss),
                lambda: (jax.tree.map(zeros_like_varying, diff_blocks(bk)), jax.tree.map(zeros_like_varying, diff_shared()),
                         zeros_like_varying(x_b), no_loss))
            # B and F are independent, and so are the two hops: a runtime may run them side by side
            # (on simulated CPU devices that needs threads to spare, see jaxpar.mesh.use_cpu_devices).
            y = jax.lax.cond(fv > 0, lambda: forward(x_f, fmb, fk), lambda: zeros_like_varying(x_f))
            s_slot = fk * table.stash + fmb % table.stash
            stash = stash.at[s_slot].set(jnp.where(fv > 0, x_f, stash[s_slot]))
            g_blocks = jax.tree.map(lambda a, g: a.at[bk].add(g.astype(jnp.float32)), g_blocks, dbl)
            g_shared = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), g_shared, dsh)
            # One hop per tick: activations to the next stage, gradients to the previous one.
            recv_f = jax.lax.ppermute(y, STAGE, fwd_pairs)
            recv_b = jax.lax.ppermute(dx, STAGE, bwd_pairs)
            # Which (chunk, microbatch) arrived: read off the sender's action in this tick's row.
            prev, nxt = (stage - 1) % p, (stage + 1) % p
            c_from = row["f_chunk"][prev] * p + prev  # global chunk the activation left
            sent_f = (row["f_valid"][prev] > 0) & (c_from + 1 < p * v) & ((stage > 0) | (v > 1))
            sf = ((c_from + 1) // p) * table.fwd_slots + row["f_mb"][prev] % table.fwd_slots
            c_back = row["b_chunk"][nxt] * p + nxt  # global chunk the gradient left
            sent_b = (row["b_valid"][nxt] > 0) & (c_back >= 1) & ((stage < p - 1) | (v > 1))
            sb = ((c_back - 1) // p) * table.bwd_slots + row["b_mb"][nxt] % table.bwd_slots
            fwd_buf = fwd_buf.at[sf].set(jnp.where(sent_f, recv_f, fwd_buf[sf]))
            bwd_buf = bwd_buf.at[sb].set(jnp.where(sent_b, recv_b, bwd_buf[sb]))
            return (fwd_buf, bwd_buf, stash, g_blocks, g_shared, loss_acc + loss), None

        f32_like = lambda tree: jax.tree.map(lambda w: zeros_like_varying(w).astype(jnp.float32), tree)  # noqa: E731
        carry = (zeros((v * table.fwd_slots, *act_shape)), zeros((v * table.bwd_slots, *act_shape)),
                 zeros((v * table.stash, *act_shape)), f32_like(jax.tree.map(lambda w, dim, s: _seed(w, dim + 1, d) if s else w, blocks, block_dims,
                                       block_mask)), f32_like(diff_shared()),
                 jax.lax.pcast(jnp.zeros((), jnp.float32), (*data_axes, STAGE), to="varying"))
        rows = {k: jnp.asarray(a) for k, a in dataclasses.asdict(table).items() if isinstance(a, np.ndarray)}
        with activation_rules(mesh, rules, param_fn=param_fn, tp=tp, compute_dtype=cfg.model.dtype):
            (_, _, _, g_blocks, g_shared, loss), _ = jax.lax.scan(tick, carry, rows)
        # The one reduction per step, after the tick loop.
        g_blocks = jax.tree.map(lambda g, w, dim: reduce_data(g.reshape(-1, *g.shape[2:]), dim).astype(w.dtype),
                                g_blocks, params["blocks"], layout.zero_dims["blocks"])
        g_shared = {k: jax.tree.map(lambda g, w, dim: jax.lax.psum(reduce_data(g, dim), STAGE).astype(w.dtype),
                                    g_shared[k], params[k], layout.zero_dims[k]) for k in g_shared}
        return jax.lax.psum(loss, (*data_axes, STAGE)), {**g_shared, "blocks": g_blocks}

    batch_spec = P(DATA) if dp else P()
    in_specs, out_specs = layout.manual_specs("params", manual), layout.manual_specs("grads", manual)
    run = jax.shard_map(local, mesh=mesh, in_specs=(in_specs, batch_spec), out_specs=(P(), out_specs),
                        axis_names=manual)
    if uneven:
        slots, layer_slot = _padded_layout(counts)

        def padded(params, batch):
            # Stage s holds its counts[s] layers in max(counts) slots: a gather of the canonical
            # [layers, ...] blocks (resharded over `stage` every step), and back for the gradients.
            loss, grads = run({**params, "blocks": jax.tree.map(lambda w: w[slots], params["blocks"])}, batch)
            return loss, {**grads, "blocks": jax.tree.map(lambda g: g[layer_slot], grads["blocks"])}

        return padded
    if v == 1:
        return run

    def interleaved(params, batch):
        # Stage s runs chunks s, s + p, ..., s + (v-1)p: reorder the canonical [layers, ...] so
        # that each stage's contiguous slice holds them (a resharding of the block parameters
        # over `stage` every step, and of their gradients back; see README).
        loss, grads = run({**params, "blocks": jax.tree.map(lambda w: _reorder(w, v, p), params["blocks"])}, batch)
        return loss, {**grads, "blocks": jax.tree.map(lambda g: _reorder(g, p, v), grads["blocks"])}

    return interleaved


def _gather(w: jax.Array, dim: int | None) -> jax.Array:
    """A ZeRO-3 shard all-gathered over `data` along its sharded dim (a replicated leaf as is)."""
    return w if dim is None else jax.lax.all_gather(w, DATA, axis=dim, tiled=True)


def _gather_at_use(params, names, zero_dims) -> Callable:
    """The `use_params` hook of ZeRO-3 per-use gathering inside the pipeline's shard_map: a
    parameter handed to a layer (per layer: names without `layers`) or to the embedding / head is
    all-gathered if it is a data shard. Shards are recognised by (logical names, local shape),
    the only things a hook sees; a replicated leaf with the same key would be ambiguous and is
    refused (no model of jaxpar has one)."""
    sharded, replicated = {}, set()

    def index(tree, name_tree, dims, per_layer):
        for w, n, dim in zip(jax.tree.leaves(tree), jax.tree.leaves(name_tree, is_leaf=_is_names),
                             jax.tree.leaves(dims, is_leaf=lambda x: x is None or isinstance(x, int)), strict=True):
            key = (tuple(n[per_layer:]), tuple(w.shape[per_layer:]))
            if dim is None:
                replicated.add(key)
            else:
                sharded[key] = dim - per_layer

    index(params["blocks"], names["blocks"], zero_dims["blocks"], 1)
    for k in params:
        if k != "blocks":
            index(params[k], names[k], zero_dims[k], 0)
    if ambiguous := replicated & set(sharded):
        raise ValueError(f"ZeRO-3 in the pipeline: sharded and replicated parameters share (names, shape) "
                         f"{sorted(ambiguous)}")

    def use(x: jax.Array, n: tuple[str, ...], cast) -> jax.Array:
        return gather_at_use(x, sharded.get((tuple(n), tuple(x.shape))), cast)
    return use


def _is_names(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def _padded_layout(counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """For layer counts per stage: the canonical layer held by each of the p x max(counts) slots
    (padding slots repeat the stage's last layer, so they hold finite values), and the slot of
    each canonical layer."""
    width, starts = max(counts), np.cumsum((0, *counts[:-1]))
    slots = np.array([starts[s] + min(i, c - 1) for s, c in enumerate(counts) for i in range(width)])
    layer_slot = np.array([s * width + i for s, c in enumerate(counts) for i in range(c)])
    return slots, layer_slot


def _reorder(w: jax.Array, outer: int, inner: int) -> jax.Array:
    """[outer, inner, chunk layers, ...] -> [inner, outer, ...] along the leading `layers` dim."""
    chunk = w.shape[0] // (outer * inner)
    w = w.reshape(outer, inner, chunk, *w.shape[1:]).swapaxes(0, 1)
    return w.reshape(outer * inner * chunk, *w.shape[3:])
