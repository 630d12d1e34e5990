"""A schedule table as the executor consumes it (`Table`, `table_of`), and the one choice about
the stash that the executor and the planner share (`stashes_inputs`). Plain Python and numpy, as
the tables are (`jaxpar.parallel.pipeline.schedules`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.parallel.pipeline.schedules import validate

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

    @property
    def overlap(self) -> bool:
        """Does a tick run one microbatch's F beside another's fused B on one stage of a V (DualPipeV's
        F&B)? Then the tick keeps F independent of B and W (`tick.tick`)."""
        return self.placement == "v" and bool((self.rows["f_valid"] * self.rows["b_valid"]).any())

    @property
    def one_message(self) -> bool:
        """Does every stage send at most one message a tick (no tick with F and B or I on one stage)?
        Then a V tick sends that one message both ways, not F's and B's apart (`tick.hop`)."""
        r = self.rows
        return not (r["f_valid"] * (r["b_valid"] + r["i_valid"])).any()

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
                 placement=schedule.placement)
