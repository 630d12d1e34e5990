"""Pipeline schedules as data: tables `tick x stage -> actions`, built in plain Python, checked by
`validate` and costed by `simulate` (bubble, stashed activations, buffered messages, bytes sent).
No JAX here: the pipeline executor runs any table that `validate` accepts.

Execution model (lock-step SPMD): all stages run tick t together, then one forward and one
backward `ppermute` move each message one hop. So F(mb, c) may run at tick t only if F(mb, c-1)
ran at a tick <= t-1, and B(mb, c) only if F(mb, c) and (c < last chunk) B(mb, c+1) ran at a tick
<= t-1. Chunk c (in model order, 0..p*v-1) lives on stage c % p (Megatron's interleaved placement).

Bubble fraction everywhere here is idle stage-time / all stage-time, (p-1)/(m+p-1) for GPipe and
1F1B with equal costs; Megatron's papers divide idle by ideal time instead, (p-1)/m.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from fractions import Fraction
from typing import Iterator, Sequence

import numpy as np

from jaxpar.config import JaxparError

SCHEDULES = ("gpipe", "1f1b", "1f1b_one_action", "interleaved_1f1b")


class ScheduleError(JaxparError, ValueError):
    """A schedule that cannot be built from the given sizes, or a table that breaks the rules."""


@dataclasses.dataclass(frozen=True)
class Action:
    """`kind` "F" (forward of `microbatch` through `chunk`) or "B" (backward to the chunk input,
    weight gradients included); `chunk` is the global chunk index 0..p*v-1 in model order."""
    kind: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}(mb {self.microbatch}, chunk {self.chunk})"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`ticks[t][s]`: the actions of stage s in tick t, at most one F and at most one B."""
    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    ticks: tuple[tuple[tuple[Action, ...], ...], ...]
    # The most chunk inputs each stage may hold stashed, as the schedule promises it (the
    # executor allocates that many slots; `validate` checks the table keeps the promise).
    declared_stash: tuple[int, ...] | None = None

    def stage_of(self, chunk: int) -> int:
        return chunk % self.stages

    def num_ticks(self) -> int:
        return len(self.ticks)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual_stages

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
        """The table for the executor: int32 arrays [num_ticks, stages] named f_valid, f_mb, f_chunk,
        b_valid, b_mb, b_chunk; chunks are LOCAL to the stage (chunk // stages), 0 where not valid."""
        shape = (self.num_ticks(), self.stages)
        out = {f"{k}_{f}": np.zeros(shape, np.int32) for k in "fb" for f in ("valid", "mb", "chunk")}
        for t, s, a in self.actions():
            k = a.kind.lower()
            out[f"{k}_valid"][t, s] = 1
            out[f"{k}_mb"][t, s] = a.microbatch
            out[f"{k}_chunk"][t, s] = a.chunk // self.stages
        return out

    def peak_stash(self) -> list[int]:
        """Per stage: the most (microbatch, chunk) whose F has run and whose B has not, over ticks
        (an F counts from the end of its tick, a B releases at the end of its tick): the chunk
        inputs (or activations) the stage keeps."""
        delta = np.zeros((self.num_ticks() + 1, self.stages), np.int64)
        for t, s, a in self.actions():
            delta[t, s] += 1 if a.kind == "F" else -1
        return [int(x) for x in np.cumsum(delta, axis=0).max(axis=0, initial=0)]

    def peak_buffered(self) -> list[tuple[int, int]]:
        """Per stage, (activations, gradients): the most messages received and not yet consumed at
        the end of a tick (after its ppermute). A message consumed in the very next tick counts 1 —
        it is the receive slot itself — so a peak of 1 means one receive register is enough.
        F of the last chunk and B of chunk 0 send nothing."""
        times, p, last = self.times(), self.stages, self.chunks - 1
        delta = np.zeros((self.num_ticks() + 1, p, 2), np.int64)
        for (kind, mb, c), t in times.items():
            nxt = c + 1 if kind == "F" else c - 1
            if not 0 <= nxt <= last or (kind, mb, nxt) not in times:
                continue
            lane = 0 if kind == "F" else 1
            delta[t, nxt % p, lane] += 1
            delta[times[(kind, mb, nxt)], nxt % p, lane] -= 1
        peak = np.cumsum(delta, axis=0).max(axis=0, initial=0)
        return [(int(f), int(b)) for f, b in peak]


