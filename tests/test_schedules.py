"""Pipeline schedules: every built table is valid, broken tables are refused, and the simulator's
bubble and stash match the closed forms. Plain Python: no JAX compiles here."""

import dataclasses
from fractions import Fraction

import numpy as np
import pytest

from helpers import edit_schedule
from jaxpar.parallel import schedules as schedules_module
from jaxpar.parallel.pipeline.simulate import ideal_bubble, simulate
from jaxpar.parallel.schedules import (SCHEDULES, Action, Schedule, ScheduleError, build, check_slots, from_programs,
                                       gpipe, interleaved_1f1b, one_f_one_b, one_f_one_b_lockstep, random_table,
                                       validate, zb_h1)
from jaxpar.parallel.timeline import render_png, render_text
from jaxpar.schedules import main


def _cases():
    for p in (1, 2, 3, 4, 8):
        for m in sorted({1, p, 2 * p + 1}):
            for name in SCHEDULES:
                if name in ("zb_v", "dualpipe_v"):  # V placement: v = 2, p >= 2 (tests/test_v_schedules.py)
                    if p >= 2:
                        yield name, p, m, 2
                    continue
                for v in ((1, 2) if name == "interleaved_1f1b" else (1,)):
                    if v > 1 and m < p:
                        continue
                    yield name, p, m, v


@pytest.mark.parametrize("name,p,m,v", list(_cases()))
def test_every_built_schedule_is_valid(name, p, m, v):
    sc = build(name, p, m, v)
    assert validate(sc) is sc
    if name == "dualpipe_v":  # fused Bs in the main step, split ones in warm-up and drain
        assert {a.kind for _, _, a in sc.actions()} <= set("FBIW")
        assert sum(a.kind in "BI" for _, _, a in sc.actions()) == m * p * v
        return
    per = 3 if name in ("1f1b", "zb_h1", "zb_v") else 2  # F, I, W or F, B per (microbatch, chunk)
    assert sum(1 for _ in sc.actions()) == per * m * p * v
    assert {a.kind for _, _, a in sc.actions()} == (set("FIW") if per == 3 else set("FB"))


def test_validator_rejects_a_missing_b():
    sc = one_f_one_b_lockstep(4, 8)  # the last chunk's B receives nothing, so only its absence is wrong
    with pytest.raises(ScheduleError, match=r"B\(mb 0, chunk 3\) never runs \(nor an I and a W\); every microbatch needs"):
        validate(edit_schedule(sc, drop=[Action("B", 0, 3)]))


def test_validator_rejects_a_b_before_its_f():
    sc = gpipe(2, 2)  # stage 1 idles at tick 0; B(mb 1, chunk 1) moved there precedes F(mb 1, chunk 1)
    moved = edit_schedule(sc, drop=[Action("B", 1, 1)], add=[(0, 1, Action("B", 1, 1))])
    with pytest.raises(ScheduleError, match=r"B\(mb 1, chunk 1\) runs at tick 0, .*F\(mb 1, chunk 1\).*dependency"):
        validate(moved)


def test_validator_rejects_a_forward_before_its_input_arrives():
    sc = gpipe(3, 2)  # F(mb 0, chunk 1) at tick 0, with F(mb 0, chunk 0) also at tick 0
    moved = edit_schedule(sc, drop=[Action("F", 0, 1)], add=[(0, 1, Action("F", 0, 1))])
    with pytest.raises(ScheduleError, match=r"F\(mb 0, chunk 1\) runs at tick 0.*arrives only at tick 1"):
        validate(moved)


def test_validator_rejects_a_send_nobody_receives():
    sc = gpipe(4, 2)  # without F and B of mb 1 on chunk 2, chunk 1's send has no receiver
    broken = edit_schedule(sc, drop=[Action("F", 1, 2), Action("B", 1, 2)])
    with pytest.raises(ScheduleError, match=r"F\(mb 1, chunk 1\).*a send nobody receives"):
        validate(broken)


