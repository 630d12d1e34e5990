"""A schedule table's timeline: text (one row per stage, one column per tick) and PNG (matplotlib),
with the simulator's bubble and peak stash (`jaxpar.parallel.pipeline.simulate`). Plain Python
and numpy, as the tables are; `python -m jaxpar.schedules` prints and draws them."""

from __future__ import annotations

from jaxpar.parallel.pipeline.schedules import KINDS, Action, Schedule, ScheduleError
from jaxpar.parallel.pipeline.simulate import ideal_bubble, simulate


def _cell(schedule: Schedule, cell: tuple[Action, ...]) -> str:
    if not cell:
        return "·"
    suffix = (lambda a: chr(ord("a") + a.chunk // schedule.stages)) if schedule.virtual_stages > 1 else (lambda a: "")
    return "".join(f"{a.kind}{a.microbatch}{suffix(a)}" for a in sorted(cell, key=lambda a: KINDS.index(a.kind)))


def render_text(schedule: Schedule, f_cost: float = 1.0, b_cost: float | None = None,
                activation_bytes: int | None = None, *, i_cost: float | None = None,
                w_cost: float | None = None) -> str:
    """The table as text: a header of tick numbers, one row per stage (`stage s |` then one cell per
    tick: "F3", "B1", "I2", "W0", "F3B1", idle "·"; with v > 1 a letter names the local chunk,
    "F3a"), then the simulator's figures (costs as in `simulate`)."""
    sc = schedule
    cells = [[_cell(sc, cell) for cell in row] for row in sc.ticks]
    width = max([len(c) for row in cells for c in row] + [len(str(sc.num_ticks() - 1)), 1])
    label = len(f"stage {sc.stages - 1}")
    lines = [" " * label + " | " + " ".join(str(t).rjust(width) for t in range(sc.num_ticks()))]
    for s in range(sc.stages):
        lines.append(f"stage {s}".ljust(label) + " | " + " ".join(row[s].rjust(width) for row in cells))
    sim = simulate(sc, f_cost, b_cost, activation_bytes, i_cost=i_cost, w_cost=w_cost)
    costs = dict(sim.costs)
    split = sc.split
    head = f"{sc.name}: p={sc.stages} m={sc.microbatches}" + (f" v={sc.virtual_stages}" if sc.virtual_stages > 1 else "")
    shown = ", ".join(f"{k}={costs[k]:g}" for k in (("F", "I", "W") if split else ("F", "B")))
    try:
        closed = float(ideal_bubble(sc.name, sc.stages, sc.microbatches, sc.virtual_stages))
        closed = f"; closed form at equal costs per action: {closed:.1%}"
    except ScheduleError:
        closed = ""
    lines += [
        f"{head}, {sc.num_ticks()} ticks; time {sim.total_time:g} ({shown} per stage's layers; each tick "
        f"takes its slowest stage)",
        f"bubble {sim.bubble_fraction:.1%} (idle / all stage-time), {sim.bubble_over_ideal:.1%} (idle / ideal, "
        f"Megatron's){closed}",
        f"peak stash per stage: {list(sim.peak_stash)}",
    ]
    if split:
        lines.append(f"peak wstash per stage: {list(sim.peak_wstash)}")
    lines.append(f"peak buffered (activations, gradients) per stage: {[tuple(x) for x in sim.peak_buffered]}")
    if sim.bytes_per_tick is not None:
        lines.append(f"bytes sent: {sum(sim.bytes_per_tick):,} in all, at most {max(sim.bytes_per_tick, default=0):,} per tick")
    return "\n".join(lines)


def render_png(schedule: Schedule, path: str) -> None:
    """Draw the table as the classic pipeline figure: one row per stage, a box per action (F blue,
    B green, I orange, W purple, darker for later local chunks; a tick with several actions is split
    into bands, in the order F, B, I, W). Needs matplotlib."""
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
    shades = {"F": plt.get_cmap("Blues"), "B": plt.get_cmap("Greens"), "I": plt.get_cmap("Oranges"),
              "W": plt.get_cmap("Purples")}
    for t, row in enumerate(sc.ticks):
        for s, cell in enumerate(row):
            h = 1.0 / max(1, len(cell))
            for n, a in enumerate(sorted(cell, key=lambda a: KINDS.index(a.kind))):
                y0 = s + n * h
                k = a.chunk // sc.stages
                color = shades[a.kind](0.45 + 0.4 * k / max(1, sc.virtual_stages - 1))
                ax.add_patch(Rectangle((t, y0), 1, h, facecolor=color, edgecolor="white", linewidth=0.8))
                ax.text(t + 0.5, y0 + h / 2, str(a.microbatch), ha="center", va="center",
                        fontsize=8 if len(cell) == 1 else 6 if len(cell) == 2 else 5, color="white")
    ax.set_xlim(0, sc.num_ticks())
    ax.set_ylim(sc.stages, 0)
    ax.set_yticks([s + 0.5 for s in range(sc.stages)], [f"stage {s}" for s in range(sc.stages)])
    ax.set_xlabel("tick    (F blue, B green, I orange, W purple, darker for later chunks; numbers are microbatches)")
    sim = simulate(sc, 1.0, 1.0) if not sc.split else simulate(sc)
    ax.set_title(f"{sc.name}: p={sc.stages}, m={sc.microbatches}, v={sc.virtual_stages}; "
                 f"bubble {sim.bubble_fraction:.1%} (equal costs per action, idle / all)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
