"""The tick loop's carry (`Carry`, `initial_carry`) and one tick of the table on one stage
(`tick`): this stage's column of the row read once (`Row`), then B or I, W, F (the actions,
`actions`), and the hops (`hop`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.parallel import microbatches
from jaxpar.parallel.gradients import _seed
from jaxpar.parallel.pipeline import actions
from jaxpar.parallel.pipeline.plan import Stage, StagePlan
from jaxpar.parallel.pipeline.setup import STAGE
from jaxpar.parallel.pipeline.stash import after, get_row, read_items, set_row, write_items, write_now
from jaxpar.sharding import aval_varying_axes, vary, zeros_like_varying


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
    maxima: dict         # train.qk_clip: kind -> float32 [v, layers per chunk, N], "mtp" -> [depths, N]:
                         # the largest logit per head this stage's F saw (-inf: none yet); else {}
    g_head: dict = {}    # (`Table.overlap` only) F's own float32 accumulator of the shared leaves' gradients


class Row(NamedTuple):
    """This stage's column of one tick's row (`table.Table.rows`), read once."""

    f_valid: jax.Array
    f_mb: jax.Array
    f_chunk: jax.Array
    f_in: jax.Array      # the fwd_buf slot F reads
    f_stash: jax.Array   # the stash slot F writes
    b_valid: jax.Array
    i_valid: jax.Array
    bi_chunk: jax.Array  # B's or I's chunk (at most one of B and I per tick)
    bi_in: jax.Array     # the bwd_buf slot B or I reads
    bi_stash: jax.Array  # the stash slot B or I reads
    i_stash: jax.Array   # the stash slot I writes W's pairs into (its own)
    i_wstash: jax.Array  # the wstash slot I writes what does not fit
    w_valid: jax.Array
    w_chunk: jax.Array
    w_stash: jax.Array
    w_wstash: jax.Array
    f_recv: jax.Array    # the fwd_buf slot an arriving activation lands in (-1: none)
    b_recv: jax.Array    # the bwd_buf slot an arriving gradient lands in (-1: none)
    f_recv2: jax.Array   # the same for the second lane (the V's second half; -1 under other placements)
    b_recv2: jax.Array


def read_row(row: dict, stage: jax.Array) -> Row:
    r = {k: a[stage] for k, a in row.items()}
    return Row(f_valid=r["f_valid"], f_mb=r["f_mb"], f_chunk=r["f_chunk"], f_in=r["f_in"], f_stash=r["f_stash"],
               b_valid=r["b_valid"], i_valid=r["i_valid"], bi_chunk=r["b_chunk"] + r["i_chunk"],
               bi_in=r["b_in"] + r["i_in"], bi_stash=r["b_stash"] + r["i_stash"], i_stash=r["i_stash"],
               i_wstash=r["i_wstash"], w_valid=r["w_valid"], w_chunk=r["w_chunk"], w_stash=r["w_stash"],
               w_wstash=r["w_wstash"], f_recv=r["f_recv"], b_recv=r["b_recv"], f_recv2=r["f_recv2"],
               b_recv2=r["b_recv2"])


def _maxima_axes(plan: StagePlan, key: str) -> tuple:
    """The manual axes F's report of `key` varies over in the carry (its own, `data` and `stage`)."""
    return tuple(sorted({*aval_varying_axes(plan.maxima[key]), *plan.setup.data_axes, STAGE}))


def no_maxima(plan: StagePlan, chunks: bool = False) -> dict:
    """-inf for every report of F (train.qk_clip), per chunk with `chunks` (the carry's), else one
    chunk's (an F that did not run)."""
    v = plan.setup.v
    return {key: actions.zeros(plan, ((v,) if chunks and key != "mtp" else ()) + a.shape, jnp.float32,
                               _maxima_axes(plan, key)) - jnp.inf for key, a in plan.maxima.items()}


def empty_stash(plan: StagePlan, slots: int) -> dict:
    """A stash of `slots` slots, zeros (`initial_carry`'s; `Table.overlap`: F's one slot apart)."""
    axes = lambda a: tuple(sorted({*aval_varying_axes(a), *plan.setup.data_axes, STAGE}))  # noqa: E731
    return {"ends": tuple(actions.zeros(plan, (slots, a.size), a.dtype, axes(a)) for a in plan.end_avals),
            "layers": {kind: tuple(actions.zeros(plan, (slots, plan.n_layers[kind], a.size), a.dtype, axes(a))
                                   for a in plan.layer_avals[kind]) for kind in plan.kinds}}