def test_validator_rejects_an_action_on_the_wrong_stage():
    sc = interleaved_1f1b(2, 4, 2)
    t = sc.times()[("F", 0, 2)]  # chunk 2 lives on stage 0
    with pytest.raises(ScheduleError, match=r"chunk 2 lives on stage 0"):
        validate(edit_schedule(sc, drop=[Action("F", 0, 2)], add=[(t, 1, Action("F", 0, 2))]))


def test_validator_rejects_duplicates():
    sc = one_f_one_b_lockstep(2, 2)
    with pytest.raises(ScheduleError, match="at most one F"):
        validate(edit_schedule(sc, add=[(0, 0, Action("F", 1, 0))]))
    with pytest.raises(ScheduleError, match=r"F\(mb 1, chunk 0\) runs 2 times"):
        validate(edit_schedule(sc, add=[(len(sc.ticks), 0, Action("F", 1, 0))]))


@pytest.mark.parametrize("name,p,m,v", [c for c in _cases() if c[0] not in ("1f1b_one_action", "zb_v", "dualpipe_v")])
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


SLOT_KEYS = ("f_in", "f_stash", "b_stash", "b_in", "i_stash", "i_in", "i_wstash", "w_wstash", "w_stash", "f_recv",
             "b_recv", "f_recv2", "b_recv2")


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
        if "_recv" in key:
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
    assert build("1f1b", 4, 32).declared_stash == (4, 3, 2, 1)
    # zb_h1 keeps a slot from F to its deferred W: every stage holds 1F1B's stage-0 peak
    assert build("zb_h1", 4, 32).declared_stash == (4, 4, 4, 4)
    broken = dataclasses.replace(build("1f1b_lockstep", 4, 8), declared_stash=(6, 5, 3, 1))
    with pytest.raises(ScheduleError, match="stage 0 holds 7 stashed chunk inputs .* more than the 6"):
        validate(broken)


# ---------------------------------------------------------------------------------------------
# Split backward (I, W), slots assigned in the table, 1f1b with Megatron's memory, zb_h1.

def _out_of_order() -> Schedule:
    """The issue's table: p = 2, m = 3, each stage runs F0 F1 B1 F2 B0 B2 (finishes out of order)."""
    order = [("F", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 0), ("B", 2)]
    return from_programs("out_of_order", 2, 3, [[Action(k, j, s) for k, j in order] for s in range(2)])


def _live(sc: Schedule, space: str) -> list[dict[int, list[tuple[int, int]]]]:
    """Per tick, per stage: slot -> the (mb, chunk) whose value it holds after the tick's writes,
    read off to_arrays() (written by F / I at the end of its tick, freed by its reader)."""
    arr, p = sc.to_arrays(), sc.stages
    write, read = {"stash": ("f", "f_stash"), "wstash": ("i", "i_wstash")}[space]
    readers = {"stash": [("b", "b_stash"), ("w", "w_stash")], "wstash": [("w", "w_wstash")]}[space]  # (I keeps its slot)
    live: dict[int, dict[tuple[int, int], int]] = {s: {} for s in range(p)}
    out = []
    for t in range(sc.num_ticks()):
        for s in range(p):
            for k, key in readers:
                if arr[f"{k}_valid"][t, s]:
                    live[s].pop((int(arr[f"{k}_mb"][t, s]), int(arr[f"{k}_chunk"][t, s])), None)
            if arr[f"{write}_valid"][t, s]:
                live[s][(int(arr[f"{write}_mb"][t, s]), int(arr[f"{write}_chunk"][t, s]))] = int(arr[read][t, s])
        snap = []
        for s in range(p):
            by_slot: dict[int, list] = {}
            for key, slot in live[s].items():
                by_slot.setdefault(slot, []).append(key)
            snap.append(by_slot)
        out.append(snap)
    return out


