"""The V-shape schedules as tables (`jaxpar.parallel.pipeline.vshape`): the V placement, `zb_v` and
`dualpipe_v` built, validated and simulated against their targets, the validator refusing broken V
tables, random valid V tables, and the CLI's figures. Plain Python, no JAX."""

import dataclasses
from fractions import Fraction

import numpy as np
import pytest

from helpers import edit_schedule
from jaxpar.parallel.pipeline.simulate import ideal_bubble, simulate
from jaxpar.parallel.schedules import Action, Schedule, ScheduleError, build, check_slots, random_table, validate
from jaxpar.parallel.timeline import render_text
from jaxpar.schedules import main

SIZES = [(p, m) for p in (2, 3, 4, 8) for m in sorted({1, 2, p, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p})]


def _tick_of(sc: Schedule, kind: str, mb: int, chunk: int) -> tuple[int, int]:
    return next((t, s) for t, s, a in sc.actions() if (a.kind, a.microbatch, a.chunk) == (kind, mb, chunk))


def test_v_placement_holds_chunks_s_and_2p_minus_1_minus_s():
    p = 4
    sc = Schedule("v", p, 1, 2, (), placement="v")
    assert [sc.stage_of(c) for c in range(2 * p)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [[sc.chunk_at(s, k) for k in (0, 1)] for s in range(p)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [sc.lane_of(c) for c in range(2 * p)] == [0] * p + [1] * p
    inter = Schedule("i", p, 1, 2, ())  # interleaved keeps its own
    assert [inter.stage_of(c) for c in range(2 * p)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [inter.lane_of(c) for c in range(2 * p)] == [0] * 2 * p


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v"])
@pytest.mark.parametrize("p,m", SIZES)
def test_v_schedules_are_valid_for_any_p_and_m(name, p, m):
    sc = build(name, p, m, 2)
    assert validate(sc) is sc and sc.placement == "v" and sc.virtual_stages == 2
    backs = [a for _, _, a in sc.actions() if a.kind in "BI"]
    assert len(backs) == len({(a.microbatch, a.chunk) for a in backs}) == 2 * p * m
    for t, s, a in sc.actions():
        assert a.chunk in (s, 2 * p - 1 - s)
    # embedding (chunk 0) and head (chunk 2p-1) on stage 0; chunk p-1 feeds chunk p on the last stage
    assert _tick_of(sc, "F", 0, 0)[1] == _tick_of(sc, "F", 0, 2 * p - 1)[1] == 0
    assert _tick_of(sc, "F", 0, p - 1)[1] == _tick_of(sc, "F", 0, p)[1] == p - 1
    if name == "zb_v":
        assert {a.kind for _, _, a in sc.actions()} == set("FIW")
        assert max(len(cell) for row in sc.ticks for cell in row) == 1


def test_the_last_stage_hop_is_local_and_the_second_half_travels_up():
    p, m = 4, 8
    sc = build("zb_v", p, m, 2)
    arr = sc.to_arrays()
    t_turn, _ = _tick_of(sc, "F", 0, p - 1)
    assert arr["f_recv2"][t_turn, p - 1] >= 0  # chunk p-1's output lands on its own stage's second lane
    t_up, s_up = _tick_of(sc, "F", 0, p + 1)  # on stage p-2, from stage p-1
    assert s_up == p - 2 and arr["f_recv2"][_tick_of(sc, "F", 0, p)[0], p - 2] >= 0
    sim = simulate(sc, activation_bytes=1)
    # every hop crosses a stage but the two turns of the V (p-1 -> p forward, p -> p-1 backward)
    assert sum(sim.bytes_per_tick) == 2 * m * (2 * p - 2)
    # a second-half chunk's gradient travels down: I(mb, p+1) on stage p-2 lands in stage p-1's second lane
    t_i, s_i = _tick_of(sc, "I", 0, p + 1)
    assert s_i == p - 2 and arr["b_recv2"][t_i, p - 1] >= 0


@pytest.mark.parametrize("p,m", [(2, 3), (2, 4), (3, 5), (3, 7), (4, 7), (4, 8), (4, 16), (8, 15), (8, 16)])
def test_zb_v_takes_the_least_time_of_its_placement(p, m):
    # Stage p-1 starts no earlier than tick p-1 and works 6m ticks (F, I, W of 2 chunks of m
    # microbatches, one per tick): 6m + p - 1 ticks is the least any one-action V table takes.
    sc = build("zb_v", p, m, 2)
    assert sc.num_ticks() == 6 * m + p - 1
    assert simulate(sc).bubble_fraction == pytest.approx(float(Fraction(p - 1, 6 * m + p - 1)), abs=1e-12)
    assert ideal_bubble("zb_v", p, m, 2) == Fraction(p - 1, 6 * m + p - 1)


def test_zb_v_targets_at_p4_m8():
    zbv, zbh1 = simulate(build("zb_v", 4, 8, 2)), simulate(build("zb_h1", 4, 8))
    assert zbh1.bubble_fraction == pytest.approx(3 / 27)
    assert zbv.bubble_fraction == pytest.approx(3 / 51)  # 5.9%: the lower bound above, half of ZB-H1's
    assert zbv.bubble_fraction < zbh1.bubble_fraction / 1.8
    assert simulate(build("zb_v", 4, 10, 2)).bubble_fraction <= 0.05  # from m = 10 on


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8), (4, 9), (8, 16)])
def test_zb_v_with_fewer_deferred_ws_trades_a_tick_for_two_wstash_slots(p, m):
    # `w_slots` caps the Ws the drain defers (zb_v under a remat policy: 0, `table.deferred_w_slots`):
    # wstash slots w + 1 (uncapped 2p - 1) and floor((2p - 2 - w) / 2) ticks more, the stash unchanged.
    free = build("zb_v", p, m, 2)
    assert free.slot_counts()["wstash"] == 2 * p - 1
    for w in range(2 * p - 1):
        capped = validate(build("zb_v", p, m, 2, w_slots=w))
        assert capped.slot_counts()["wstash"] == w + 1
        assert capped.num_ticks() == 6 * m + p - 1 + (2 * p - 2 - w) // 2
        assert capped.peak_stash() == free.peak_stash()
    assert simulate(build("zb_v", 4, 8, 2, w_slots=0)).bubble_fraction == pytest.approx(3 / 27)  # ZB-H1's


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_v_stashes_no_more_than_1f1b(p, m):
    # A stash entry of zb_v is half a stage's layers: 2p entries are 1F1B's p stage inputs (its
    # stage 0's peak, which sizes every stage's buffer in the one SPMD program).
    zbv, f1b = build("zb_v", p, m, 2), build("1f1b", p, m)
    assert max(zbv.peak_stash()) <= 2 * max(f1b.peak_stash())
    assert validate(zbv).declared_stash == (2 * p,) * p
    assert zbv.slot_counts()["stash"] <= 2 * max(f1b.peak_stash())


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m >= 2 * p])
def test_dualpipe_v_against_its_published_table(p, m):
    # DualPipe's README: DualPipeV's bubble is (PP/2-1)(F&B + B - 3W) and its activations PP+1 chunks
    # for PP = 2p chunks. At F = I = W = 1 per stage (a chunk's F 1/2, B 1, W 1/2, F&B = F + B = 3/2)
    # the bubble is p-1 stage-F times: time 3m + p - 1. Lock-step ticks add 3(p-2)/2 (a tick that
    # runs F&B on one stage lasts F + B on every stage).
    sc = build("dualpipe_v", p, m, 2)
    sim = simulate(sc)
    assert sim.total_time == pytest.approx(3 * m + (p - 1) + 1.5 * (p - 2))
    assert max(sim.peak_stash) == 2 * p + 1
    # the main step: one microbatch's F and another's fused B in one tick, on every stage
    for s in range(p):
        fb = sum(1 for row in sc.ticks if {a.kind for a in row[s]} == {"F", "B"}
                 and len({a.microbatch for a in row[s]}) == 2)
        assert fb == 2 * (m - 2 * p + s + 1) - (s == p - 1) + (p - s - 1)


