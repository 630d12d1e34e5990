"""The stage programs of the V-shape schedules (placement "v": stage s holds chunks s and 2p-1-s,
v = 2), which `jaxpar.parallel.pipeline.schedules` list-schedules into lock-step ticks (`zb_v`,
`dualpipe_v`). Plain Python, importing nothing of jaxpar: a program is a list of cells, each a
tuple of actions (kind, microbatch, chunk) run in one tick.

- `zb_v`: Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), section 6, the ZB-V schedule,
  in the order torchtitan's `ScheduleZBVZeroBubble` gives each rank: warm-up forwards down the V,
  then F, I, W of the first chunk and F, I, W of the second in turn, W deferred in the drain. One
  action per stage and tick; every backward split into I and W.
- `dualpipe_v`: DeepSeek's DualPipeV (DualPipe cut in half; github.com/deepseek-ai/DualPipe,
  `dualpipev.py`, and torchtitan's `ScheduleDualPipeV`): its steps 1-8 per rank, where the main
  step's ticks run one microbatch's F and another's fused B together (`F&B`), and the warm-up's and
  drain's backwards are split, their W deferred into the bubbles.

Both are defined for m >= 2p (zb_v: 2p-1) microbatches; with fewer, each builds the table for that
many and drops the microbatches past m (what torchtitan does for ZB-V): every dependency is within
a microbatch, so the rest stays a valid order.
"""

from __future__ import annotations

from collections import deque

V_SCHEDULES = ("zb_v", "dualpipe_v")
Cell = tuple  # of (kind, microbatch, chunk)


def _keep(programs, m: int) -> list[list[Cell]]:
    """The programs without the microbatches >= m (a cell left empty is dropped)."""
    out = []
    for prog in programs:
        cells = (tuple(a for a in cell if a[1] < m) for cell in prog)
        out.append([cell for cell in cells if cell])
    return out


def _zb_v_program(p: int, n: int, r: int, w_slots: int | None = None) -> list[Cell]:
    """Rank r's ZB-V order for n >= 2p-1 microbatches, one action per cell. With `w_slots`, the
    drain defers at most that many Ws at a time (each I beyond runs its oldest pending W at once):
    fewer (input, output cotangent) pairs held for W, a tick of bubble more per two fewer."""
    c0, c1 = r, 2 * p - 1 - r
    count = {key: 0 for key in ((k, c) for k in "FIW" for c in (c0, c1))}
    prog = []
    pending: deque[int] = deque()  # the chunks whose deferred W has not run, oldest first

    def add(kind, c):
        prog.append(((kind, count[(kind, c)], c),))
        count[(kind, c)] += 1

    def deferred_i(c):
        add("I", c)
        pending.append(c)
        while w_slots is not None and len(pending) > w_slots:
            add("W", pending.popleft())

    for _ in range(2 * (p - r) - 1):  # warm-up: the first chunk's forwards down the V
        add("F", c0)
    for _ in range(r):
        add("F", c1)
        add("F", c0)
    for _ in range(p - r):  # the second chunk's first backwards, W at once
        add("F", c1)
        add("I", c1)
        add("W", c1)
    while count[("F", c1)] < count[("F", c0)] or count[("F", c0)] < n:  # steady state
        if count[("F", c0)] < n:
            add("F", c0)
        add("I", c0)
        add("W", c0)
        add("F", c1)
        add("I", c1)
        add("W", c1)
    for _ in range(r):  # drain: input gradients first, weight gradients deferred
        deferred_i(c0)
        deferred_i(c1)
    for _ in range(p - r):
        add("I", c0)
        add("W", c0)
    for c in sorted(pending, key=lambda c: c != c1):  # the second chunk's Ws, then the first's
        add("W", c)
    return prog


def zb_v_programs(p: int, m: int, w_slots: int | None = None) -> list[list[Cell]]:
    """Every rank's ZB-V program for m microbatches (built for max(m, 2p-1), the rest dropped)."""
    return _keep([_zb_v_program(p, max(2 * p - 1, m), r, w_slots) for r in range(p)], m)


def _dualpipe_v_program(p: int, n: int, r: int) -> list[Cell]:
    """Rank r's DualPipeV order for n >= 2p microbatches (DualPipe's `dualpipev.py`, steps 1-8):
    cells of one action, or of one F and one fused B run together (`F&B`)."""
    c0, c1 = r, 2 * p - 1 - r
    count: dict[tuple[str, int], int] = {}
    pending: deque[tuple[int, int]] = deque()  # (chunk, mb) of the Is whose W is deferred
    prog: list[Cell] = []

    def act(kind, c) -> tuple:
        key = ("F" if kind == "F" else "B", c)  # B and I share a count
        mb = count.get(key, 0)
        count[key] = mb + 1
        if kind == "I":
            pending.append((c, mb))
        return kind, mb, c

    def w():
        if pending:
            c, mb = pending.popleft()
            prog.append((("W", mb, c),))

    for _ in range(2 * (p - r - 1)):  # 1: nF0
        prog.append((act("F", c0),))
    for _ in range(r + 1):  # 2: nF0F1
        prog.append((act("F", c0),))
        prog.append((act("F", c1),))
    for _ in range(p - r - 1):  # 3: nB1W1F1, zero bubble (I then its W)
        prog.append((act("I", c1),))
        w()
        prog.append((act("F", c1),))
    for i in range(n - 2 * p + r + 1):  # 4, the main step: nF0B1F1B0
        if i == 0 and r == p - 1:  # (not overlapped: the last rank's F0 feeds its own F1)
            prog.append((act("F", c0),))
            prog.append((act("B", c1),))
        else:
            prog.append((act("F", c0), act("B", c1)))
        prog.append((act("F", c1), act("B", c0)))
    for _ in range(p - r - 1):  # 5: nB1F1B0
        prog.append((act("B", c1),))
        prog.append((act("F", c1), act("B", c0)))
    zb = False
    for i in range(r + 1):  # 6: nB1B0, the second half split (zero bubble)
        if i == (r + 1) // 2 and r % 2 == 1:
            zb = True
        prog.append((act("I" if zb else "B", c1),))
        if i == (r + 1) // 2 and r % 2 == 0:
            zb = True
        prog.append((act("I" if zb else "B", c0),))
    for _ in range(p - r - 1):  # 7: nWB0
        w()
        prog.append((act("I", c0),))
    while pending:  # 8: nW
        w()
    return prog


def dualpipe_v_programs(p: int, m: int) -> list[list[Cell]]:
    """Every rank's DualPipeV program for m microbatches (built for max(m, 2p), the rest dropped)."""
    return _keep([_dualpipe_v_program(p, max(2 * p, m), r) for r in range(p)], m)