def test_out_of_order_table_gets_distinct_live_slots():
    sc = validate(_out_of_order())
    assert sc.peak_stash() == [2, 2] and sc.slot_counts()["stash"] == 2
    live = _live(sc, "stash")
    assert all(len(keys) == 1 for snap in live for by_slot in snap for keys in by_slot.values())
    # microbatches 0 and 2 are stashed together on stage 0: slot = mb % 2 would put both in slot 0
    assert any({k[0] for keys in snap[0].values() for k in keys} == {0, 2} for snap in live)
    # ... which is what check_slots refuses (the executor's old rule, mb % slots)
    arr = sc.to_arrays()
    for k in "fb":
        arr[f"{k}_stash"] = np.where(arr[f"{k}_valid"] == 1, arr[f"{k}_mb"] % 2, 0).astype(np.int32)
    with pytest.raises(ScheduleError, match=r"writes stash slot 0 .*still holds the stash of F\(mb 0, chunk 0\), "
                                            r"unread: a live slot is overwritten"):
        check_slots(sc, arr)


def test_a_broken_allocator_fails_validate(monkeypatch):
    def mb_modulo(intervals):  # the executor's old rule: slot = microbatch % peak
        n = max(1, max((sum(1 for a, b, _ in intervals if a <= t < b) for t, _, _ in intervals), default=1))
        return {key: key[0] % n for _, _, key in intervals}, n

    monkeypatch.setattr(schedules_module, "_free_list", mb_modulo)
    with pytest.raises(ScheduleError, match="a live slot is overwritten"):
        validate(_out_of_order())


def _applicable(sc: Schedule, key: str) -> np.ndarray:
    """Where the slot array `key` is read by the executor (computed from the table, not the arrays)."""
    last, p = sc.chunks - 1, sc.stages
    # key -> (the kinds that use it, whether action (kind, chunk) does, the stage whose entry it is)
    here, prev, nxt = (lambda c, s: s), (lambda c, s: sc.stage_of(c - 1)), (lambda c, s: sc.stage_of(c + 1))
    lane = sc.lane_of
    uses = {"f_in": ("F", lambda c: c > 0, here), "f_stash": ("F", lambda c: True, here),
            "b_stash": ("B", lambda c: True, here), "i_stash": ("I", lambda c: True, here),
            "b_in": ("B", lambda c: c < last, here), "i_in": ("I", lambda c: c < last, here),
            "i_wstash": ("I", lambda c: True, here), "w_wstash": ("W", lambda c: True, here),
            "w_stash": ("W", lambda c: True, here),
            "f_recv": ("F", lambda c: c < last and lane(c + 1) == 0, nxt),
            "f_recv2": ("F", lambda c: c < last and lane(c + 1) == 1, nxt),
            "b_recv": ("BI", lambda c: c > 0 and lane(c - 1) == 0, prev),
            "b_recv2": ("BI", lambda c: c > 0 and lane(c - 1) == 1, prev)}
    kinds, used, where = uses[key]
    mask = np.zeros((sc.num_ticks(), p), bool)
    for t, s, a in sc.actions():
        if a.kind in kinds and used(a.chunk):
            mask[t, where(a.chunk, s)] = True
    return mask


def _random_cases():
    for p in (2, 3, 4):
        for m in range(1, 7):
            for split in (True, False, "mixed"):
                yield p, m, split, 1
    for p, m in ((2, 3), (3, 4), (4, 5)):
        yield p, m, "mixed", 2