def initial_carry(plan: StagePlan, st: Stage) -> Carry:
    """The loop's first carry: empty buffers, stash and wstash of the plan's shapes, zero float32
    accumulators. A layer's stash leaf is stored [slots, layers of its stack, size], the
    embedding's residuals and the head's cotangent [slots, size] (I writes W's inputs into a slot
    by offset; a reshaped view of the loop's carry there made XLA copy the whole buffer). (A stash
    slot varies over `stage`, whatever its value does: the tables differ per stage.)"""
    s, table = plan.setup, plan.setup.table
    stash = empty_stash(plan, table.stash)
    wstash = {key: actions.zeros(plan, (table.wstash, plan.chunk_layers[key[0]], *shape), dtype, ax)
              for key, (shape, dtype, ax) in plan.wstash_items.items()}
    g_blocks = plan.flat(microbatches.f32_zeros(
        jax.tree.map(lambda w, dim, m: _seed(w, dim + 1, s.d) if m else w, st.blocks, plan.block_dims,
                     plan.block_mask)))
    g_shared = microbatches.f32_zeros(actions.diff_shared(plan, st))
    return Carry(actions.zeros(plan, (table.fwd_slots, *plan.act_shape)),
                 actions.zeros(plan, (table.bwd_slots, *plan.act_shape)),
                 stash, wstash, g_blocks, g_shared,
                 actions.zeros(plan, (), jnp.float32, (*s.data_axes, STAGE)), no_maxima(plan, chunks=True),
                 g_shared if table.overlap else {})


def idle(plan: StagePlan):
    """What an idle action sends: zeros (NaN with `poison_idle`), which no receiver writes."""
    z = actions.zeros(plan, plan.act_shape)
    return z + jnp.nan if plan.setup.poison_idle else z


def run_b(plan, st, r: Row, bwd_buf, acc, bufs, g_shared):
    """B or I, inside its cond: the cotangent read from its receive slot and the stash slot read
    layer by layer in here, not before the cond (a slice of every residual leaf, megabytes, copied
    on every tick would cost more than the matmuls of an idle tick); its gradients accumulated
    here too, and (`split_i`) I's pairs for W written into its stash slot and the wstash, after
    everything I computed from the slot: its input gradient and its small leaves' gradients (norms,
    biases), accumulated.

    The writes run in a cond of their own (on I's `valid`, true wherever this runs: a predicate
    XLA cannot fold), which takes what I computed as operands, so each is a whole buffer before any
    write starts. Where a chunk has one layer XLA inlines the layer loop and fuses freely: a norm's
    gradient, read from a residual and needed by no input gradient, was read unordered with the
    pairs' write over that residual's leaf; under `dots` and `full` the wstash's W inputs (the MLP's
    down-projection input, recomputed from the stashed gate and up-projection outputs) and the
    `after` scalar were computed inside the stash writes' fusions, each then reading leaves another
    one overwrote. Either way XLA copied those leaves on every tick (measured: 1f1b, zb_h1 and
    zb_v with one layer a chunk; at the CPU benchmark's model, zb_v's step under `dots` held 6.0 MB
    of temp memory more than 1F1B's; with more layers, the loop orders every read before the
    write)."""
    cot = get_row(bwd_buf, r.bi_in)
    d_rest, g_shared, dx, d_taps = actions.backward(plan, st, bufs[0], r.bi_stash, cot, r.bi_chunk, g_shared)
    d_taps = _vary_taps(plan, d_taps)
    acc = actions.accumulate(acc, d_rest, r.bi_chunk)
    if plan.split_i:
        new = {(k_, j): a for k_, xg in d_taps.items() for j, a in enumerate(xg) if a is not None}

        def write(bufs, new, read):
            return write_now(bufs, plan.packing, new, r.i_stash, r.i_wstash, after(*read))
        bufs = jax.lax.cond(r.i_valid > 0, write, lambda bufs, new, read: bufs, bufs, new, (dx, *acc.values()))
        d_taps = {}
    return acc, g_shared, dx, d_taps, bufs if plan.split_i else ()


def no_b(plan, acc, bufs, g_shared):
    return (acc, g_shared, idle(plan), {} if plan.split_i else actions.zero_taps(plan),
            bufs if plan.split_i else ())


