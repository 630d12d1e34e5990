"""Pipeline schedules as data: tables `tick x stage -> actions`, built in plain Python, checked by
`validate` and costed by `simulate` (bubble, stashed activations, buffered messages, bytes sent).
No JAX here: the pipeline executor runs any table that `validate` accepts.

Actions: F (forward of a microbatch through a chunk), B (fused backward: input and weight
gradients), or the split backward I (input gradient only, sent to the previous stage like B's) then
W (weight gradient only, sends nothing). Every (microbatch, chunk) has one F and either one B or
one I and one W.

Execution model (lock-step SPMD): all stages run tick t together, then one forward and one
backward `ppermute` move each message one hop. Per stage and tick: at most one F, at most one of
B and I, at most one W. F(mb, c) may run at tick t only if F(mb, c-1) ran at a tick <= t-1;
B or I (mb, c) only if F(mb, c) and (c < last chunk) the B or I of (mb, c+1) ran at a tick <= t-1;
W(mb, c) only if I(mb, c) ran at a tick <= t-1. Chunk c (in model order, 0..p*v-1) lives on stage
c % p (Megatron's interleaved placement, `placement="interleaved"`), or, with `placement="v"` (v = 2,
the V-shape schedules `zb_v` and `dualpipe_v`), stage s holds chunks s and 2p-1-s: the hop from
chunk p-1 to chunk p stays on the last stage (a local hop, still one tick), and the second half's
activations travel back up the stages. Local chunk k of stage s is chunk c with c // p = k in both
placements. A message lands in its receiving chunk's lane: the first (`f_recv`, `b_recv`) for
interleaved chunks and V's first half, the second (`f_recv2`, `b_recv2`) for V's second half, so
that a stage receives at most one activation and one gradient per lane and tick.

Buffers and slots (`Schedule.to_arrays`, `Schedule.slot_counts`): each stage has four slot spaces,
each shared by all its chunks: the stash (what F saves for the backward; written by F, read and
freed by B; with a split backward read by I, which writes what W needs over what it has consumed,
and freed by W), the wstash (what of I's outputs for W did not fit in the stash slot; written by
I, read and freed by W), the forward
buffer (received activations; written at the end of the sender's tick, read and freed by the F
that consumes it) and the backward buffer (received gradients, likewise, read by B or I). Within a
tick all reads come before all writes, and received messages are written last, so a slot freed at
tick t may be written again at tick t. Slots are assigned per stage by a free list.

Bubble: `bubble_fraction` everywhere here is idle stage-time / all stage-time, (p-1)/(m+p-1) for
GPipe and 1F1B with equal costs; Megatron's papers divide idle by ideal (busy) time instead,
(p-1)/m, which `Simulation.bubble_over_ideal` reports.

Schedules (`SCHEDULES`, `build`): `gpipe`; `1f1b` (Megatron's order and memory, p-s stashed on
stage s, one action per tick with the backward split into I then W); `zb_h1` (1f1b with W
deferred into the bubbles); `1f1b_lockstep` (what `1f1b` was before the split backward: one F and
one fused B per tick, 2(p-s)-1 stashed); `1f1b_one_action` (Megatron's order with a fused B);
`interleaved_1f1b` (v chunks per stage); `zb_v` and `dualpipe_v` (V placement, their stage
programs from `jaxpar.parallel.pipeline.vshape`). `random_table` and `from_programs` make other valid tables, for
tests. The simulator (`simulate`, `ideal_bubble`) is `jaxpar.parallel.pipeline.simulate`.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections import deque
from typing import Iterator, Sequence

import numpy as np

from jaxpar.errors import JaxparError
from jaxpar.parallel.pipeline import placement as _placement
from jaxpar.parallel.pipeline.placement import PLACEMENTS
from jaxpar.parallel.pipeline.vshape import V_SCHEDULES, dualpipe_v_programs, zb_v_programs

SCHEDULES = ("gpipe", "1f1b", "1f1b_lockstep", "1f1b_one_action", "interleaved_1f1b", "zb_h1", *V_SCHEDULES)
KINDS = ("F", "B", "I", "W")
_LANE = {"F": 0, "B": 1, "I": 1, "W": 2}  # per stage and tick: one F, one of B/I, one W


class ScheduleError(JaxparError, ValueError):
    """A schedule that cannot be built from the given sizes, or a table that breaks the rules."""


@dataclasses.dataclass(frozen=True)
class Action:
    """`kind` "F" (forward of `microbatch` through `chunk`), "B" (backward to the chunk input,
    weight gradients included), "I" (the input gradient only, sent on like B's) or "W" (the weight
    gradient only, after the I); `chunk` is the global chunk index 0..p*v-1 in model order."""
    kind: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}(mb {self.microbatch}, chunk {self.chunk})"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`ticks[t][s]`: the actions of stage s in tick t (at most one F, one B or I, one W)."""
    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    ticks: tuple[tuple[tuple[Action, ...], ...], ...]
    # The most chunk inputs each stage may hold stashed, as the schedule promises it (`validate`
    # checks the table keeps the promise; the executor sizes its stash by `slot_counts`).
    declared_stash: tuple[int, ...] | None = None
    placement: str = "interleaved"  # or "v": stage s holds chunks s and 2p-1-s (v = 2)

    def stage_of(self, chunk: int) -> int:
        return _placement.stage_of(chunk, self.stages, self.placement)

    def chunk_at(self, stage: int, local: int) -> int:
        """The global chunk that is local chunk `local` of `stage` (`stage_of`'s inverse)."""
        return _placement.chunk_at(stage, local, self.stages, self.placement)

    def lane_of(self, chunk: int) -> int:
        """The receive lane of messages to `chunk`: 1 for V's second half, else 0 (see the module)."""
        return _placement.lane_of(chunk, self.stages, self.placement)

    def num_ticks(self) -> int:
        return len(self.ticks)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual_stages

    @property
    def split(self) -> bool:
        """Whether the table splits any backward into I and W."""
        return any(a.kind in "IW" for _, _, a in self.actions())

    def actions(self) -> Iterator[tuple[int, int, Action]]:
        """Every (tick, stage, action) of the table, in tick then stage order."""
        for t, row in enumerate(self.ticks):
            for s, cell in enumerate(row):
                for a in cell:
                    yield t, s, a

    def times(self) -> dict[tuple[str, int, int], int]:
        """(kind, microbatch, chunk) -> the tick it runs in (the last one, if a broken table repeats it)."""
        return {(a.kind, a.microbatch, a.chunk): t for t, _, a in self.actions()}

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The table for the executor: int32 arrays [num_ticks, stages], 0 where not applicable.

        - `{k}_valid`, `{k}_mb`, `{k}_chunk` for k in f, b, i, w: whether stage s runs that kind at
          tick t, its microbatch and its LOCAL chunk (global chunk // stages).
        - `f_in`: the forward-buffer slot F reads (not for chunk 0, which embeds tokens);
          `f_stash`: the stash slot F writes.
        - `b_stash`, `i_stash`: the stash slot B / I reads (B frees it; I writes W's inputs into
          it); `b_in`, `i_in`: the backward-buffer slot B / I reads (not for the last chunk,
          which starts from the loss).
        - `i_wstash`: the wstash slot I writes; `w_wstash`: the wstash slot W reads;
          `w_stash`: the stash slot W reads (and frees).
        - `f_recv`, `b_recv`: the forward / backward-buffer slot of stage s into which the message
          arriving at the end of tick t is written; -1 where nothing arrives. (F of the last chunk
          and B / I of chunk 0 send nothing.) `f_recv2`, `b_recv2`: likewise for the second lane
          (V placement's second half; all -1 otherwise).
        Within a tick the executor must do all reads before all writes, and the receives last.
        """
        return {k: a.copy() for k, a in self._plan[0].items()}

    def slot_counts(self) -> dict[str, int]:
        """Slots per stage of each slot space, `stash`, `wstash`, `fwd`, `bwd` (the most any stage
        uses, at least 1): the executor's buffers have this many entries."""
        return dict(self._plan[1])

    @functools.cached_property
    def _plan(self) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        return _assign_slots(self)

    def _peak(self, up: str, down: str) -> list[int]:
        delta = np.zeros((self.num_ticks() + 1, self.stages), np.int64)
        for t, s, a in self.actions():
            delta[t, s] += (a.kind in up) - (a.kind in down)
        return [int(x) for x in np.cumsum(delta, axis=0).max(axis=0, initial=0)]

    def peak_stash(self) -> list[int]:
        """Per stage: the most (microbatch, chunk) whose F has run and whose B or W has not, over
        ticks (an F counts from the end of its tick, a B or W releases at the end of its tick): what
        the stash holds. (A split backward keeps the slot from I to W: I writes W's inputs over
        the residuals it consumed.)"""
        return self._peak("F", "BW")

    def peak_wstash(self) -> list[int]:
        """Per stage: the most (microbatch, chunk) whose I has run and whose W has not: what the
        wstash holds (0 for tables without I and W)."""
        return self._peak("I", "W")

    def peak_buffered(self) -> list[tuple[int, int]]:
        """Per stage, (activations, gradients): the most messages received and not yet consumed at
        the end of a tick (after its ppermute). A message consumed in the very next tick counts 1 —
        it is the receive slot itself — so a peak of 1 means one receive register is enough.
        F of the last chunk and B / I of chunk 0 send nothing."""
        p = self.stages
        delta = np.zeros((self.num_ticks() + 1, p, 2), np.int64)
        for lane, (recv, t_send) in enumerate(_messages(self)):
            for (mb, c), t in t_send.items():
                if (mb, c) in recv:
                    delta[t, self.stage_of(c), lane] += 1
                    delta[recv[(mb, c)], self.stage_of(c), lane] -= 1
        peak = np.cumsum(delta, axis=0).max(axis=0, initial=0)
        return [(int(f), int(b)) for f, b in peak]


def _backward_times(schedule: Schedule) -> dict[tuple[int, int], int]:
    """(microbatch, chunk) -> the tick of its B or I (the one that sends the gradient on)."""
    return {(a.microbatch, a.chunk): t for t, _, a in schedule.actions() if a.kind in "BI"}


def _messages(schedule: Schedule):
    """For the forward lane, then the backward lane: ({(mb, chunk): tick it consumes its received
    message}, {(mb, chunk): tick that message is sent}); keys name the RECEIVING chunk."""
    nc = schedule.chunks
    f = {(a.microbatch, a.chunk): t for t, _, a in schedule.actions() if a.kind == "F"}
    b = _backward_times(schedule)
    f_send = {(mb, c + 1): t for (mb, c), t in f.items() if c + 1 < nc}
    f_recv = {(mb, c): t for (mb, c), t in f.items() if c > 0}
    b_send = {(mb, c - 1): t for (mb, c), t in b.items() if c > 0}
    b_recv = {(mb, c): t for (mb, c), t in b.items() if c < nc - 1}
    return (f_recv, f_send), (b_recv, b_send)


# ---------------------------------------------------------------------------------------------
# Slots: a free list per stage and slot space, and a checker that does not trust it.

SPACES = ("stash", "wstash", "fwd", "bwd")
ARRAY_KEYS = (*(f"{k}_{f}" for k in "fbiw" for f in ("valid", "mb", "chunk")),
              "f_in", "f_stash", "b_stash", "b_in", "i_stash", "i_in", "i_wstash", "w_wstash", "w_stash", "f_recv",
              "b_recv", "f_recv2", "b_recv2")
_RECV = (("f_recv", "f_recv2"), ("b_recv", "b_recv2"))  # [forward | backward][lane]
_SLOT_SPACE = {"f_in": "fwd", "f_stash": "stash", "b_stash": "stash", "b_in": "bwd", "i_stash": "stash",
               "i_in": "bwd", "i_wstash": "wstash", "w_wstash": "wstash", "w_stash": "stash", "f_recv": "fwd",
               "b_recv": "bwd", "f_recv2": "fwd", "b_recv2": "bwd"}


def _free_list(intervals: Sequence[tuple[int, int, tuple]]) -> tuple[dict[tuple, int], int]:
    """Slots for values live from `start` (written in that tick) to `end` (read and freed in that
    tick): the lowest free slot at each write, a slot freed at tick t free again at tick t. In
    order of start this uses exactly as many slots as values are ever live at once."""
    slots, live, free, n = {}, [], [], 0
    for start, end, key in sorted(intervals):
        while live and live[0][0] <= start:
            heapq.heappush(free, heapq.heappop(live)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot, n = n, n + 1
        slots[key] = slot
        heapq.heappush(live, (end, slot))
    return slots, n


def _assign_slots(sc: Schedule) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """`to_arrays()` and `slot_counts()` of `sc` (see there)."""
    T, p, nc = sc.num_ticks(), sc.stages, sc.chunks
    out = {k: np.zeros((T, p), np.int32) for k in ARRAY_KEYS}
    for key in (*_RECV[0], *_RECV[1]):
        out[key][:] = -1
    at = sc.stage_of
    when: dict[str, dict[tuple[int, int], int]] = {k: {} for k in KINDS}
    for t, s, a in sc.actions():
        k = a.kind.lower()
        out[f"{k}_valid"][t, s] = 1
        out[f"{k}_mb"][t, s] = a.microbatch
        out[f"{k}_chunk"][t, s] = a.chunk // p
        when[a.kind][(a.microbatch, a.chunk)] = t
    f, w = when["F"], when["W"]
    back = {key: ("b" if key in when["B"] else "i", t) for key, t in _backward_times(sc).items()}
    never = T + 1  # a broken table's value nobody reads (validate reports it before looking at slots)
    intervals: dict[str, list[list]] = {space: [[] for _ in range(p)] for space in SPACES}
    for (mb, c), t in f.items():
        # Freed by B, or by the W of a split backward (I writes W's inputs into the slot).
        kind, t_back = back.get((mb, c), ("", never))
        intervals["stash"][at(c)].append((t, w.get((mb, c), never) if kind == "i" else t_back, (mb, c)))
        if c > 0 and (mb, c - 1) in f:
            intervals["fwd"][at(c)].append((f[(mb, c - 1)], t, (mb, c)))
    for (mb, c), t in when["I"].items():
        intervals["wstash"][at(c)].append((t, w.get((mb, c), never), (mb, c)))
    for (mb, c), (_, t) in back.items():
        if c < nc - 1 and (mb, c + 1) in back:
            intervals["bwd"][at(c)].append((back[(mb, c + 1)][1], t, (mb, c)))
    counts = dict.fromkeys(SPACES, 1)
    for space in SPACES:
        for s in range(p):
            slots, n = _free_list(intervals[space][s])
            counts[space] = max(counts[space], n)
            for (mb, c), slot in slots.items():
                if space == "stash":
                    out["f_stash"][f[(mb, c)], s] = slot
                    if (mb, c) in back:
                        k, t = back[(mb, c)]
                        out[f"{k}_stash"][t, s] = slot
                        if k == "i" and (mb, c) in w:
                            out["w_stash"][w[(mb, c)], s] = slot
                elif space == "wstash":
                    out["i_wstash"][when["I"][(mb, c)], s] = slot
                    if (mb, c) in w:
                        out["w_wstash"][w[(mb, c)], s] = slot
                elif space == "fwd":
                    out["f_in"][f[(mb, c)], s] = slot
                    out[_RECV[0][sc.lane_of(c)]][f[(mb, c - 1)], s] = slot
                else:
                    k, t = back[(mb, c)]
                    out[f"{k}_in"][t, s] = slot
                    out[_RECV[1][sc.lane_of(c)]][back[(mb, c + 1)][1], s] = slot
    return out, counts


def _what(tag: tuple | None) -> str:
    if tag is None:
        return "nothing"
    what, mb, c = tag
    return {"act": f"the activation for F(mb {mb}, chunk {c})", "grad": f"the gradient for the backward of "
            f"(mb {mb}, chunk {c})", "stash": f"the stash of F(mb {mb}, chunk {c})",
            "wstash": f"the wstash of I(mb {mb}, chunk {c})"}[what]


def check_slots(schedule: Schedule, arrays: dict[str, np.ndarray] | None = None,
                counts: dict[str, int] | None = None) -> None:
    """Replay `arrays` (default `schedule.to_arrays()`) with buffers of `counts` slots (default
    `schedule.slot_counts()`) tick by tick, as the executor runs them — reads, then writes, then
    receives — and raise ScheduleError unless every action the arrays name is the table's, every
    slot index is in range, every read finds the stash or message its action needs, no write or
    receive lands on a slot still holding an unread value, and nothing is left unread. It knows
    nothing of how the slots were chosen."""
    sc, (T, p, nc) = schedule, (schedule.num_ticks(), schedule.stages, schedule.chunks)
    arr = schedule.to_arrays() if arrays is None else arrays
    counts = schedule.slot_counts() if counts is None else counts
    for key in ARRAY_KEYS:
        if key not in arr or np.shape(arr[key]) != (T, p):
            raise ScheduleError(f"to_arrays()[{key!r}] is missing or not of shape [ticks, stages] = ({T}, {p}).")
    for key, space in _SLOT_SPACE.items():
        lo = -1 if "_recv" in key else 0
        bad = np.argwhere((arr[key] < lo) | (arr[key] >= counts[space]))
        if len(bad):
            t, s = bad[0]
            raise ScheduleError(f"to_arrays()[{key!r}] at tick {t}, stage {s} is {arr[key][t, s]}, outside the "
                                f"{counts[space]} {space} slots: every entry must index a slot (0 where unused).")
    for t, row in enumerate(sc.ticks):
        for s, cell in enumerate(row):
            for kind in KINDS:
                k = kind.lower()
                named = None
                if arr[f"{k}_valid"][t, s]:
                    named = (int(arr[f"{k}_mb"][t, s]), sc.chunk_at(s, int(arr[f"{k}_chunk"][t, s])))
                acts = [(a.microbatch, a.chunk) for a in cell if a.kind == kind]
                if named != (acts[0] if acts else None):
                    raise ScheduleError(f"to_arrays() at tick {t}, stage {s} names "
                                        f"{Action(kind, *named) if named else 'no ' + kind}, but the table runs "
                                        f"{Action(kind, *acts[0]) if acts else 'none'}: the arrays must be the table's.")
    held = {space: [{} for _ in range(p)] for space in SPACES}

    def read(space, s, key, t, tag, a, free=True):
        slot = int(arr[key][t, s])
        got = held[space][s].pop(slot, None) if free else held[space][s].get(slot)
        if got != tag:
            raise ScheduleError(f"{a} at tick {t} on stage {s} reads {space} slot {slot} ({key}), which holds "
                                f"{_what(got)}, not {_what(tag)}: a read must find what its action needs.")

    def write(space, s, key, t, tag, who):
        slot = int(arr[key][t, s])
        if slot in held[space][s]:
            raise ScheduleError(f"{who} at tick {t} on stage {s} writes {space} slot {slot} ({key}), which still "
                                f"holds {_what(held[space][s][slot])}, unread: a live slot is overwritten.")
        held[space][s][slot] = tag

    for t, row in enumerate(sc.ticks):
        for s, cell in enumerate(row):  # all reads of the tick first
            for a in cell:
                mb, c, k = a.microbatch, a.chunk, a.kind.lower()
                if a.kind == "F" and c > 0:
                    read("fwd", s, "f_in", t, ("act", mb, c), a)
                elif a.kind in "BI":  # (I keeps the slot for its W)
                    read("stash", s, f"{k}_stash", t, ("stash", mb, c), a, free=a.kind == "B")
                    if c < nc - 1:
                        read("bwd", s, f"{k}_in", t, ("grad", mb, c), a)
                elif a.kind == "W":
                    read("wstash", s, "w_wstash", t, ("wstash", mb, c), a)
                    read("stash", s, "w_stash", t, ("stash", mb, c), a)
        for s, cell in enumerate(row):  # then the actions' writes
            for a in cell:
                if a.kind == "F":
                    write("stash", s, "f_stash", t, ("stash", a.microbatch, a.chunk), a)
                elif a.kind == "I":
                    write("wstash", s, "i_wstash", t, ("wstash", a.microbatch, a.chunk), a)
        arriving = {}  # (receiving stage, key) -> the actions whose message lands there
        for q, cell in enumerate(row):
            for a in cell:
                step = 1 if a.kind == "F" else -1 if a.kind in "BI" else 0
                if step and 0 <= a.chunk + step < nc:
                    to = a.chunk + step
                    arriving.setdefault((sc.stage_of(to), _RECV[step < 0][sc.lane_of(to)]), []).append(a)
        for s in range(p):  # then what the ppermutes deliver, lane by lane
            for space, key, step in (("fwd", "f_recv", 1), ("fwd", "f_recv2", 1), ("bwd", "b_recv", -1),
                                     ("bwd", "b_recv2", -1)):
                sent = arriving.get((s, key), [])
                slot = int(arr[key][t, s])
                if len(sent) > 1:
                    raise ScheduleError(f"{sent[0]} and {sent[1]} at tick {t} both send to stage {s}'s {key} lane: a "
                                        f"lane receives one message per tick.")
                if not sent:
                    if slot != -1:
                        raise ScheduleError(f"to_arrays()[{key!r}] at tick {t}, stage {s} is {slot}, but nothing "
                                            f"arrives there then: it must be -1.")
                    continue
                a = sent[0]
                if slot == -1:
                    raise ScheduleError(f"{a} at tick {t} sends to stage {s}, but {key} there is -1: every "
                                        f"message needs a slot.")
                write(space, s, key, t, ("act" if step > 0 else "grad", a.microbatch, a.chunk + step),
                      f"the message from {a}")
    for space in SPACES:
        for s in range(p):
            for slot, tag in held[space][s].items():
                raise ScheduleError(f"{space} slot {slot} of stage {s} still holds {_what(tag)} after the last "
                                    f"tick: every value written must be read.")


# ---------------------------------------------------------------------------------------------
# Builders: each stage gets a program (its order of actions); `_list_schedule` places every
# action at the first tick its inputs have arrived, in program order.

def _check_sizes(name: str, p: int, m: int, v: int) -> None:
    for what, x in (("stages", p), ("microbatches", m), ("virtual_stages", v)):
        if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1:
            raise ScheduleError(f"{what}={x!r} is not a positive integer: schedule {name!r} needs "
                                f"{what} >= 1; pass a whole number of at least 1.")


def _ready(a: Action, done, last: int) -> bool:
    """Whether `a`'s inputs are there, given the (kind, mb, chunk) that ran in earlier ticks."""
    mb, c = a.microbatch, a.chunk
    if a.kind == "F":
        return c == 0 or ("F", mb, c - 1) in done
    if a.kind == "W":
        return ("I", mb, c) in done
    return ("F", mb, c) in done and (c == last or ("B", mb, c + 1) in done or ("I", mb, c + 1) in done)


def _list_schedule(name: str, p: int, m: int, v: int, programs: Sequence[Sequence[Action]],
                   one_action: bool, placement: str = "interleaved") -> Schedule:
    """Lock-step list scheduling: each tick, every stage runs the head of its program if its inputs
    arrived by the previous tick. With `one_action` a stage runs one action per tick; otherwise its
    F, its B/I and its W streams advance independently, so a tick may hold one of each."""
    if one_action:
        queues = [[deque(prog)] for prog in programs]
    else:
        queues = [[deque(a for a in prog if _LANE[a.kind] == lane) for lane in range(3)] for prog in programs]
    last, done, ticks = p * v - 1, set(), []
    remaining = sum(len(prog) for prog in programs)
    while remaining:
        row = tuple(tuple(q.popleft() for q in qs if q and _ready(q[0], done, last)) for qs in queues)
        ran = [a for cell in row for a in cell]
        if not ran:  # nothing can ever become ready: the programs are inconsistent
            raise ScheduleError(f"{name}: the stage programs deadlock at tick {len(ticks)}, where no stage's next "
                                f"action has its inputs; order each program consistently with the others.")
        done.update((a.kind, a.microbatch, a.chunk) for a in ran)
        remaining -= len(ran)
        ticks.append(row)
    return Schedule(name, p, m, v, tuple(ticks), placement=placement)


def from_programs(name: str, p: int, m: int, programs: Sequence[Sequence[Action]], v: int = 1,
                  one_action: bool = True) -> Schedule:
    """A table from per-stage programs (stage s's actions in the order it runs them), list-scheduled
    into lock-step ticks as the built schedules are (see `_list_schedule`); not validated."""
    _check_sizes(name, p, m, v)
    if len(programs) != p:
        raise ScheduleError(f"{len(programs)} programs for {p} stages; give one program per stage.")
    return _list_schedule(name, p, m, v, programs, one_action)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: all forwards (F of mb j on stage s at tick j+s), then all backwards in reverse stage
    order; one action per stage per tick. 2(m+p-1) ticks; stage s stashes all m microbatches."""
    _check_sizes("gpipe", p, m, 1)
    programs = [[Action("F", j, s) for j in range(m)] + [Action("B", j, s) for j in range(m)]
                for s in range(p)]
    return dataclasses.replace(_list_schedule("gpipe", p, m, 1, programs, one_action=True),
                               declared_stash=(m,) * p)


def _one_f_one_b_order(p: int, m: int, s: int, defer: int) -> list[Action]:
    """Stage s's program in Megatron's 1F1B order with the backward split: min(p-s-1, m) warm-up
    forwards, then F and I alternating, then the remaining I; W(j) right after I(j + defer) (at the
    end where there is none)."""
    warm = min(p - s - 1, m)
    order = [Action("F", j, s) for j in range(warm)]
    for j in range(m - warm):
        order += [Action("F", warm + j, s), Action("I", j, s)]
    order += [Action("I", j, s) for j in range(m - warm, m)]
    prog = []
    for a in order:
        prog.append(a)
        if a.kind == "I" and a.microbatch >= defer:
            prog.append(Action("W", a.microbatch - defer, s))
    return prog + [Action("W", j, s) for j in range(max(0, m - defer), m)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B with Megatron's memory, one action per stage per tick and the backward split: stage s
    runs min(p-s-1, m) warm-up forwards, then F, I, W of one microbatch after another (W right
    after its I), then drains its I and W. Stage s stashes min(m, p-s) microbatches (a slot lives to its W,
    which follows its I); with equal F, I, W costs (B = I + W = 2F) it takes 3m + 2(p-1) ticks of one F each, below
    the lock-step table's (m+p-1)(F+B) = 3(m+p-1), because I sends its gradient before W runs.
    Megatron's fused-B 1F1B under lock-step is `1f1b_one_action` (every tick pays max(F, B)); the
    table that this name meant before, one F and one B per tick and 2(p-s)-1 stashed, is
    `1f1b_lockstep`."""
    _check_sizes("1f1b", p, m, 1)
    programs = [_one_f_one_b_order(p, m, s, defer=0) for s in range(p)]
    return dataclasses.replace(_list_schedule("1f1b", p, m, 1, programs, one_action=True),
                               declared_stash=tuple(min(m, p - s) for s in range(p)))


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the 1F1B order of `1f1b`
    (same warm-up), with stage s deferring each W by s microbatches — W(j) right after I(j+s) —
    so that the last s Ws fill the drain's bubble. With equal F, I, W costs and m >= p it takes
    3m + p - 1 ticks: a bubble of p-1, a third of 1F1B's 3(p-1). A stash slot lives from F to W,
    so stage s holds min(m, p) (stage 0's 1F1B peak, which sizes every stage's buffers in one SPMD
    program: the paper's "same memory as 1F1B"); what W needs is written by I into the slot."""
    _check_sizes("zb_h1", p, m, 1)
    programs = [_one_f_one_b_order(p, m, s, defer=s) for s in range(p)]
    return dataclasses.replace(_list_schedule("zb_h1", p, m, 1, programs, one_action=True),
                               declared_stash=(min(m, p),) * p)


def one_f_one_b_lockstep(p: int, m: int) -> Schedule:
    """Lock-step 1F1B with a fused B (this was `1f1b` before the split backward; kept so that earlier
    benchmarks keep their meaning): stage s runs F of mb j at tick j+s and B of mb j at tick
    j+2p-1-s, so in steady state each tick holds one F and one B. m+2p-1 ticks, time
    (m+p-1)(F+B); stage s stashes min(m, 2(p-s)-1) microbatches (at most 2p-1, whatever m)."""
    _check_sizes("1f1b_lockstep", p, m, 1)
    programs = [[Action(k, j, s) for k in "FB" for j in range(m)] for s in range(p)]
    return dataclasses.replace(_list_schedule("1f1b_lockstep", p, m, 1, programs, one_action=False),
                               declared_stash=tuple(min(m, 2 * (p - s) - 1) for s in range(p)))


def one_f_one_b_one_action(p: int, m: int) -> Schedule:
    """Megatron/PyTorch 1F1B order under lock-step with a fused B, one action per stage per tick:
    stage s runs p-s-1 warm-up forwards, then alternates F and B, then drains its backwards. It
    stashes fewer microbatches than `1f1b_lockstep` (p-s) but every tick costs an F or a B, never
    both at once, and messages wait a tick more, so it takes about twice the ticks."""
    _check_sizes("1f1b_one_action", p, m, 1)
    programs = []
    for s in range(p):
        warm = min(p - s - 1, m)
        prog = [Action("F", j, s) for j in range(warm)]
        for j in range(m - warm):
            prog += [Action("F", warm + j, s), Action("B", j, s)]
        programs.append(prog + [Action("B", j, s) for j in range(m - warm, m)])
    return dataclasses.replace(_list_schedule("1f1b_one_action", p, m, 1, programs, one_action=True),
                               declared_stash=tuple(min(m, p - s) for s in range(p)))


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved lock-step 1F1B (Megatron's virtual stages): chunk c on stage c % p. Microbatches go
    in groups of p; stage s runs the forwards of a group through its local chunk 0, then chunk 1, ...,
    and the backwards in reverse chunk order. Every stage runs an F every tick from tick s for v*m
    ticks, so the bubble with equal costs is (p-1)/(v*m+p-1). A group must hold at least p
    microbatches (the p-1 hops from stage 0 to stage p-1 and back take p ticks), hence m >= p when
    v > 1; with m % p = r != 0 the first group takes p + r, which keeps that bubble but lets stage 0
    buffer up to r+1 activations (stage p-1: r+1 gradients) and stash about 2r more chunk inputs.
    With v = 1 this is `1f1b_lockstep`'s table."""
    _check_sizes("interleaved_1f1b", p, m, v)
    if v > 1 and m < p:
        raise ScheduleError(
            f"microbatches={m} is fewer than stages={p}: interleaved_1f1b needs at least one "
            f"microbatch per stage (gpipe and 1f1b work with any microbatches >= 1); use "
            f"microbatches >= {p}, or virtual_stages=1.")
    sizes = [p] * (m // p) or [m]  # m < p only when v == 1: one group, plain 1F1B
    sizes[0] += m % p if m >= p else 0
    starts = np.cumsum([0] + sizes)
    groups = [range(a, b) for a, b in zip(starts[:-1], starts[1:])]
    programs = []
    for s in range(p):
        fwd = [Action("F", j, k * p + s) for grp in groups for k in range(v) for j in grp]
        bwd = [Action("B", j, k * p + s) for grp in groups for k in reversed(range(v)) for j in grp]
        programs.append(fwd + bwd)
    sched = _list_schedule("interleaved_1f1b", p, m, v, programs, one_action=False)
    return dataclasses.replace(sched, declared_stash=tuple(sched.peak_stash()))  # no closed form with m % p != 0


def _list_schedule_cells(name: str, p: int, m: int, programs) -> Schedule:
    """Lock-step list scheduling of V programs of cells (`vshape`: tuples of (kind, mb, chunk) run in
    one tick): each tick, every stage runs its next cell once all of its inputs have arrived."""
    queues = [deque(tuple(Action(*a) for a in cell) for cell in prog) for prog in programs]
    done, ticks = set(), []
    while any(queues):
        row = tuple(q.popleft() if q and all(_ready(a, done, 2 * p - 1) for a in q[0]) else () for q in queues)
        if not any(row):
            raise ScheduleError(f"{name}: the stage programs deadlock at tick {len(ticks)}, where no stage's next "
                                f"cell has its inputs; order each program consistently with the others.")
        done.update((a.kind, a.microbatch, a.chunk) for cell in row for a in cell)
        ticks.append(row)
    return Schedule(name, p, m, 2, tuple(ticks), placement="v")


def zb_v(p: int, m: int, w_slots: int | None = None) -> Schedule:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6), in torchtitan's order
    (`vshape`): V placement, every backward split into I and W, one action per stage and tick. With
    m >= 2p-1 it takes 6m + p - 1 ticks of half a stage's F, the least of any one-action V table
    (stage p-1 starts at tick p-1); the stash holds at most 2p chunk inputs, p stages' worth: 1F1B's
    stage-0 peak, which sizes every stage's buffer. `w_slots` caps the Ws the drain defers
    (`table.deferred_w_slots`): wstash slots w_slots + 1, a tick more for every two fewer."""
    _check_sizes("zb_v", p, m, 2)
    return dataclasses.replace(_list_schedule_cells("zb_v", p, m, zb_v_programs(p, m, w_slots)),
                               declared_stash=(2 * p,) * p)


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe cut in half; `vshape`): V placement; the main step's ticks each
    run one microbatch's F and another's fused B, so that the one's communication (hops, expert
    all-to-alls) can hide behind the other's computation; warm-up and drain split their backwards,
    the deferred Ws filling bubbles. Published (DualPipe's README): bubble (PP/2-1)(F&B + B - 3W)
    and PP+1 chunks of activations per device, PP = 2p; the stash holds at most 2p + 1."""
    _check_sizes("dualpipe_v", p, m, 2)
    sched = _list_schedule_cells("dualpipe_v", p, m, dualpipe_v_programs(p, m))
    return dataclasses.replace(sched, declared_stash=(2 * p + 1,) * p)


_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "1f1b_lockstep": one_f_one_b_lockstep,
             "1f1b_one_action": one_f_one_b_one_action, "zb_h1": zb_h1}


def build(name: str, p: int, m: int, v: int = 1, w_slots: int | None = None) -> Schedule:
    """The schedule `name` (one of SCHEDULES) for p stages, m microbatches, v chunks per stage;
    `w_slots`: zb_v's cap on deferred Ws (`zb_v`; the others take None)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}: the schedules are {', '.join(SCHEDULES)}; "
                            f"pick one of them.")
    _check_sizes(name, p, m, v)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(p, m, v)
    if name in V_SCHEDULES:
        if v != 2:
            raise ScheduleError(f"virtual_stages={v} does not fit schedule {name!r}: its V placement puts exactly 2 "
                                f"chunks on every stage (s and 2p-1-s); use virtual_stages=2.")
        if p < 2:
            raise ScheduleError(f"stages={p} is too few for schedule {name!r}: a V needs at least 2 stages; use "
                                f"stages >= 2, or '1f1b' on one stage.")
        return zb_v(p, m, w_slots) if name == "zb_v" else dualpipe_v(p, m)
    if v != 1 and name == "zb_h1":
        raise ScheduleError(f"virtual_stages={v} is not built for schedule 'zb_h1' (only its one-chunk-per-stage "
                            f"form is); use virtual_stages=1 with 'zb_h1', or 'interleaved_1f1b' for several chunks "
                            f"per stage.")
    if v != 1:
        raise ScheduleError(f"virtual_stages={v} needs schedule 'interleaved_1f1b', the only one that "
                            f"places several chunks on a stage; use it, or virtual_stages=1 with {name!r}.")
    return _BUILDERS[name](p, m)


def random_table(p: int, m: int, rng: np.random.RandomState | int, split: bool | str = True,
                 v: int = 1, placement: str = "interleaved") -> Schedule:
    """A random table that `validate` accepts, for property tests of the executor: a random
    dependency-respecting order of every action (biased towards forwards or backwards by a random
    amount per table), cut into per-stage programs and list-scheduled into lock-step ticks that
    randomly pack one, two or three actions per stage and tick, and sometimes idle a stage that
    could run. `split`: True, every backward is I then W; False, every backward a fused B;
    "mixed", each (microbatch, chunk) picks at random. `rng`: a numpy RandomState (or a seed).
    `placement="v"` (with v = 2): a random table of the V placement."""
    _check_sizes("random", p, m, v)
    if placement not in PLACEMENTS or (placement == "v" and v != 2):
        raise ScheduleError(f"placement={placement!r} with v={v}: pick 'interleaved', or 'v' with v=2.")
    if split not in (True, False, "mixed"):
        raise ScheduleError(f"split={split!r} is not True, False or 'mixed'; pick one of those.")
    rng = rng if isinstance(rng, np.random.RandomState) else np.random.RandomState(rng)
    nc, last = p * v, p * v - 1
    kind = {(j, c): ("I" if (split is True or (split == "mixed" and rng.rand() < 0.5)) else "B")
            for j in range(m) for c in range(nc)}
    prefer_back = rng.rand()
    avail, order = [Action("F", j, 0) for j in range(m)], []
    while avail:
        backs = [i for i, a in enumerate(avail) if a.kind != "F"]
        pick = backs[rng.randint(len(backs))] if backs and rng.rand() < prefer_back else rng.randint(len(avail))
        a = avail.pop(pick)
        order.append(a)
        j, c = a.microbatch, a.chunk
        if a.kind == "F":
            avail += [Action("F", j, c + 1)] if c < last else [Action(kind[(j, c)], j, c)]
        elif a.kind in "BI":
            avail += [Action("W", j, c)] if a.kind == "I" else []
            avail += [Action(kind[(j, c - 1)], j, c - 1)] if c > 0 else []
    at = Schedule("", p, m, v, (), placement=placement).stage_of
    heads = [deque(a for a in order if at(a.chunk) == s) for s in range(p)]
    pack, idle = rng.rand(), 0.3 * rng.rand()
    done, ticks = set(), []
    while any(heads):
        for force in (False, True):  # a tick where every stage idled at random: run it again, no idling
            row = []
            for q in heads:
                cell, lanes = [], set()
                if force or rng.rand() >= idle:
                    while q and _ready(q[0], done, last) and _LANE[q[0].kind] not in lanes:
                        lanes.add(_LANE[q[0].kind])
                        cell.append(q.popleft())
                        if rng.rand() >= pack:
                            break
                row.append(tuple(cell))
            if any(row):
                break
        else:  # the earliest unplaced action of `order` always has its inputs: cannot happen
            raise RuntimeError("random_table: programs deadlock")
        done.update((a.kind, a.microbatch, a.chunk) for cell in row for a in cell)
        ticks.append(tuple(row))
    return Schedule(f"random_{'split' if split is True else 'fused' if split is False else 'mixed'}", p, m, v,
                    tuple(ticks), placement=placement)


# ---------------------------------------------------------------------------------------------
# Validator.

_RULE = {"F": "F(mb, c) needs F(mb, c-1) at an earlier tick, whose activation arrives one tick later",
         "BI": "a B or I of (mb, c) needs F(mb, c) and the B or I of (mb, c+1) at earlier ticks",
         "W": "W(mb, c) needs I(mb, c) at an earlier tick"}


def validate(schedule: Schedule) -> Schedule:
    """Check `schedule` against the execution model; return it, or raise ScheduleError naming the
    first broken rule: action shape and placement; per stage and tick at most one F, one of B and
    I, one W; every (microbatch, chunk) with exactly one F and either one B or one I and one W;
    every send received; dependency order; no stage stashing more chunk inputs than the table
    declares; and, replayed from `to_arrays()` by `check_slots`, no live slot overwritten and every
    read finding what its action needs."""
    sc, p, m = schedule, schedule.stages, schedule.microbatches
    nc = sc.chunks
    if p < 1 or m < 1 or sc.virtual_stages < 1:
        raise ScheduleError(f"schedule {sc.name!r} has stages={p}, microbatches={m}, "
                            f"virtual_stages={sc.virtual_stages}; all must be >= 1.")
    if sc.placement not in PLACEMENTS or (sc.placement == "v" and sc.virtual_stages != 2):
        raise ScheduleError(f"schedule {sc.name!r} has placement={sc.placement!r} with virtual_stages="
                            f"{sc.virtual_stages}: the placements are 'interleaved' (any v) and 'v' (v = 2 only, "
                            f"chunks s and 2p-1-s on stage s); use one of them.")
    seen: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for t, row in enumerate(sc.ticks):
        if len(row) != p:
            raise ScheduleError(f"tick {t} has {len(row)} stage cells; the schedule has {p} stages.")
        for s, cell in enumerate(row):
            for a in cell:
                if a.kind not in KINDS:
                    raise ScheduleError(f"tick {t}, stage {s}: action kind {a.kind!r} is not one of 'F', 'B', 'I', 'W'.")
                if not 0 <= a.microbatch < m or not 0 <= a.chunk < nc:
                    raise ScheduleError(f"tick {t}, stage {s}: {a} is out of range (microbatches 0..{m - 1}, "
                                        f"chunks 0..{nc - 1}).")
                if sc.stage_of(a.chunk) != s:
                    rule = f"chunk % {p}" if sc.placement != "v" else f"V placement: chunks s and {2 * p - 1}-s on stage s"
                    raise ScheduleError(f"tick {t}: {a} is on stage {s}, but chunk {a.chunk} lives on "
                                        f"stage {sc.stage_of(a.chunk)} ({rule}).")
                seen.setdefault((a.kind, a.microbatch, a.chunk), []).append((t, s))
            for lane, kinds in enumerate(("F", "B or I", "W")):
                here = [a for a in cell if _LANE[a.kind] == lane]
                if len(here) > 1:
                    raise ScheduleError(f"tick {t}, stage {s} runs {', '.join(map(str, here))}: a stage runs at most "
                                        f"one F, one B or I, and one W per tick.")
    for key, where in seen.items():
        if len(where) > 1:
            raise ScheduleError(f"{Action(*key)} runs {len(where)} times (ticks "
                                f"{', '.join(str(t) for t, _ in where)}); it must run exactly once.")
    when = {key: where[0][0] for key, where in seen.items()}
    for mb in range(m):
        for c in range(nc):
            b, i, w = (when.get((k, mb, c)) for k in "BIW")
            if b is not None and i is not None:
                raise ScheduleError(f"{Action('B', mb, c)} at tick {b} and {Action('I', mb, c)} at tick {i} both run; "
                                    f"a backward is either one fused B or one I and one W.")
            if (i is None) != (w is None):
                have, lack = (Action("I", mb, c), "W") if w is None else (Action("W", mb, c), "I")
                raise ScheduleError(f"{have} runs at tick {i if w is None else w} without its {lack}; a split backward "
                                    f"needs one I and one W.")

    def back(mb, c):  # the B or I that sends the gradient of (mb, c) on
        return next(((k, mb, c) for k in "BI" if (k, mb, c) in when), None)

    for (kind, mb, c), t in sorted(when.items(), key=lambda kv: kv[1]):
        if kind == "F" and c + 1 < nc and ("F", mb, c + 1) not in when:
            raise ScheduleError(f"{Action(kind, mb, c)} at tick {t} sends its activation to chunk {c + 1} on stage "
                                f"{sc.stage_of(c + 1)}, but F(mb {mb}, chunk {c + 1}) never runs: a send nobody receives.")
        if kind in "BI" and c > 0 and back(mb, c - 1) is None:
            raise ScheduleError(f"{Action(kind, mb, c)} at tick {t} sends its gradient to chunk {c - 1} on stage "
                                f"{sc.stage_of(c - 1)}, but no B or I of (mb {mb}, chunk {c - 1}) runs: a send nobody receives.")
    for mb in range(m):
        for c in range(nc):
            if ("F", mb, c) not in when:
                raise ScheduleError(f"{Action('F', mb, c)} never runs; every microbatch needs one F and one B (or "
                                    f"one I and one W) on every chunk.")
            if back(mb, c) is None:
                raise ScheduleError(f"{Action('B', mb, c)} never runs (nor an I and a W); every microbatch needs one "
                                    f"F and one B (or one I and one W) on every chunk.")
    for (kind, mb, c), t in when.items():
        if kind == "F":
            need, rule = ([("F", mb, c - 1)] if c > 0 else []), _RULE["F"]
        elif kind == "W":
            need, rule = [("I", mb, c)], _RULE["W"]
        else:
            need, rule = [("F", mb, c)] + ([back(mb, c + 1)] if c < nc - 1 else []), _RULE["BI"]
        for dep in need:
            if when[dep] >= t:
                raise ScheduleError(f"{Action(kind, mb, c)} runs at tick {t}, on stage {sc.stage_of(c)}, but its input from "
                                    f"{Action(*dep)} (tick {when[dep]}) arrives only at tick {when[dep] + 1}: "
                                    f"dependency order is broken ({rule}).")
    if sc.declared_stash is not None:
        for stage, (held, promised) in enumerate(zip(sc.peak_stash(), sc.declared_stash)):
            if held > promised:
                raise ScheduleError(f"stage {stage} holds {held} stashed chunk inputs at its peak, more than "
                                    f"the {promised} the table declares; declare {held} or reorder the table.")
    check_slots(sc)
    return sc