@pytest.mark.parametrize("p,m,split,v", list(_random_cases()))
def test_random_tables_are_valid_and_a_corrupted_slot_is_caught(p, m, split, v):
    rng = np.random.RandomState(1000 * p + 10 * m + v)
    for _ in range(3):
        sc = random_table(p, m, rng, split=split, v=v)
        validate(sc)
        kinds = {a.kind for _, _, a in sc.actions()}
        assert kinds <= (set("FIW") if split is True else set("FB") if split is False else set("FBIW"))
        # the free list uses no more slots than values are ever live at once
        counts = sc.slot_counts()
        assert counts["stash"] == max(1, max(sc.peak_stash())) and counts["wstash"] == max(1, max(sc.peak_wstash()))
        assert (counts["fwd"], counts["bwd"]) == tuple(max(1, max(x)) for x in zip(*sc.peak_buffered()))
        # one entry of one slot array, where the executor reads it, moved to another slot: caught
        arr = sc.to_arrays()
        keys = [k for k in SLOT_KEYS if _applicable(sc, k).any()]
        key = keys[rng.randint(len(keys))]
        where = np.argwhere(_applicable(sc, key))
        t, s = where[rng.randint(len(where))]
        space = schedules_module._SLOT_SPACE[key]
        arr[key][t, s] = (arr[key][t, s] + 1 + rng.randint(counts[space])) % (counts[space] + 1)
        with pytest.raises(ScheduleError):
            check_slots(sc, arr)


def test_random_table_is_reproducible_and_varied():
    a, b = random_table(3, 4, 5), random_table(3, 4, np.random.RandomState(5))
    assert a == b and validate(a)
    tables = {random_table(3, 4, seed, split="mixed").ticks for seed in range(20)}
    assert len(tables) == 20
    packed = [sum(len(c) > 1 for row in random_table(3, 6, seed).ticks for c in row) for seed in range(20)]
    assert max(packed) > 0  # some ticks hold more than one action on a stage
    with pytest.raises(ScheduleError, match="split='yes'"):
        random_table(2, 2, 0, split="yes")


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_1f1b_has_megatrons_memory_and_beats_the_lockstep_table(p):
    for m in (p, p + 1, 2 * p, 4 * p + 3):
        sc = validate(one_f_one_b(p, m))
        assert sc.peak_stash() == [p - s for s in range(p)]
        assert sc.peak_wstash() == [1] * p
        assert all(len(cell) <= 1 for row in sc.ticks for cell in row)  # one action per stage per tick
        lock = one_f_one_b_lockstep(p, m)
        assert simulate(sc).total_time == 3 * m + 2 * (p - 1) <= simulate(lock).total_time == 3 * (m + p - 1)
    assert one_f_one_b(4, 2).peak_stash() == [2, 2, 2, 1]  # m < p: min(m, p - s)


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_zb_h1_bubble_is_a_third_of_1f1b_at_1f1b_memory(p):
    for m in (p, p + 1, 2 * p, 4 * p + 1):
        sc = validate(zb_h1(p, m))
        # a slot lives from F to the deferred W: every stage holds 1F1B's stage-0 peak, which in one
        # SPMD program sizes every stage's stash anyway
        assert sc.peak_stash() == [min(m, p)] * p and max(sc.peak_stash()) == max(one_f_one_b(p, m).peak_stash())
        assert sc.slot_counts()["stash"] == one_f_one_b(p, m).slot_counts()["stash"]
        assert sc.peak_wstash() == [min(m, s + 1) for s in range(p)]
        zb, lock = simulate(sc), simulate(one_f_one_b_lockstep(p, m))
        idle_zb, idle_1f1b = zb.total_time - 3 * m, lock.total_time - 3 * m  # per stage, F = I = W = 1
        assert idle_zb <= idle_1f1b / 3 + 1
        assert idle_zb == p - 1  # the paper's ZB-H1: (p-1)(F + I - W)
        assert zb.bubble_over_ideal <= lock.bubble_over_ideal / 3 + 1 / (3 * m)


def test_zb_h1_refuses_virtual_stages():
    with pytest.raises(ScheduleError, match=r"^virtual_stages=2 is not built for schedule 'zb_h1' \(only its "
                                            r"one-chunk-per-stage form is\); use virtual_stages=1 with 'zb_h1', or "
                                            r"'interleaved_1f1b' for several chunks per stage\.$"):
        build("zb_h1", 4, 8, 2)


