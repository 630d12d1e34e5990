"""Pipeline schedules: every built table is valid, broken tables are refused, and the simulator's
bubble and stash match the closed forms. Plain Python: no JAX compiles here."""

import dataclasses
from fractions import Fraction

import numpy as np
import pytest

from jaxpar.parallel import schedules as schedules_module
from jaxpar.parallel.schedules import (SCHEDULES, Action, Schedule, ScheduleError, build, check_slots, from_programs,
                                       gpipe, ideal_bubble, interleaved_1f1b, one_f_one_b, one_f_one_b_lockstep,
                                       random_table, render_png, render_text, simulate, validate, zb_h1)
from jaxpar.schedules import main


def _cases():
    for p in (1, 2, 3, 4, 8):
        for m in sorted({1, p, 2 * p + 1}):
            for name in SCHEDULES:
                for v in ((1, 2) if name == "interleaved_1f1b" else (1,)):
                    if v > 1 and m < p:
                        continue
                    yield name, p, m, v


def _edit(schedule: Schedule, drop=(), add=()) -> Schedule:
    """A copy of `schedule` without the actions in `drop` and with (tick, stage, action) in `add`."""
    ticks = [[[a for a in cell if a not in drop] for cell in row] for row in schedule.ticks]
    for t, s, a in add:
        while len(ticks) <= t:
            ticks.append([[] for _ in range(schedule.stages)])
        ticks[t][s].append(a)
    return dataclasses.replace(schedule, ticks=tuple(tuple(tuple(c) for c in row) for row in ticks))


@pytest.mark.parametrize("name,p,m,v", list(_cases()))
def test_every_built_schedule_is_valid(name, p, m, v):
    sc = build(name, p, m, v)
    assert validate(sc) is sc
    per = 3 if name in ("1f1b", "zb_h1") else 2  # F, I, W or F, B per (microbatch, chunk)
    assert sum(1 for _ in sc.actions()) == per * m * p * v
    assert {a.kind for _, _, a in sc.actions()} == (set("FIW") if per == 3 else set("FB"))


def test_validator_rejects_a_missing_b():
    sc = one_f_one_b_lockstep(4, 8)  # the last chunk's B receives nothing, so only its absence is wrong
    with pytest.raises(ScheduleError, match=r"B\(mb 0, chunk 3\) never runs \(nor an I and a W\); every microbatch needs"):
        validate(_edit(sc, drop=[Action("B", 0, 3)]))


def test_validator_rejects_a_b_before_its_f():
    sc = gpipe(2, 2)  # stage 1 idles at tick 0; B(mb 1, chunk 1) moved there precedes F(mb 1, chunk 1)
    moved = _edit(sc, drop=[Action("B", 1, 1)], add=[(0, 1, Action("B", 1, 1))])
    with pytest.raises(ScheduleError, match=r"B\(mb 1, chunk 1\) runs at tick 0, .*F\(mb 1, chunk 1\).*dependency"):
        validate(moved)


def test_validator_rejects_a_forward_before_its_input_arrives():
    sc = gpipe(3, 2)  # F(mb 0, chunk 1) at tick 0, with F(mb 0, chunk 0) also at tick 0
    moved = _edit(sc, drop=[Action("F", 0, 1)], add=[(0, 1, Action("F", 0, 1))])
    with pytest.raises(ScheduleError, match=r"F\(mb 0, chunk 1\) runs at tick 0.*arrives only at tick 1"):
        validate(moved)


def test_validator_rejects_a_send_nobody_receives():
    sc = gpipe(4, 2)  # without F and B of mb 1 on chunk 2, chunk 1's send has no receiver
    broken = _edit(sc, drop=[Action("F", 1, 2), Action("B", 1, 2)])
    with pytest.raises(ScheduleError, match=r"F\(mb 1, chunk 1\).*a send nobody receives"):
        validate(broken)


def test_validator_rejects_an_action_on_the_wrong_stage():
    sc = interleaved_1f1b(2, 4, 2)
    t = sc.times()[("F", 0, 2)]  # chunk 2 lives on stage 0
    with pytest.raises(ScheduleError, match=r"chunk 2 lives on stage 0"):
        validate(_edit(sc, drop=[Action("F", 0, 2)], add=[(t, 1, Action("F", 0, 2))]))