def run_w(plan, r: Row, acc, bufs):
    """W, inside its cond (read and accumulated there: idle ticks touch neither): an earlier I's
    pairs from its stash slot (and the wstash: what did not fit there), and the inputs F stashed."""
    got = read_items(*bufs, plan.packing, r.w_stash, r.w_wstash)
    got.update({(k_, 0): actions.stashed_input(plan, bufs[0], r.w_stash, k_) for k_ in plan.x_source})
    return actions.accumulate(acc, actions.weight_grads(plan, {k_: (got[(k_, 0)], got[(k_, 1)]) for k_ in plan.taps}),
                              r.w_chunk)


def run_f(plan, st, r: Row, fwd_buf, dep, stash, g_shared, slot=None):
    """F, inside its cond: its input read from its receive slot, after B's and W's results (`dep`:
    its cond runs after theirs), its residuals written into its stash slot (`slot`: that row of
    `stash` instead)."""
    x_f = dep(get_row(fwd_buf, r.f_in))
    y, stash, g_shared, loss, maxima = actions.forward(plan, st, x_f, r.f_mb, r.f_chunk, stash,
                                                       r.f_stash if slot is None else slot, g_shared)
    return y, stash, g_shared, loss, {key: vary(a, _maxima_axes(plan, key)) for key, a in maxima.items()}


def no_f(plan, stash, g_shared):
    return (idle(plan), stash, g_shared, actions.zeros(plan, (), jnp.float32, (*plan.setup.data_axes, STAGE)),
            no_maxima(plan))


def add_maxima(acc: dict, maxima: dict, k: jax.Array) -> dict:
    """The carry's maxima with F's of chunk k taken in (a max; the MTP blocks' have no chunk)."""
    return {key: jnp.maximum(a, maxima[key]) if key == "mtp" else set_row(a, jnp.maximum(get_row(a, k), maxima[key]), k)
            for key, a in acc.items()}


def _land(buf, x, slot):
    """`x` into row `slot` of `buf` where `slot` >= 0. (Under a cond, not a select with the row's
    old contents: a tick where nothing arrives neither reads nor writes the buffer.)"""
    return jax.lax.cond(slot >= 0, lambda b: set_row(b, x, slot), lambda b: b, buf)


def _both_ways(x, down: tuple, up: tuple) -> tuple:
    """`x` sent one stage down (`down` pairs) and one stage up (`up`): what each stage receives
    from above and from below. One collective where no stage is in both (p = 2), else two."""
    if not {i for i, _ in down} & {i for i, _ in up}:
        both = jax.lax.ppermute(x, STAGE, (*down, *up))
        return both, both
    return jax.lax.ppermute(x, STAGE, down), jax.lax.ppermute(x, STAGE, up)


def hop(plan, r: Row, y, dx, fwd_buf, bwd_buf, index):
    """The hops of one tick: F's output to the next chunk's stage, B's or I's input gradient to
    the previous chunk's; the row says which slot each arrival lands in (-1: nothing arrives).

    Interleaved placement: one collective-permute each (down the ring for F, up for B). V
    placement: a stage's F goes down (first half) or up (second half) and its B or I the other
    way round, so each is sent both ways: F's output down into the first lane (`f_recv`) and up
    into the second (`f_recv2`), B's gradient up into the first (`b_recv`) and down into the
    second (`b_recv2`); four collective-permutes per tick, two where p = 2 (each stage has one
    neighbour), F's reading F's output only and B's B's only (so that DualPipeV's F&B ticks can
    overlap the one's with the other's computation). Where no stage sends two messages in a
    tick (`Table.one_message`: zb_v, one action per tick) the one message goes both ways: two
    collective-permutes, one where p = 2. The turn of the V (chunk p-1 to p, and its gradient
    back) is stage p-1's own: a select of its own y or dx, no send."""
    s = plan.setup
    if s.table.placement != "v":
        fwd_buf = _land(fwd_buf, jax.lax.ppermute(y, STAGE, s.fwd_pairs), r.f_recv)
        return fwd_buf, _land(bwd_buf, jax.lax.ppermute(dx, STAGE, s.bwd_pairs), r.b_recv)
    turn = index == s.p - 1
    if s.table.one_message:
        y = dx = jnp.where(r.f_valid > 0, y, dx)
        (f_down, f_up) = (b_down, b_up) = _both_ways(y, s.fwd_pairs, s.bwd_pairs)
    else:
        f_down, f_up = _both_ways(y, s.fwd_pairs, s.bwd_pairs)
        b_down, b_up = _both_ways(dx, s.fwd_pairs, s.bwd_pairs)
    fwd_buf = _land(_land(fwd_buf, f_down, r.f_recv), jnp.where(turn, y, f_up), r.f_recv2)
    bwd_buf = _land(_land(bwd_buf, jnp.where(turn, dx, b_up), r.b_recv), b_down, r.b_recv2)
    return fwd_buf, bwd_buf