def _tiny_split(cell_of_stage0) -> Schedule:
    """p = 1, m = 1: ticks given as cells of actions of (mb 0, chunk 0)."""
    ticks = tuple((tuple(Action(k, 0, 0) for k in cell),) for cell in cell_of_stage0)
    return Schedule("tiny", 1, 1, 1, ticks)


def test_simulate_charges_each_kind_its_own_cost():
    sc = validate(_tiny_split(["F", "I", "W"]))
    assert simulate(sc).total_time == 3.0  # defaults F = I = W = 1
    assert simulate(sc, 1.0, i_cost=2.0, w_cost=3.0).total_time == 6.0
    assert simulate(sc, 1.0, 4.0).total_time == 5.0  # b_cost alone: I = W = 2
    assert simulate(sc, 1.0, 4.0, i_cost=3.0).total_time == 5.0  # W = the rest of B
    assert dict(simulate(sc).costs) == {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    fused = validate(_tiny_split(["F", "B"]))
    assert simulate(fused).total_time == 3.0  # B = I + W = 2 by default
    assert simulate(fused, 1.0, i_cost=0.5, w_cost=0.25).total_time == 1.75
    assert simulate(fused, 2.0, 5.0).total_time == 7.0
    # a tick costs its slowest stage's summed work: F and I and W of different microbatches in one tick
    packed = validate(from_programs("packed", 1, 2, [[Action("F", 0, 0), Action("F", 1, 0), Action("I", 0, 0),
                                                      Action("W", 0, 0), Action("I", 1, 0), Action("W", 1, 0)]],
                                    one_action=False))
    assert [len(c) for row in packed.ticks for c in row] == [1, 2, 2, 1]  # F0 | F1 I0 | I1 W0 | W1
    assert simulate(packed, 1.0, i_cost=2.0, w_cost=3.0).tick_times == (1.0, 3.0, 5.0, 3.0)
    with pytest.raises(ScheduleError, match="negative"):
        simulate(sc, 1.0, 1.0, i_cost=2.0)


def test_simulate_reports_the_bubble_both_ways():
    p, m = 4, 8
    sim = simulate(one_f_one_b_lockstep(p, m), 1.0, 1.0)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert sim.bubble_over_ideal == pytest.approx((p - 1) / m)  # Megatron's idle / ideal
    zb = simulate(zb_h1(p, m))
    assert zb.bubble_over_ideal == pytest.approx((p - 1) / (3 * m)) and zb.peak_wstash == (1, 2, 3, 4)
    text = render_text(zb_h1(p, m))
    assert "12.5% (idle / ideal, Megatron's)" in text and "11.1% (idle / all stage-time)" in text


def test_render_text_shows_i_and_w_cells():
    text = render_text(zb_h1(4, 8))
    rows = [line.split("|", 1)[1].split() for line in text.splitlines() if line.startswith("stage ")]
    assert rows[3][:12] == ["·", "·", "·", "F0", "I0", "F1", "I1", "F2", "I2", "F3", "I3", "W0"]
    assert "peak wstash per stage: [1, 2, 3, 4]" in text and "F=1, I=1, W=1" in text
    packed = from_programs("packed", 1, 2, [[Action("F", 0, 0), Action("F", 1, 0), Action("I", 0, 0),
                                             Action("W", 0, 0), Action("I", 1, 0), Action("W", 1, 0)]],
                           one_action=False)
    assert render_text(packed).splitlines()[1].split("|")[1].split() == ["F0", "F1I0", "I1W0", "W1"]


def test_render_png_draws_a_split_table(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "zb.png"
    render_png(zb_h1(3, 4), str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


# one broken rule each: (ticks of a p = 2, m = 1 table as stage cells, error fragment)
_F0, _F1 = Action("F", 0, 0), Action("F", 0, 1)
_I0, _I1, _W0, _W1 = Action("I", 0, 0), Action("I", 0, 1), Action("W", 0, 0), Action("W", 0, 1)
_B0, _B1 = Action("B", 0, 0), Action("B", 0, 1)
_OK = [[(_F0,), ()], [(), (_F1,)], [(), (_I1,)], [(_I0,), (_W1,)], [(_W0,), ()]]


@pytest.mark.parametrize("ticks,fragment", [
    (_OK, None),
    ([[(_F0,), ()], [(), (_F1,)], [(), (_I1, _B1)], [(_I0,), (_W1,)], [(_W0,), ()]],
     r"stage 1 runs I\(mb 0, chunk 1\), B\(mb 0, chunk 1\): a stage runs at most one F, one B or I, and one W"),
    ([[(_F0,), ()], [(), (_F1,)], [(), (_I1,)], [(_I0,), ()], [(_W0,), (_W1, Action("W", 0, 1))]],
     r"at most one F, one B or I, and one W per tick"),
    ([[(_F0,), ()], [(), (_F1,)], [(), (Action("X", 0, 1),)], [(_I0,), (_W1,)], [(_W0,), ()]],
     r"action kind 'X' is not one of 'F', 'B', 'I', 'W'"),
    ([[(_F0,), (_F1,)], [(), ()], [(), (_I1,)], [(_I0,), (_W1,)], [(_W0,), ()]],
     r"F\(mb 0, chunk 1\) runs at tick 0, on stage 1, but its input from F\(mb 0, chunk 0\) \(tick 0\) arrives "
     r"only at tick 1: dependency order is broken \(F\(mb, c\) needs F\(mb, c-1\)"),
    ([[(_F0,), ()], [(), (_F1,)], [(), ()], [(_I0,), (_I1,)], [(_W0,), (_W1,)]],
     r"I\(mb 0, chunk 0\) runs at tick 3, on stage 0, but its input from I\(mb 0, chunk 1\) \(tick 3\) .*"
     r"\(a B or I of \(mb, c\) needs F\(mb, c\) and the B or I of \(mb, c\+1\) at earlier ticks\)"),
    ([[(_F0,), ()], [(), (_I1,)], [(), (_F1,)], [(_I0,), (_W1,)], [(_W0,), ()]],
     r"I\(mb 0, chunk 1\) runs at tick 1, on stage 1, but its input from F\(mb 0, chunk 1\) \(tick 2\)"),
    ([[(_F0,), ()], [(), (_F1,)], [(), (_I1,)], [(_I0,), (_W1,)], [(_W0,), ()]][:3] + [[(_I0, _W0), (_W1,)]],
     r"W\(mb 0, chunk 0\) runs at tick 3, on stage 0, but its input from I\(mb 0, chunk 0\) \(tick 3\) .*"
     r"\(W\(mb, c\) needs I\(mb, c\) at an earlier tick\)"),
    ([[(_F0,), ()], [(), (_F1,)], [(), (_I1,)], [(_I0,), (_W1,)], [(_B0,), ()], [(_W0,), ()]],
     r"B\(mb 0, chunk 0\) at tick 4 and I\(mb 0, chunk 0\) at tick 3 both run; a backward is either one fused B "
     r"or one I and one W"),
    ([[(_F0,), ()], [(), (_F1,)], [(), (_I1,)], [(_I0,), ()], [(_W0,), ()]],
     r"I\(mb 0, chunk 1\) runs at tick 2 without its W; a split backward needs one I and one W"),
    ([[(_F0,), ()], [(), (_F1,)], [(), (_B1,)], [(_B0,), (_W1,)]],
     r"W\(mb 0, chunk 1\) runs at tick 3 without its I"),
    ([[(_F0,), ()], [(), (_F1,)], [(), (_I1,)], [(), (_W1,)]],
     r"I\(mb 0, chunk 1\) at tick 2 sends its gradient to chunk 0 on stage 0, but no B or I of \(mb 0, chunk 0\) "
     r"runs: a send nobody receives"),
    ([[(_F0,), ()], [(), (_F1,)], [(), (_B1,)], [(_I0,), ()]],
     r"I\(mb 0, chunk 0\) runs at tick 3 without its W"),
])
def test_validator_names_each_broken_rule(ticks, fragment):
    sc = Schedule("hand", 2, 1, 1, tuple(tuple(row) for row in ticks))
    if fragment is None:
        assert validate(sc) is sc
        return
    with pytest.raises(ScheduleError, match=fragment) as err:
        validate(sc)
    assert str(err.value).count(". ") == 0  # one sentence


def test_check_slots_names_a_read_of_the_wrong_value():
    sc = Schedule("hand", 2, 1, 1, tuple(tuple(row) for row in _OK))
    arr = sc.to_arrays()
    arr["f_recv"][0, 1] = -1  # the activation F(mb 0, chunk 0) sends at tick 0 arrives at the end of tick 0
    with pytest.raises(ScheduleError, match=r"F\(mb 0, chunk 0\) at tick 0 sends to stage 1, but f_recv there is -1"):
        check_slots(sc, arr)
    sc = _out_of_order()  # stage 0's stash: F0 -> 0, F1 -> 1, B1 frees 1, F2 -> 1, B0 reads 0, B2 reads 1
    arr = sc.to_arrays()
    t = sc.times()[("B", 0, 0)]
    assert arr["b_stash"][t, 0] == 0
    arr["b_stash"][t, 0] = 1
    with pytest.raises(ScheduleError, match=rf"^B\(mb 0, chunk 0\) at tick {t} on stage 0 reads stash slot 1 \(b_stash\), "
                                            r"which holds the stash of F\(mb 2, chunk 0\), not the stash of F\(mb 0, "
                                            r"chunk 0\): a read must find what its action needs\.$"):
        check_slots(sc, arr)
    two = random_table(2, 3, 3, split=True)
    counts = two.slot_counts()
    arr = two.to_arrays()
    t, s = np.argwhere(arr["w_valid"] == 1)[0]
    arr["w_wstash"][t, s] = counts["wstash"]
    with pytest.raises(ScheduleError, match=r"to_arrays\(\)\['w_wstash'\] at tick .* outside the .* wstash slots"):
        check_slots(two, arr)
    arr = two.to_arrays()
    arr["w_mb"][t, s] += 1
    with pytest.raises(ScheduleError, match=r"to_arrays\(\) at tick .* names W\(mb .*, but the table runs W"):
        check_slots(two, arr)


def test_to_arrays_spec_for_1f1b():
    """The executor's contract on a known table: p = 2, m = 2, one action per tick."""
    sc = one_f_one_b(2, 2)
    arr = sc.to_arrays()
    assert render_text(sc).splitlines()[1:3] == ["stage 0 | F0 F1  · I0 W0  · I1 W1",
                                                 "stage 1 |  · F0 I0 W0 F1 I1 W1  ·"]
    assert sc.slot_counts() == {"stash": 2, "wstash": 1, "fwd": 1, "bwd": 1}
    assert arr["f_stash"][:, 0].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]  # F0 -> slot 0, F1 -> slot 1
    assert arr["i_stash"][:, 0].tolist() == [0, 0, 0, 0, 0, 0, 1, 0]
    assert arr["f_recv"][:, 1].tolist() == [0, 0, -1, -1, -1, -1, -1, -1]  # stage 0's F at ticks 0, 1
    assert arr["f_recv"][:, 0].tolist() == [-1] * 8  # stage 0 receives no activation (v = 1)
    assert arr["b_recv"][:, 0].tolist() == [-1, -1, 0, -1, -1, 0, -1, -1]  # stage 1's I at ticks 2, 5
    assert arr["i_in"][:, 0].tolist() == [0] * 8 and arr["i_in"][:, 1].tolist() == [0] * 8
    assert arr["w_valid"][:, 1].tolist() == [0, 0, 0, 1, 0, 0, 1, 0]