@pytest.mark.parametrize("seed", range(12))
def test_random_v_tables_are_valid(seed):
    rng = np.random.RandomState(seed)
    p, m = int(rng.randint(2, 5)), int(rng.randint(1, 7))
    split = (True, False, "mixed")[seed % 3]
    sc = random_table(p, m, rng, split=split, v=2, placement="v")
    assert validate(sc) is sc
    for t, s, a in sc.actions():
        assert sc.stage_of(a.chunk) == s
    arr = sc.to_arrays()
    sends = sum(1 for _, _, a in sc.actions() if a.kind == "F" and a.chunk < 2 * p - 1)
    assert (arr["f_recv"] >= 0).sum() + (arr["f_recv2"] >= 0).sum() == sends
    assert (arr["f_recv2"] >= 0).sum() == m * p  # every message to the second half, the local one included


def test_validator_refuses_a_chunk_on_the_interleaved_stage():
    p = 4
    sc = build("zb_v", p, 8, 2)
    a = Action("F", 7, p)  # chunk p lives on stage p-1 under V, on stage 0 interleaved
    t, _ = _tick_of(sc, "F", 7, p)
    with pytest.raises(ScheduleError, match=rf"F\(mb 7, chunk {p}\) is on stage 0, but chunk {p} lives on stage "
                                            rf"{p - 1} \(V placement"):
        validate(edit_schedule(sc, drop=[a], add=[(t, 0, a)]))
    with pytest.raises(ScheduleError, match=r"lives on stage .* \(chunk % 4\)"):
        validate(dataclasses.replace(sc, placement="interleaved"))