def test_validator_rejects_duplicates():
    sc = one_f_one_b_lockstep(2, 2)
    with pytest.raises(ScheduleError, match="at most one F"):
        validate(_edit(sc, add=[(0, 0, Action("F", 1, 0))]))
    with pytest.raises(ScheduleError, match=r"F\(mb 1, chunk 0\) runs 2 times"):
        validate(_edit(sc, add=[(len(sc.ticks), 0, Action("F", 1, 0))]))


@pytest.mark.parametrize("name,p,m,v", [c for c in _cases() if c[0] != "1f1b_one_action"])
def test_equal_cost_bubble_matches_closed_form(name, p, m, v):
    if name in ("1f1b", "zb_h1"):  # split tables: F = I = W = 1 (simulate's defaults)
        sim = simulate(build(name, p, m, v))
        idle = 2 * (p - 1) if name == "1f1b" else max(p - 1, 2 * p - 1 - m)
        expected = Fraction(idle, 3 * m + idle)
    else:
        sim = simulate(build(name, p, m, v), f_cost=1.0, b_cost=1.0)
        expected = Fraction(p - 1, (v * m if name == "interleaved_1f1b" else m) + p - 1)
    assert ideal_bubble(name, p, m, v) == expected
    assert sim.bubble_fraction == pytest.approx(float(expected), abs=1e-12)


def test_lockstep_1f1b_time_is_m_plus_p_minus_1_times_f_plus_b():
    p, m = 4, 8
    assert simulate(one_f_one_b_lockstep(p, m), f_cost=1.0, b_cost=2.0).total_time == (m + p - 1) * 3.0
    # one action per tick stashes less but every tick costs a whole F or B: slower with B = 2F
    one = build("1f1b_one_action", p, m)
    assert one.peak_stash() == [p - s for s in range(p)]
    assert simulate(one, 1.0, 2.0).total_time > (m + p - 1) * 3.0


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("factor", [1, 4, 16])
def test_1f1b_stash_is_bounded_by_2p_minus_1(p, factor):
    m = factor * p
    stash = one_f_one_b_lockstep(p, m).peak_stash()
    assert stash == [min(m, 2 * (p - s) - 1) for s in range(p)]
    assert max(stash) <= 2 * p - 1


def test_gpipe_stashes_every_microbatch():
    assert gpipe(4, 8).peak_stash()[0] == 8
    assert gpipe(4, 8).num_ticks() == 2 * (8 + 4 - 1)


def test_peak_buffered_counts_the_receive_slot():
    assert one_f_one_b_lockstep(4, 8).peak_buffered() == [(0, 1), (1, 1), (1, 1), (1, 0)]
    assert one_f_one_b(4, 8).peak_buffered() == [(0, 1), (1, 1), (1, 1), (1, 0)]
    assert gpipe(1, 3).peak_buffered() == [(0, 0)]  # one stage, one chunk: nothing is sent
    # m % p != 0: the first group of p + r microbatches waits at stage 0 (activations), stage p-1 (grads)
    assert interleaved_1f1b(4, 9, 2).peak_buffered() == [(2, 1), (1, 1), (1, 1), (1, 2)]


SLOT_KEYS = ("f_in", "f_stash", "b_stash", "b_in", "i_stash", "i_in", "i_wstash", "w_wstash", "f_recv", "b_recv")


@pytest.mark.parametrize("sc", [interleaved_1f1b(4, 8, 2), zb_h1(4, 8), random_table(3, 5, 7, split="mixed", v=2)],
                         ids=lambda sc: sc.name)