# ---------------------------------------------------------------------------------------------
# Builders: each stage gets a program (its order of F and B); `_list_schedule` places every
# action at the first tick its inputs have arrived, in program order.

def _check_sizes(name: str, p: int, m: int, v: int) -> None:
    for what, x in (("stages", p), ("microbatches", m), ("virtual_stages", v)):
        if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1:
            raise ScheduleError(f"{what}={x!r} is not a positive integer: schedule {name!r} needs "
                                f"{what} >= 1; pass a whole number of at least 1.")


def _list_schedule(name: str, p: int, m: int, v: int, programs: Sequence[Sequence[Action]],
                   one_action: bool) -> Schedule:
    """Lock-step list scheduling: each tick, every stage runs the head of its program if its inputs
    arrived by the previous tick. With `one_action` a stage runs one action per tick; otherwise its
    F and B streams advance independently, so a tick may hold one F and one B."""
    if one_action:
        queues = [[deque(prog)] for prog in programs]
    else:
        queues = [[deque(a for a in prog if a.kind == k) for k in "FB"] for prog in programs]
    last, done, ticks = p * v - 1, set(), []
    remaining = sum(len(prog) for prog in programs)

    def ready(a: Action) -> bool:
        if a.kind == "F":
            return a.chunk == 0 or ("F", a.microbatch, a.chunk - 1) in done
        return ("F", a.microbatch, a.chunk) in done and (
            a.chunk == last or ("B", a.microbatch, a.chunk + 1) in done)

    while remaining:
        row = tuple(tuple(q.popleft() for q in qs if q and ready(q[0])) for qs in queues)
        ran = [a for cell in row for a in cell]
        if not ran:  # nothing can ever become ready: the programs are inconsistent
            raise RuntimeError(f"{name}: stage programs deadlock at tick {len(ticks)}")
        done.update((a.kind, a.microbatch, a.chunk) for a in ran)
        remaining -= len(ran)
        ticks.append(row)
    return Schedule(name, p, m, v, tuple(ticks))


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: all forwards (F of mb j on stage s at tick j+s), then all backwards in reverse stage
    order; one action per stage per tick. 2(m+p-1) ticks; stage s stashes all m microbatches."""
    _check_sizes("gpipe", p, m, 1)
    programs = [[Action("F", j, s) for j in range(m)] + [Action("B", j, s) for j in range(m)]
                for s in range(p)]
    return dataclasses.replace(_list_schedule("gpipe", p, m, 1, programs, one_action=True),
                               declared_stash=(m,) * p)


def one_f_one_b(p: int, m: int) -> Schedule:
    """Lock-step 1F1B: stage s runs F of mb j at tick j+s and B of mb j at tick j+2p-1-s, so in
    steady state each tick holds one F and one B. m+2p-1 ticks, time (m+p-1)(F+B); stage s stashes
    min(m, 2(p-s)-1) microbatches (at most 2p-1, whatever m)."""
    _check_sizes("1f1b", p, m, 1)
    programs = [[Action(k, j, s) for k in "FB" for j in range(m)] for s in range(p)]
    return dataclasses.replace(_list_schedule("1f1b", p, m, 1, programs, one_action=False),
                               declared_stash=tuple(min(m, 2 * (p - s) - 1) for s in range(p)))


def one_f_one_b_one_action(p: int, m: int) -> Schedule:
    """Megatron/PyTorch 1F1B order under lock-step, one action per stage per tick: stage s runs
    p-s-1 warm-up forwards, then alternates F and B, then drains its backwards. It stashes fewer
    microbatches than `one_f_one_b` (p-s) but every tick costs an F or a B, never both at once,
    and messages wait a tick more, so it takes about twice the ticks."""
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
    buffer up to r+1 activations (stage p-1: r+1 gradients) and stash about 2r more chunk inputs."""
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


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `name` (one of SCHEDULES) for p stages, m microbatches, v chunks per stage."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}: the schedules are {', '.join(SCHEDULES)}; "
                            f"pick one of them.")
    _check_sizes(name, p, m, v)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(p, m, v)
    if v != 1:
        raise ScheduleError(f"virtual_stages={v} needs schedule 'interleaved_1f1b', the only one that "
                            f"places several chunks on a stage; use it, or virtual_stages=1 with {name!r}.")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "1f1b_one_action": one_f_one_b_one_action}[name](p, m)


