"""The simulator of pipeline schedule tables (`simulate`, `Simulation`, `action_costs`) and the
closed-form bubbles (`ideal_bubble`). Plain Python and numpy; its names are also
`jaxpar.parallel.pipeline.schedules`' (where they lived first)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np

from jaxpar.parallel.pipeline.schedules import Schedule, ScheduleError


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What a schedule costs. Times are in units of one stage's F (f_cost) of all its layers: a chunk
    costs 1/v of that. bubble_fraction = idle stage-time / all stage-time; bubble_over_ideal =
    idle stage-time / busy stage-time (Megatron's idle / ideal, (p-1)/m for 1F1B)."""
    total_time: float
    bubble_fraction: float
    tick_times: tuple[float, ...]
    peak_stash: tuple[int, ...]
    peak_buffered: tuple[tuple[int, int], ...]
    bytes_per_tick: tuple[int, ...] | None
    bubble_over_ideal: float = 0.0
    peak_wstash: tuple[int, ...] = ()
    costs: tuple[tuple[str, float], ...] = ()  # (kind, cost of one stage's layers) for F, B, I, W


def action_costs(f_cost: float = 1.0, b_cost: float | None = None, i_cost: float | None = None,
                 w_cost: float | None = None) -> dict[str, float]:
    """The cost of each action kind (of one stage's layers): F = f_cost; I and W = i_cost, w_cost,
    or half of b_cost each where b_cost alone is given, or 1; B = b_cost, or I + W where it is not
    given. With b_cost and one of i_cost / w_cost, the other is the rest of b_cost."""
    if b_cost is None:
        i = 1.0 if i_cost is None else i_cost
        w = 1.0 if w_cost is None else w_cost
        b = i + w
    else:
        b = b_cost
        i = b / 2 if i_cost is None and w_cost is None else b - w_cost if i_cost is None else i_cost
        w = b - i if w_cost is None else w_cost
    costs = {"F": float(f_cost), "B": float(b), "I": float(i), "W": float(w)}
    if any(x < 0 for x in costs.values()):
        raise ScheduleError(f"action costs {costs} include a negative one; pass costs >= 0 (and b_cost >= the "
                            f"given i_cost or w_cost).")
    return costs


def simulate(schedule: Schedule, f_cost: float = 1.0, b_cost: float | None = None,
             activation_bytes: int | None = None, *, i_cost: float | None = None,
             w_cost: float | None = None) -> Simulation:
    """Cost `schedule`: each tick takes the slowest stage's summed work, cost/v per action of each
    kind (`action_costs`: F 1, I 1, W 1, B = I + W = 2 by default; b_cost alone splits evenly into I
    and W). Idle time of a stage in a tick is the tick time minus its own work. With
    `activation_bytes` (one message), bytes_per_tick counts the F and B / I sends that cross stages
    in each tick."""
    costs = action_costs(f_cost, b_cost, i_cost, w_cost)
    v, p = schedule.virtual_stages, schedule.stages
    work = np.zeros((schedule.num_ticks(), p))
    sends = np.zeros(schedule.num_ticks(), np.int64)
    for t, s, a in schedule.actions():
        work[t, s] += costs[a.kind] / v
        nxt = a.chunk + 1 if a.kind == "F" else a.chunk - 1
        if a.kind != "W" and 0 <= nxt < schedule.chunks and schedule.stage_of(nxt) != s:
            sends[t] += 1
    tick_times = work.max(axis=1, initial=0.0)
    total = float(tick_times.sum())
    busy = float(work.sum())
    idle = p * total - busy
    return Simulation(
        total_time=total, bubble_fraction=idle / (p * total) if total > 0 else 0.0,
        tick_times=tuple(float(x) for x in tick_times),
        peak_stash=tuple(schedule.peak_stash()), peak_buffered=tuple(schedule.peak_buffered()),
        bytes_per_tick=None if activation_bytes is None else tuple(int(n) * activation_bytes for n in sends),
        bubble_over_ideal=idle / busy if busy > 0 else 0.0, peak_wstash=tuple(schedule.peak_wstash()),
        costs=tuple(costs.items()))


def ideal_bubble(name: str, p: int, m: int, v: int = 1) -> Fraction:
    """Closed-form bubble, as idle / all stage-time, with every action of the table costing the
    same (F = B for the fused tables, F = I = W for the split ones): (p-1)/(m+p-1) for gpipe and
    1f1b_lockstep, (p-1)/(v*m+p-1) for interleaved_1f1b, 2(p-1)/(3m+2(p-1)) for 1f1b and
    (p-1)/(3m+p-1) for zb_h1 (m >= p; with m < p, k/(3m+k) for k = 2p-1-m), (p-1)/(6m+p-1) for zb_v
    (m >= 2p-1). Megatron's figure is
    idle / ideal time, (p-1)/m for 1F1B; this is not it. 1f1b_one_action has no closed form here:
    simulate it."""
    if name in ("gpipe", "1f1b_lockstep"):
        return Fraction(p - 1, m + p - 1)
    if name == "interleaved_1f1b":
        return Fraction(p - 1, v * m + p - 1)
    if name == "1f1b":
        return Fraction(2 * (p - 1), 3 * m + 2 * (p - 1))
    if name == "zb_h1":  # fewer microbatches than stages leave part of the drain unfilled
        idle = max(p - 1, 2 * p - 1 - m)
        return Fraction(idle, 3 * m + idle)
    if name == "zb_v" and m >= 2 * p - 1:  # (fewer microbatches: simulate it)
        # 6m ticks of half a stage's F per stage, plus the p-1 of the last stage's start: the least
        # any table of this placement takes (the paper's "zero" leaves out that skew, which a step
        # that starts and ends all stages together cannot).
        return Fraction(p - 1, 6 * m + p - 1)
    raise ScheduleError(f"no closed-form bubble for schedule {name!r}: it is known for gpipe, 1f1b, 1f1b_lockstep, "
                        f"interleaved_1f1b and zb_h1; use simulate() for the others.")