def test_validator_refuses_the_local_hop_out_of_order():
    p = 4
    sc = build("zb_v", p, 8, 2)
    (t0, _), (t1, _) = _tick_of(sc, "F", 0, p - 1), _tick_of(sc, "F", 0, p)
    swapped = edit_schedule(sc, drop=[Action("F", 0, p - 1), Action("F", 0, p)],
                    add=[(t0, p - 1, Action("F", 0, p)), (t1, p - 1, Action("F", 0, p - 1))])
    with pytest.raises(ScheduleError, match=rf"F\(mb 0, chunk {p}\) runs at tick {t0}, on stage {p - 1}, but its input "
                                            rf"from F\(mb 0, chunk {p - 1}\) \(tick {t1}\)"):
        validate(swapped)
    same = edit_schedule(sc, drop=[Action("F", 0, p)], add=[(t0, p - 1, Action("F", 0, p))])  # the hop takes a tick
    with pytest.raises(ScheduleError, match=rf"tick {t0}, stage {p - 1} runs F\(mb 0, chunk {p - 1}\), F\(mb 0, chunk {p}\)"):
        validate(same)


def test_validator_refuses_a_second_half_forward_before_its_input_arrives():
    p = 4
    sc = build("zb_v", p, 8, 2)
    early = _tick_of(sc, "F", 3, p)[0]  # F(mb 3, chunk p+1) moved to its input's tick on stage p-2
    moved = edit_schedule(sc, drop=[Action("F", 3, p + 1)], add=[(early, p - 2, Action("F", 3, p + 1))])
    if any(a.kind == "F" for a in moved.ticks[early][p - 2] if a.chunk != p + 1):
        moved = edit_schedule(moved, drop=[a for a in moved.ticks[early][p - 2] if a.kind == "F" and a.chunk != p + 1])
    with pytest.raises(ScheduleError, match=rf"F\(mb 3, chunk {p + 1}\) runs at tick {early}, on stage {p - 2}, but "
                                            rf"its input from F\(mb 3, chunk {p}\)"):
        validate(moved)


