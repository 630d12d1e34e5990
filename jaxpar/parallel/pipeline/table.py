"""A schedule table as the executor consumes it (`Table`, `table_of`), and the one choice about
the stash that the executor and the planner share (`stashes_inputs`). Plain Python and numpy, as
the tables are (`jaxpar.parallel.pipeline.schedules`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.parallel.pipeline.schedules import build, validate

# Under a table of I and W with `remat: none`, F stashes each weight matmul's input once beside the
# layer's residuals and W reads it there (`stashes_inputs`; a switch for measuring without).
STASH_MATMUL_INPUTS = True


def stashes_inputs(remat: str, split: bool, fused_b: bool, gather: bool) -> bool:
    """Does F stash each weight matmul's input for W (so that I writes only the output
    cotangents)? For a table of I and W only (`split`, no `fused_b`), where the layer body can
    return its inputs whole: `remat: none` (a checkpoint policy keeps them inside) and every
    layer slot active (no `gather`: a skipped slot's `cond` keeps them inside). Read by the
    executor (`plan.make_plan`) and the planner (`jaxpar.plan.memory`)."""
    return STASH_MATMUL_INPUTS and split and not fused_b and remat == "none" and not gather


def deferred_w_slots(schedule: str, remat: str) -> int | None:
    """How many Ws zb_v's drain may defer at a time (`schedules.zb_v`), None for no cap. With
    `remat: none` I writes W's (input, output cotangent) pairs into the stash slot it consumed, so
    deferring costs nothing. Under a remat policy the slot is too small and the pairs go to the
    wstash, one slot per deferred W; zb_v then defers none: its stash (2p chunk inputs, p stages'
    worth) and wstash (one chunk's pairs, half a stage's) hold what 1F1B's do less half a stage's
    pairs, which pays for the V's second receive lanes (measured at p = 4: `dots` 10.08 MB of temp
    memory against 1F1B's 10.30, `full` 5.45 against 7.11; one deferred W: 10.60 under `dots`).
    The price: ZB-H1's bubble, 11.1% at p = 4, m = 8, against 5.9% uncapped (1F1B: 20%). Read by
    the step and the planner."""
    return 0 if schedule == "zb_v" and remat != "none" else None


def schedule_of(parallel, p: int):
    """The table a config's `parallel` section runs on p stages (`schedules.build`)."""
    return build(parallel.schedule, p, parallel.microbatches, parallel.virtual_stages,
                 deferred_w_slots(parallel.schedule, parallel.remat))


def one_message(schedule) -> bool:
    """Does every stage of a `schedules.Schedule` send at most one message a tick (no tick with F
    and B or I on one stage)? `Table.one_message`."""
    return not any(any(a.kind == "F" for a in cell) and any(a.kind in ("B", "I") for a in cell)
                   for row in schedule.ticks for cell in row)


def hops_per_tick(placement: str, p: int, one_message: bool) -> int:
    """The collective-permutes over `stage` of one tick (`tick.hop`): interleaved placement, F's
    output down the ring and B's gradient up, 2; V placement, each sent both ways, 4, or 2 where
    every stage sends at most one message a tick (`one_message`: zb_v), halved where p = 2 (one
    neighbour: both ways are one collective). Read by the executor's tests and the planner."""
    if placement != "v":
        return 2
    n = 2 if one_message else 4
    return n // 2 if p == 2 else n


def v_reorder_share(p: int) -> float:
    """Of a stage's block parameters in model order (chunks 2s and 2s+1), the share the V's
    placement (chunks s and 2p-1-s) sends over `stage` per step each way (`stash.v_chunks`: the even
    chunks by one collective-permute, the odd by another): all of them, but where p = 2, whose even
    chunks are already in place (a permute onto itself is no collective)."""
    return 0.5 if p == 2 else 1.0


@dataclasses.dataclass(frozen=True)
class Table:
    """A schedule as the executor consumes it: int32 rows [ticks, p] and slot counts per stage.

    `rows` holds, per (tick, stage): `{f,b}_valid`, `{f,b}_mb`, `{f,b}_chunk` (the stage's local
    chunk: the global chunk is `placement.chunk_at(stage, local)`), the slots each action reads and writes (`f_in`: the
    received activation F reads, `f_stash`: where F saves, `b_stash`: what B reads, `b_in`: the
    received gradient B reads) and `f_recv` / `b_recv`: the slot a message arriving at the end
    of the tick lands in (-1: none), `f_recv2` / `b_recv2` likewise for the V placement's second
    lane (messages into its second half). Each slot space is shared by the stage's chunks."""

    rows: dict[str, np.ndarray]
    chunks: int     # v: chunks per stage
    stash: int      # stash slots per stage: what F saved, waiting for its B
    fwd_slots: int  # received activations waiting for their F, per stage
    bwd_slots: int  # received gradients waiting for their B, per stage
    wstash: int = 1     # slots per stage of what I saved for its W
    split: bool = False  # does the table split backwards into I and W?
    placement: str = "interleaved"  # which stage holds which chunk (`jaxpar.parallel.pipeline.placement`)
    one_message: bool = True
    """Does every stage send at most one message a tick (`one_message`)? Then a V tick
    sends that one message both ways, not F's and B's apart (`tick.hop`, `hops_per_tick`)."""

    @property
    def overlap(self) -> bool:
        """Does a tick run one microbatch's F beside another's fused B on one stage of a V (DualPipeV's
        F&B)? Then the tick keeps F independent of B and W (`tick.tick`)."""
        return self.placement == "v" and bool((self.rows["f_valid"] * self.rows["b_valid"]).any())

    @property
    def ticks(self) -> int:
        return self.rows["f_valid"].shape[0]


def table_of(schedule) -> Table:
    """The executor's view of a `jaxpar.parallel.pipeline.schedules.Schedule`, validated (slots included)."""
    validate(schedule)
    counts = schedule.slot_counts()
    rows = {k: np.asarray(x, np.int32) for k, x in schedule.to_arrays().items()}
    return Table(rows=rows, chunks=schedule.virtual_stages, stash=counts["stash"], fwd_slots=counts["fwd"],
                 bwd_slots=counts["bwd"], wstash=counts["wstash"], split=schedule.split,
                 placement=schedule.placement, one_message=one_message(schedule))