def f_and_b(plan, st, r: Row, fwd_buf, bwd_buf, stash, acc, g_shared, g_head):
    """Under a table of F&B ticks (`Table.overlap`): this tick's B (or I) and F, neither reading
    what the other computes, F's residuals in a stash of one slot of its own (`tick`). On an F&B
    tick the two run as one loop, F's layer i beside B's layer n-1-i (`actions.pair`), so that each
    one's collectives can overlap the other's computation; on a tick of one of them, it alone.
    Returns B's (acc, g_shared, dx, d_taps) and F's (y, its slot, g_head, loss, maxima).

    Three conds one after another, each running its action or passing everything through: the
    F&B loop, B (or I) alone, F alone, from idle outputs. Not one cond choosing between the loop
    and the two apart: where a cond's branches both return what an inner cond updated (B's
    embedding gradient, F's head's), XLA copied the accumulator on every tick, vocabulary-sized
    (measured: the embedding's and the head's float32 gradients, 136 copies a step at p = 4,
    m = 8); a cond between an action and a pass-through of everything updates it in place (a
    pass-through of the accumulators beside fresh idle outputs did not)."""
    both = (r.f_valid > 0) & (r.b_valid > 0)
    out = (*no_b(plan, acc, (), g_shared)[:4], *no_f(plan, empty_stash(plan, 1), g_head))

    def paired(out):
        acc, g, _, _, _, own, g_head, _, _ = out
        (y, own, g_head, loss, maxima), (d_rest, g, dx, d_taps) = actions.pair(
            plan, st, get_row(fwd_buf, r.f_in), r.f_mb, r.f_chunk, own, g_head,
            stash, r.bi_stash, get_row(bwd_buf, r.bi_in), r.bi_chunk, g)
        return (actions.accumulate(acc, d_rest, r.bi_chunk), g, dx, _vary_taps(plan, d_taps), y, own, g_head, loss,
                {key: vary(a, _maxima_axes(plan, key)) for key, a in maxima.items()})

    def b_alone(out):
        acc, g, _, _, *f = out
        return (*run_b(plan, st, r, bwd_buf, acc, (stash, {}), g)[:4], *f)

    def f_alone(out):
        *b, _, own, g_head, _, _ = out
        return (*b, *run_f(plan, st, r, fwd_buf, lambda x: x, own, g_head, 0))

    keep = lambda out: out  # noqa: E731
    out = jax.lax.cond(both, paired, keep, out)
    out = jax.lax.cond((r.b_valid + r.i_valid > 0) & ~both, b_alone, keep, out)
    return jax.lax.cond((r.f_valid > 0) & ~both, f_alone, keep, out)


def _vary_taps(plan, d_taps):
    return {k_: tuple(None if a is None else vary(a, plan.taps[k_][4]) for a in xg) for k_, xg in (d_taps or {}).items()}