def test_validator_refuses_w_before_i_and_i_before_its_successor():
    p = 3
    sc = build("zb_v", p, 6, 2)
    t_i, s = _tick_of(sc, "I", 2, 1)
    moved = edit_schedule(sc, drop=[Action("W", 2, 1)], add=[(t_i, s, Action("W", 2, 1))])
    with pytest.raises(ScheduleError, match=r"W\(mb 2, chunk 1\) runs at tick .* I\(mb 2, chunk 1\).*dependency"):
        validate(moved)
    # I(mb, c) needs I(mb, c+1): chunk p's gradient comes from chunk p+1 (stage p-2), moved before it
    t_next, _ = _tick_of(sc, "I", 0, p + 1)
    moved = edit_schedule(sc, drop=[Action("I", 0, p)], add=[(t_next, p - 1, Action("I", 0, p))])
    with pytest.raises(ScheduleError, match=rf"I\(mb 0, chunk {p}\) runs at tick {t_next}.*I\(mb 0, chunk {p + 1}\)"):
        validate(moved)


def test_validator_refuses_a_v_table_over_its_declared_stash():
    sc = build("zb_v", 4, 8, 2)
    with pytest.raises(ScheduleError, match=r"stage 0 holds 8 stashed chunk inputs at its peak, more than the 7"):
        validate(dataclasses.replace(sc, declared_stash=(7,) * 4))


def test_validator_refuses_a_v_placement_without_two_chunks():
    sc = build("zb_v", 2, 3, 2)
    with pytest.raises(ScheduleError, match=r"placement='v' with virtual_stages=3.*'v' \(v = 2 only"):
        validate(dataclasses.replace(sc, virtual_stages=3))
    with pytest.raises(ScheduleError, match=r"placement='w'"):
        validate(dataclasses.replace(sc, placement="w"))


def test_check_slots_catches_a_corrupted_second_lane():
    sc = build("zb_v", 4, 8, 2)
    arr = sc.to_arrays()
    t, s = np.argwhere(arr["f_recv2"] >= 0)[0]
    bad = {k: a.copy() for k, a in arr.items()}
    bad["f_recv2"][t, s] = -1
    with pytest.raises(ScheduleError, match=r"sends to stage .* but f_recv2 there is -1"):
        check_slots(sc, bad)
    bad = {k: a.copy() for k, a in arr.items()}
    bad["f_recv"][t, s], bad["f_recv2"][t, s] = arr["f_recv2"][t, s], -1  # landed in the wrong lane
    with pytest.raises(ScheduleError):
        check_slots(sc, bad)


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v"])
def test_build_refuses_v_schedules_without_two_chunks_or_stages(name):
    with pytest.raises(ScheduleError, match=rf"virtual_stages=1 does not fit schedule '{name}'.*use virtual_stages=2"):
        build(name, 4, 8, 1)
    with pytest.raises(ScheduleError, match=rf"stages=1 is too few for schedule '{name}'"):
        build(name, 1, 8, 2)


def test_cli_prints_the_table_a_remat_policy_runs(capsys):
    assert main(["--schedule", "zb_v", "-p", "4", "-m", "8"]) == 0
    assert "51 ticks" in capsys.readouterr().out
    assert main(["--schedule", "zb_v", "-p", "4", "-m", "8", "--remat", "full"]) == 0
    out = capsys.readouterr().out
    assert "54 ticks" in out and "bubble 11.1%" in out and "defers at most 0 W" in out


def test_cli_prints_zb_v_and_dualpipe_v(capsys):
    assert main(["--schedule", "zb_v", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "zb_v: p=4 m=8 v=2, 51 ticks" in out and "bubble 5.9% (idle / all stage-time)" in out
    assert "peak stash per stage: [8, 8, 8, 8]" in out and "F0b" in out
    assert main(["--schedule", "dualpipe_v", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "dualpipe_v: p=4 m=8 v=2" in out and "F7aB3b" in out and "peak stash per stage: [8, 8, 8, 9]" in out
    assert main(["--schedule", "zb_v", "-p", "4", "-m", "8", "-v", "3"]) == 2


def test_timeline_renders_v_schedules(tmp_path):
    text = render_text(build("zb_v", 2, 3, 2))
    assert text.splitlines()[1].startswith("stage 0 | F0a F1a F2a F0b I0b W0b")  # chunk 0 (a), then 3 (b)
    pytest.importorskip("matplotlib")
    from jaxpar.parallel.timeline import render_png
    path = tmp_path / "dualpipe_v.png"
    render_png(build("dualpipe_v", 4, 8, 2), str(path))
    assert path.stat().st_size > 1000