# ---------------------------------------------------------------------------------------------
# Validator.

def validate(schedule: Schedule) -> Schedule:
    """Check `schedule` against the execution model; return it, or raise ScheduleError naming the
    first broken rule: action shape and placement, one F and one B per stage per tick, every
    (microbatch, chunk) with exactly one F and one B, every send received, dependency order, and
    no stage stashing more chunk inputs than the table declares."""
    sc, p, m = schedule, schedule.stages, schedule.microbatches
    nc = sc.chunks
    if p < 1 or m < 1 or sc.virtual_stages < 1:
        raise ScheduleError(f"schedule {sc.name!r} has stages={p}, microbatches={m}, "
                            f"virtual_stages={sc.virtual_stages}; all must be >= 1.")
    seen: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for t, row in enumerate(sc.ticks):
        if len(row) != p:
            raise ScheduleError(f"tick {t} has {len(row)} stage cells; the schedule has {p} stages.")
        for s, cell in enumerate(row):
            for a in cell:
                if a.kind not in ("F", "B"):
                    raise ScheduleError(f"tick {t}, stage {s}: action kind {a.kind!r} is neither 'F' nor 'B'.")
                if not 0 <= a.microbatch < m or not 0 <= a.chunk < nc:
                    raise ScheduleError(f"tick {t}, stage {s}: {a} is out of range (microbatches 0..{m - 1}, "
                                        f"chunks 0..{nc - 1}).")
                if sc.stage_of(a.chunk) != s:
                    raise ScheduleError(f"tick {t}: {a} is on stage {s}, but chunk {a.chunk} lives on "
                                        f"stage {sc.stage_of(a.chunk)} (chunk % {p}).")
                seen.setdefault((a.kind, a.microbatch, a.chunk), []).append((t, s))
            for kind in "FB":
                if sum(a.kind == kind for a in cell) > 1:
                    raise ScheduleError(f"tick {t}, stage {s} runs {sum(a.kind == kind for a in cell)} "
                                        f"{kind} actions; a stage runs at most one F and one B per tick.")
    for key, where in seen.items():
        if len(where) > 1:
            raise ScheduleError(f"{Action(*key)} runs {len(where)} times (ticks "
                                f"{', '.join(str(t) for t, _ in where)}); it must run exactly once.")
    when = {key: where[0][0] for key, where in seen.items()}
    for (kind, mb, c), t in sorted(when.items(), key=lambda kv: kv[1]):
        nxt = c + 1 if kind == "F" else c - 1
        if 0 <= nxt < nc and (kind, mb, nxt) not in when:
            what = "activation" if kind == "F" else "gradient"
            raise ScheduleError(f"{Action(kind, mb, c)} at tick {t} sends its {what} to chunk {nxt} on "
                                f"stage {nxt % p}, but {Action(kind, mb, nxt)} never runs: a send nobody receives.")
    for mb in range(m):
        for c in range(nc):
            for kind in "FB":
                if (kind, mb, c) not in when:
                    raise ScheduleError(f"{Action(kind, mb, c)} never runs; every microbatch needs one F "
                                        f"and one B on every chunk.")
    for (kind, mb, c), t in when.items():
        need = [("F", mb, c - 1)] if kind == "F" and c > 0 else []
        if kind == "B":
            need = [("F", mb, c)] + ([("B", mb, c + 1)] if c < nc - 1 else [])
        for dep in need:
            if when[dep] >= t:
                raise ScheduleError(f"{Action(kind, mb, c)} runs at tick {t}, but its input from "
                                    f"{Action(*dep)} (tick {when[dep]}) arrives only at tick "
                                    f"{when[dep] + 1}: dependency order is broken.")
    if sc.declared_stash is not None:
        for stage, (held, promised) in enumerate(zip(sc.peak_stash(), sc.declared_stash)):
            if held > promised:
                raise ScheduleError(f"stage {stage} holds {held} stashed chunk inputs at its peak, more than "
                                    f"the {promised} the table declares; declare {held} or reorder the table.")
    return sc