def test_to_arrays_matches_ticks(sc):
    arr = sc.to_arrays()
    assert set(arr) == {f"{k}_{f}" for k in "fbiw" for f in ("valid", "mb", "chunk")} | set(SLOT_KEYS)
    for a in arr.values():
        assert a.shape == (sc.num_ticks(), sc.stages) and a.dtype == np.int32
    for t, row in enumerate(sc.ticks):
        for s, cell in enumerate(row):
            for k in "FBIW":
                acts = [a for a in cell if a.kind == k]
                pre = k.lower()
                assert arr[f"{pre}_valid"][t, s] == len(acts)
                if acts:
                    assert (arr[f"{pre}_mb"][t, s], arr[f"{pre}_chunk"][t, s]) == (acts[0].microbatch,
                                                                                 acts[0].chunk // sc.stages)
                else:
                    assert arr[f"{pre}_mb"][t, s] == arr[f"{pre}_chunk"][t, s] == 0
    # a slot where nothing is read or written is 0; a receive where nothing arrives is -1
    for key in SLOT_KEYS:
        kind = key[0] if key[0] in "fbiw" else None
        if key.endswith("_recv"):
            continue
        assert (arr[key][arr[f"{kind}_valid"] == 0] == 0).all()
    assert (arr["f_in"][(arr["f_valid"] == 1) & (arr["f_chunk"] == 0) & (np.arange(sc.stages) == 0)] == 0).all()
    n_sent = sum(1 for _, _, a in sc.actions() if a.kind == "F" and a.chunk < sc.chunks - 1)
    assert (arr["f_recv"] >= 0).sum() == n_sent == sum(1 for _, _, a in sc.actions() if a.kind == "F" and a.chunk > 0)


def test_simulate_reports_bytes_sent():
    p, m = 4, 8
    sim = simulate(one_f_one_b(p, m), activation_bytes=100)
    assert sum(sim.bytes_per_tick) == 2 * m * (p - 1) * 100  # every F and B crosses p-1 stage boundaries
    assert len(sim.bytes_per_tick) == one_f_one_b(p, m).num_ticks()


def test_render_text_has_one_row_per_stage_and_one_column_per_tick():
    sc = build("interleaved_1f1b", 3, 6, 2)
    rows = [line for line in render_text(sc).splitlines() if line.startswith("stage ")]
    assert len(rows) == 3
    cells = [row.split("|", 1)[1].split() for row in rows]
    assert all(len(c) == sc.num_ticks() for c in cells)
    assert cells[0][0] == "F0a" and "·" in cells[2]
    assert "idle / all" in render_text(sc)


def test_render_png_draws_a_file(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "s.png"
    render_png(gpipe(2, 3), str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args,fragment", [
    (("zb", 4, 8, 1), "unknown schedule 'zb'"),
    (("interleaved_1f1b", 4, 2, 2), "microbatches=2 is fewer than stages=4"),
    (("1f1b", 4, 8, 2), "virtual_stages=2 needs schedule 'interleaved_1f1b'"),
    (("zb_h1", 4, 8, 2), "virtual_stages=2 is not built for schedule 'zb_h1'.*use virtual_stages=1"),
    (("gpipe", 0, 8, 1), "stages=0"),
    (("gpipe", 2, 0, 1), "microbatches=0"),
])
def test_build_refuses_bad_input(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        build(*args)


def test_build_allows_small_m_for_gpipe_1f1b_and_v1_interleaved():
    validate(build("gpipe", 4, 1))
    validate(build("1f1b", 4, 2))
    assert build("interleaved_1f1b", 4, 2, 1).ticks == build("1f1b_lockstep", 4, 2).ticks


def test_cli_prints_the_table(capsys):
    assert main(["--schedule", "1f1b", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("stage ") >= 4 and "bubble 20.0%" in out and "peak stash per stage: [4, 3, 2, 1]" in out
    assert main(["--schedule", "1f1b_lockstep", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble 27.3%" in out and "peak stash per stage: [7, 5, 3, 1]" in out


@pytest.mark.parametrize("argv", [
    ["--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--virtual-stages", "2"],
    ["--schedule", "nope", "--stages", "4", "--microbatches", "8"],
    ["--schedule", "1f1b", "--stages", "four", "--microbatches", "8"],
])
def test_cli_bad_input_exits_2_with_one_line(capsys, argv):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and not captured.out


def test_declared_stash_is_kept_and_checked():
    """Every built table keeps the stash it declares (lock-step 1F1B: min(m, 2(p-s)-1), whatever m;
    1f1b and zb_h1: min(m, p-s)), and a table declaring less than it holds is rejected."""
    for p in (1, 2, 4, 8):
        for m in (1, p, 4 * p + 1):
            for name in ("gpipe", "1f1b", "1f1b_lockstep", "1f1b_one_action", "zb_h1"):
                validate(build(name, p, m))
    assert build("1f1b_lockstep", 4, 32).declared_stash == (7, 5, 3, 1)
    assert build("1f1b", 4, 32).declared_stash == build("zb_h1", 4, 32).declared_stash == (4, 3, 2, 1)
    broken = dataclasses.replace(build("1f1b_lockstep", 4, 8), declared_stash=(6, 5, 3, 1))
    with pytest.raises(ScheduleError, match="stage 0 holds 7 stashed chunk inputs .* more than the 6"):
        validate(broken)