def tick(plan: StagePlan, st: Stage, carry: Carry, row: dict):
    """One tick of the table on this stage: B or I, then W, then F (as the row says; F last, so
    that its residuals go into its stash slot inside its own cond, DESIGN.md §5.3), one hop each
    way, and the arrivals into their buffer slots. The `lax.scan` body over the table's rows.

    Under a table of F&B ticks (`Table.overlap`: DualPipeV's F of one microbatch beside the fused
    B of another) F takes nothing B or W computed, so that neither's collectives wait for the
    other's computation: no `after` on F's input, its own accumulator of the shared leaves'
    gradients (`Carry.g_head`, summed after the loop), and its residuals written into a stash of
    one slot of its own, copied into its slot of the stash after B's and W's reads (as `after`
    orders every other write; F writing the stash itself, unordered with their reads, made XLA
    copy the whole stash every tick: 1.76x the step's temp memory at p = 4). The cost: one slot's
    copy per F, and F's and B's idle outputs (zeros, one slot among them) filled on every tick
    (`f_and_b`). On a tick with both, F and B run as one loop over the layers (`f_and_b`,
    `actions.pair`)."""
    taps, overlap = plan.taps, plan.setup.table.overlap
    fwd_buf, bwd_buf, stash, wstash, g_blocks, g_shared, loss_acc, maxima_acc, g_head = carry
    r = read_row(row, st.index)
    # Each action reads its input row (F's activation, B's or I's cotangent) inside its own cond,
    # so an idle tick copies none; it sends `idle`, which no receiver writes. The gradients
    # accumulate inside the action's cond: an idle tick neither fills zeros nor adds them to the
    # float32 accumulators. I writes W's pairs into its stash slot inside the same cond (a tick
    # without I fills no taps' worth of zeros), unless the split table also holds fused Bs, whose
    # W runs at once from the pairs (below).
    acc_rest = {k_: a for k_, a in g_blocks.items() if k_ not in taps}
    if overlap:  # (see above: F apart from B and W; both in one loop on an F&B tick, `f_and_b`)
        acc_rest, g_shared, dx, d_taps, y, own, g_head, loss, maxima = f_and_b(
            plan, st, r, fwd_buf, bwd_buf, stash, acc_rest, g_shared, g_head)
        bufs = ()
    else:
        acc_rest, g_shared, dx, d_taps, bufs = jax.lax.cond(
            r.b_valid + r.i_valid > 0,
            lambda acc, bufs, g: run_b(plan, st, r, bwd_buf, acc, bufs, g),
            lambda acc, bufs, g: no_b(plan, acc, bufs, g),
            acc_rest, (stash, wstash if plan.split_i else {}), g_shared)
    if plan.split_i:
        stash, wstash = bufs
    g_blocks = {**g_blocks, **acc_rest}
    dw = {}
    if plan.setup.table.split:
        # W: of this tick's fused B (a split table may hold some), and of an earlier I from what
        # it wrote into its stash slot.
        if plan.fused_b:
            zero_w = lambda: {k_: zeros_like_varying(g_blocks[k_][0]) for k_ in taps}  # noqa: E731
            g_blocks = actions.accumulate(g_blocks, jax.lax.cond(
                r.b_valid > 0, lambda: actions.weight_grads(plan, d_taps), zero_w), r.bi_chunk)
        dw = jax.lax.cond(r.w_valid > 0, lambda acc, bufs: run_w(plan, r, acc, bufs), lambda acc, bufs: acc,
                          {k_: g_blocks[k_] for k_ in taps}, (stash, wstash))
        g_blocks = {**g_blocks, **dw}
    # Every write of the stash and wstash after every read of them has been consumed (else XLA
    # keeps a copy of the whole buffer): I's outputs for W into its own slot, over the residuals
    # it has consumed (and the wstash), then F's residuals into its slot.
    dep = after(dx, *dw.values())
    if plan.setup.table.split and not plan.split_i:
        new = {(k_, j): a for k_, xg in d_taps.items() for j, a in enumerate(xg)}
        stash, wstash = write_items(stash, wstash, plan.packing, new, r.i_valid > 0, r.i_stash, r.i_wstash, dep)
    # F last, its residuals written into its slot inside its own cond: a tick without F neither
    # fills a slot's worth of zeros nor writes (B has read its slot above: a slot B frees may be
    # the one F fills in the same tick). (Only the first chunk's B, the embedding, and the last
    # chunk's F, the head, add to the shared leaves' vocabulary-sized float32 accumulators,
    # inside their own conds.)
    if overlap:  # (F's residuals, from its own slot: `f_and_b`)
        stash = jax.lax.cond(r.f_valid > 0, lambda s: jax.tree.map(
            lambda b, o: jax.lax.dynamic_update_slice_in_dim(b, dep(o), r.f_stash, 0), s, own), lambda s: s, stash)
    else:
        y, stash, g_shared, loss, maxima = jax.lax.cond(
            r.f_valid > 0, lambda stash, g: run_f(plan, st, r, fwd_buf, dep, stash, g),
            lambda stash, g: no_f(plan, stash, g), stash, g_shared)
    fwd_buf, bwd_buf = hop(plan, r, y, dx, fwd_buf, bwd_buf, st.index)
    return Carry(fwd_buf, bwd_buf, stash, wstash, g_blocks, g_shared, loss_acc + loss,
                 add_maxima(maxima_acc, maxima, r.f_chunk), g_head), None