# ---------------------------------------------------------------------------------------------
# Simulator.

@dataclasses.dataclass(frozen=True)
class Simulation:
    """What a schedule costs. Times are in units of one stage's F (f_cost) of all its layers: a chunk
    costs 1/v of that. bubble_fraction = idle stage-time / all stage-time (not Megatron's idle/ideal)."""
    total_time: float
    bubble_fraction: float
    tick_times: tuple[float, ...]
    peak_stash: tuple[int, ...]
    peak_buffered: tuple[tuple[int, int], ...]
    bytes_per_tick: tuple[int, ...] | None


def simulate(schedule: Schedule, f_cost: float = 1.0, b_cost: float = 2.0,
             activation_bytes: int | None = None) -> Simulation:
    """Cost `schedule`: each tick takes the slowest stage's work, f_cost/v per F and b_cost/v per B.
    Idle time of a stage in a tick is the tick time minus its own work. With `activation_bytes` (one
    message), bytes_per_tick counts the F and B sends that cross stages in each tick."""
    v, p = schedule.virtual_stages, schedule.stages
    work = np.zeros((schedule.num_ticks(), p))
    sends = np.zeros(schedule.num_ticks(), np.int64)
    for t, s, a in schedule.actions():
        work[t, s] += (f_cost if a.kind == "F" else b_cost) / v
        nxt = a.chunk + 1 if a.kind == "F" else a.chunk - 1
        if 0 <= nxt < schedule.chunks and nxt % p != s:
            sends[t] += 1
    tick_times = work.max(axis=1, initial=0.0)
    total = float(tick_times.sum())
    busy = float(work.sum())
    bubble = (p * total - busy) / (p * total) if total > 0 else 0.0
    return Simulation(
        total_time=total, bubble_fraction=bubble, tick_times=tuple(float(x) for x in tick_times),
        peak_stash=tuple(schedule.peak_stash()), peak_buffered=tuple(schedule.peak_buffered()),
        bytes_per_tick=None if activation_bytes is None else tuple(int(n) * activation_bytes for n in sends))


def ideal_bubble(name: str, p: int, m: int, v: int = 1) -> Fraction:
    """Closed-form bubble with equal F and B costs, as idle / all stage-time: (p-1)/(m+p-1) for gpipe
    and 1f1b, (p-1)/(v*m+p-1) for interleaved_1f1b. Megatron's figure is
    idle / ideal time, (p-1)/m; this is not it. 1f1b_one_action has no closed form here: simulate it."""
    if name in ("gpipe", "1f1b"):
        return Fraction(p - 1, m + p - 1)
    if name == "interleaved_1f1b":
        return Fraction(p - 1, v * m + p - 1)
    raise ScheduleError(f"no closed-form bubble for schedule {name!r}: it is known for gpipe, 1f1b and "
                        f"interleaved_1f1b; use simulate() for the others.")


# ---------------------------------------------------------------------------------------------
# Rendering.

def _cell(schedule: Schedule, cell: tuple[Action, ...]) -> str:
    if not cell:
        return "·"
    suffix = (lambda a: chr(ord("a") + a.chunk // schedule.stages)) if schedule.virtual_stages > 1 else (lambda a: "")
    return "".join(f"{a.kind}{a.microbatch}{suffix(a)}" for a in sorted(cell, key=lambda a: a.kind != "F"))


def render_text(schedule: Schedule, f_cost: float = 1.0, b_cost: float = 2.0,
                activation_bytes: int | None = None) -> str:
    """The table as text: a header of tick numbers, one row per stage (`stage s |` then one cell per
    tick: "F3", "B1", "F3B1", idle "·"; with v > 1 a letter names the local chunk, "F3a"), then the
    simulator's figures."""
    sc = schedule
    cells = [[_cell(sc, cell) for cell in row] for row in sc.ticks]
    width = max([len(c) for row in cells for c in row] + [len(str(sc.num_ticks() - 1)), 1])
    label = len(f"stage {sc.stages - 1}")
    lines = [" " * label + " | " + " ".join(str(t).rjust(width) for t in range(sc.num_ticks()))]
    for s in range(sc.stages):
        lines.append(f"stage {s}".ljust(label) + " | " + " ".join(row[s].rjust(width) for row in cells))
    sim = simulate(sc, f_cost, b_cost, activation_bytes)
    head = f"{sc.name}: p={sc.stages} m={sc.microbatches}" + (f" v={sc.virtual_stages}" if sc.virtual_stages > 1 else "")
    lines += [
        f"{head}, {sc.num_ticks()} ticks; time {sim.total_time:g} (F={f_cost:g}, B={b_cost:g} per stage's "
        f"layers; each tick takes its slowest stage)",
        f"bubble {sim.bubble_fraction:.1%} (idle / all stage-time"
        + (f"; closed form for equal F and B costs: {float(ideal_bubble(sc.name, sc.stages, sc.microbatches, sc.virtual_stages)):.1%}"
           if sc.name != "1f1b_one_action" else "") + ")",
        f"peak stash per stage: {list(sim.peak_stash)}",
        f"peak buffered (activations, gradients) per stage: {[tuple(x) for x in sim.peak_buffered]}",
    ]
    if sim.bytes_per_tick is not None:
        lines.append(f"bytes sent: {sum(sim.bytes_per_tick):,} in all, at most {max(sim.bytes_per_tick, default=0):,} per tick")
    return "\n".join(lines)


def render_png(schedule: Schedule, path: str) -> None:
    """Draw the table as the classic pipeline figure: one row per stage, a box per action (F blue,
    B green, darker for later local chunks; a tick with both is split, F above B). Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise ScheduleError(f"render_png needs matplotlib, which is not installed ({e}); "
                            f"pip install 'jaxpar[plot]'.") from None
    sc = schedule
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * sc.num_ticks() + 1.5), 0.5 * sc.stages + 1.2))
    shades = {"F": plt.get_cmap("Blues"), "B": plt.get_cmap("Greens")}
    for t, s, a in sc.actions():
        cell = sc.ticks[t][s]
        both = len(cell) > 1
        y0 = s + (0.5 if both and a.kind == "B" else 0.0)
        h = 0.5 if both else 1.0
        k = a.chunk // sc.stages
        color = shades[a.kind](0.45 + 0.4 * k / max(1, sc.virtual_stages - 1))
        ax.add_patch(Rectangle((t, y0), 1, h, facecolor=color, edgecolor="white", linewidth=0.8))
        ax.text(t + 0.5, y0 + h / 2, str(a.microbatch), ha="center", va="center",
                fontsize=6 if both else 8, color="white")
    ax.set_xlim(0, sc.num_ticks())
    ax.set_ylim(sc.stages, 0)
    ax.set_yticks([s + 0.5 for s in range(sc.stages)], [f"stage {s}" for s in range(sc.stages)])
    ax.set_xlabel("tick    (F blue, B green, darker for later chunks; numbers are microbatches)")
    sim = simulate(sc, 1.0, 1.0)
    ax.set_title(f"{sc.name}: p={sc.stages}, m={sc.microbatches}, v={sc.virtual_stages}; "
                 f"bubble {sim.bubble_fraction:.1%} (equal F and B costs, idle / all)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
