"""Pipeline schedules on p = 4 stages: simulated bubble, ticks, stash, measured step time, temp bytes.

For each schedule the executor runs (gpipe, 1f1b, zb_h1, 1f1b_lockstep, 1f1b_one_action; v = 1) and each
number of microbatches m (default 4, 8, 16, 32) the script

- builds the schedule table (`jaxpar.parallel.schedules.build`) and simulates it
  (`simulate`): the bubble fraction (idle / all stage-time) with F = 1, B = 2 (a split table: I =
  W = 1) and with F = B = 1 (a split table: the same, every action costing 1),
  the number of ticks, the simulated time, and the peak stashed microbatches per stage;
- builds the train step on a mesh (data 1, stage 4, model 1) over 4 of 8 simulated CPU devices,
  AOT-compiles it and reads XLA's temp bytes (`compiled.memory_analysis().temp_size_in_bytes`);
- times `--steps` steps after `--warmup` untimed ones, as `step_time.py` does (batches prebuilt
  with `batch_at`, each step from dispatch to `jax.block_until_ready`), and reports the median.

interleaved_1f1b with v = 2 is always simulated, and measured too where the executor accepts
virtual_stages = 2 and `--layers` splits into p·v = 8 chunks (not with the default 4 layers: its
cell then says why). The model is fixed per microbatch (2 sequences): llama, 4 layers (`--layers`),
d_model 64, 4 heads, d_ff 128, vocab 64, seq_len 128, global_batch = 2·m. It also renders the 1f1b (p = 4, m = 8) and
interleaved_1f1b (p = 4, m = 8, v = 2) timelines as text and PNG.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (TIMING, add_out_arg, add_timing_args, check_timing_args, command, compile_step,  # noqa: E402
                    guarded, machine_info, simulated_cpu, summary, time_steps, write_result)

P = 4                   # pipeline stages
DEVICES = 8             # simulated CPU devices; the mesh takes the first P of them
MICRO = 2               # sequences per microbatch
EXECUTED = ("gpipe", "1f1b", "zb_h1", "1f1b_lockstep", "1f1b_one_action")
INTERLEAVED = ("interleaved_1f1b", 2)  # (schedule, virtual_stages): measured only where the executor and model allow
MODEL = {"arch": "llama", "n_layers": 4, "d_model": 64, "n_heads": 4, "d_ff": 128, "vocab_size": 64,
         "seq_len": 128}
TIMELINES = (("1f1b", 8, 1, "timeline_1f1b_p4_m8"), ("interleaved_1f1b", 8, 2, "timeline_interleaved_p4_m8_v2"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32], metavar="M",
                   help="numbers of microbatches (default 4 8 16 32)")
    p.add_argument("--schedules", nargs="+", default=list(EXECUTED), choices=EXECUTED,
                   help="schedules to run (default: all the executor supports)")
    p.add_argument("--layers", type=int, default=MODEL["n_layers"],
                   help=f"model.n_layers (default {MODEL['n_layers']}; interleaved_1f1b with v = 2 needs a "
                        f"multiple of {P * INTERLEAVED[1]} to run)")
    add_timing_args(p, steps=5, warmup=1, per="(schedule, m)")
    add_out_arg(p, "pipeline_cpu.json")  # the timelines go into the same folder
    args = p.parse_args(argv)
    check_timing_args(p, args)
    if min(args.microbatches) < 1 or args.layers < 1:
        p.error("--layers and --microbatches must be at least 1")
    return args


def make_cfg(schedule: str, m: int, layers: int, v: int = 1):
    from jaxpar.config import from_dict

    return from_dict({
        "model": dict(MODEL, n_layers=layers), "mesh": {"data": 1, "stage": P, "model": 1},
        "parallel": {"schedule": schedule, "microbatches": m, "virtual_stages": v},
        "train": {"global_batch": MICRO * m},
        "runtime": {"cpu_devices": DEVICES},
    })


def simulated(schedule: str, m: int, v: int = 1) -> dict:
    from jaxpar.parallel.pipeline.simulate import ideal_bubble, simulate
    from jaxpar.parallel.schedules import build

    sc = build(schedule, P, m, v)
    # B = 2F (a split table's I = W = F) and, for the closed form, every action costing the same.
    uneq = simulate(sc, 1.0, 2.0)
    eq = simulate(sc, 1.0, 1.0) if not sc.split else uneq
    closed = None if schedule == "1f1b_one_action" else float(ideal_bubble(schedule, P, m, v))
    return {"schedule": schedule, "p": P, "m": m, "v": v, "ticks": sc.num_ticks(),
            "bubble_f1_b2": uneq.bubble_fraction, "bubble_equal": eq.bubble_fraction,
            "bubble_equal_closed_form": closed,
            "sim_time_f1_b2": uneq.total_time, "sim_time_equal": eq.total_time,
            "peak_stash_per_stage": list(uneq.peak_stash), "peak_stash": max(uneq.peak_stash),
            "peak_buffered_per_stage": [list(x) for x in uneq.peak_buffered]}


def interleaved_status(args) -> str | None:
    """None if the train step of interleaved_1f1b (v = 2) can be built here, else why not (one cell)."""
    from jaxpar.config import ConfigError, validate
    from jaxpar.mesh import check_sizes

    s, v = INTERLEAVED
    try:
        for m in args.microbatches:
            cfg = make_cfg(s, m, args.layers, v)
            validate(cfg)
            check_sizes(cfg, (1, P, 1))
    except ConfigError as e:
        if "cannot be split evenly" in str(e):
            return f"not run: {args.layers} layers < p·v = {P * v} chunks"
        return f"not run: {e}"
    return None


def measure(schedule: str, m: int, args, v: int = 1) -> dict:
    import jax
    from jaxpar.mesh import make_mesh
    from jaxpar.parallel.pipeline import table_of
    from jaxpar.parallel.schedules import build as build_schedule
    from jaxpar.train.step import build

    cfg = make_cfg(schedule, m, args.layers, v)
    program = build(cfg, make_mesh(cfg, jax.devices()[:P]))
    table = table_of(build_schedule(schedule, P, m, v))

    compiled, compile_s = compile_step(program)
    mem = compiled.memory_analysis()

    times, metrics = time_steps(cfg, program, compiled, args.warmup, args.steps)
    loss = float(metrics["loss"])
    chunk_input = MICRO * cfg.model.seq_len * cfg.model.d_model * 4  # one microbatch's activation, float32
    return {"executor": True, "n_layers": args.layers, "compile_s": compile_s,
            "temp_bytes": int(mem.temp_size_in_bytes), "argument_bytes": int(mem.argument_size_in_bytes),
            "executor_slots": {"chunks": getattr(table, "chunks", 1), "stash": table.stash, "fwd": table.fwd_slots,
                               "bwd": table.bwd_slots},
            "slot_bytes": getattr(table, "chunks", 1) * (table.stash + table.fwd_slots + table.bwd_slots) * chunk_input,
            "chunk_input_bytes": chunk_input,
            "step_time_s": summary(times),
            "step_times_s": times, "final_loss": loss}


def pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def findings(rows: list[dict]) -> str:
    """What the rows themselves show: temp bytes per stashed microbatch, and equal losses."""
    out = []
    run = [r for r in rows if r["executor"]]
    chunk = run[0]["chunk_input_bytes"] if run else 0
    for s in dict.fromkeys(r["schedule"] for r in run if r["v"] == 1):
        rs = sorted((r for r in run if r["schedule"] == s), key=lambda r: r["m"])
        lo, hi = rs[0], rs[-1]
        if hi["peak_stash"] != lo["peak_stash"]:
            per = (hi["temp_bytes"] - lo["temp_bytes"]) / (hi["peak_stash"] - lo["peak_stash"])
            out.append(f"{s}: temp bytes grow by {per:,.0f} B per extra stashed microbatch from m = {lo['m']} "
                       f"to m = {hi['m']} (peak stash {lo['peak_stash']} -> {hi['peak_stash']}; a slot holds the chunk's "
                       f"residuals, {per / chunk:.0f}x one chunk input of {MICRO}·seq_len·d_model float32, {chunk:,} B)")
        else:
            out.append(f"{s}: temp bytes change by {hi['temp_bytes'] - lo['temp_bytes']:+,} B from m = {lo['m']} to "
                       f"m = {hi['m']} ({lo['temp_bytes'] / 2**20:.2f} MiB; peak stash {hi['peak_stash']} throughout)")
    same = all(len({r["final_loss"] for r in run if r["m"] == m}) == 1 for m in {r["m"] for r in run})
    out.append("the last step's loss is " + ("bit-identical" if same else "NOT identical")
               + " across schedules at every m (same batches, same gradients)")
    return "\nReading: " + "; ".join(out) + ".\n"


def markdown(rows: list[dict], machine: dict, args, command: str, status: str | None) -> str:
    head = ["schedule", "m", "ticks", "bubble F=1,B=2 (sim)", "bubble, equal actions (sim)", "peak stash (max over stages)",
            "median step (ms)", "ms / microbatch", "temp bytes (MiB)", "compile (s)"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        name = r["schedule"] + (f" (v={r['v']})" if r["v"] > 1 else "")
        if r["executor"]:
            med = r["step_time_s"]["median"] * 1e3
            meas = [f"{med:.0f}", f"{med / r['m']:.1f}", f"{r['temp_bytes'] / 2**20:.2f}", f"{r['compile_s']:.1f}"]
        else:
            meas = [r["executor_note"], "—", "—", "—"]
        lines.append("| " + " | ".join([name, str(r["m"]), str(r["ticks"]), pct(r["bubble_f1_b2"]),
                                        pct(r["bubble_equal"]), str(r["peak_stash"]), *meas]) + " |")
    m = dict(MODEL, n_layers=args.layers)
    note = findings(rows) + (
        f"\nModel: {m['arch']}, {m['n_layers']} layers, d_model {m['d_model']}, {m['n_heads']} heads, "
        f"d_ff {m['d_ff']}, "
        f"vocab {m['vocab_size']}, seq_len {m['seq_len']}; a microbatch is {MICRO} sequences, so global_batch = "
        f"{MICRO}·m; AdamW, float32, remat none. Mesh data 1, stage {P}, model 1 on {P} of {DEVICES} simulated "
        f"CPU devices.\n\n"
        f"Method: the schedule columns come from `jaxpar.parallel.schedules` (`build`, `simulate`): bubble = idle "
        f"stage-time / all stage-time in lock-step ticks, each tick as long as its slowest stage (not Megatron's "
        f"idle / ideal); peak stash = most (microbatch, chunk) pairs whose F ran and whose B (or I) has not, on "
        f"the worst stage: the slots of chunk residuals the stage keeps (interleaved_1f1b stashes up to v per "
        f"microbatch). "
        f"1f1b_one_action runs one F or one B per stage per tick, and in steady state some stage runs a B "
        f"in every tick, so with B = 2F every tick costs 2 while the stages alternate F and B: its bubble "
        f"tends to 25%, not 0, as m grows. "
        f"Step time: median of {args.steps} steps after {args.warmup} warmup, each timed from dispatch to "
        f"`jax.block_until_ready`, batches prebuilt with `batch_at`. Temp bytes: XLA's plan for the compiled "
        f"step (`compiled.memory_analysis().temp_size_in_bytes`). "
        + (f"interleaved_1f1b (v = {INTERLEAVED[1]}) is simulated only ({status}).\n\n" if status else "\n\n")
        + f"Measured {machine['date']} on {machine['cpu_count']} shared CPU cores ({machine['cpu_model']}), "
        f"jax {machine['jax_version']}. These CPU step times are not GPU statements: the {P} simulated devices "
        f"share {machine['cpu_count']} cores, so a stage that idles in the bubble frees its core for another "
        f"stage and the bubble does not translate into idle hardware; idle slots skip their compute "
        f"(`lax.cond`), so the step time should follow the total work (the same for every schedule at "
        f"a given m) plus a per-tick cost (two `ppermute`s, buffer updates), not the simulated time. Other work "
        f"shares these cores, so step times move by up to about 2x between runs: read them as \"it runs, at "
        f"roughly this cost\", not as a ranking of schedules.\n\n"
        f"Command: `{command}`\n")
    return "\n".join(lines) + "\n" + note


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


def run(args: argparse.Namespace) -> int:
    simulated_cpu(DEVICES)  # jax_num_cpu_devices = 8, before anything starts a backend
    from jaxpar.parallel.schedules import build
    from jaxpar.parallel.timeline import render_png, render_text

    for s in args.schedules:  # every config is checked before anything compiles
        for m in args.microbatches:
            make_cfg(s, m, args.layers)
    status = interleaved_status(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    rows = []
    for s in args.schedules:
        for m in args.microbatches:
            r = simulated(s, m)
            r.update(measure(s, m, args))
            rows.append(r)
            print(f"{s:16s} m={m:2d}: {r['ticks']:3d} ticks, bubble {r['bubble_f1_b2']:.1%} "
                  f"(F=B {r['bubble_equal']:.1%}), "
                  f"stash {r['peak_stash']}, median {r['step_time_s']['median'] * 1e3:.0f} ms, temp "
                  f"{r['temp_bytes'] / 2**20:.2f} MiB (compile {r['compile_s']:.1f} s)", flush=True)
    s, v = INTERLEAVED
    for m in args.microbatches:
        r = simulated(s, m, v)
        if status:
            r.update(executor=False, executor_note=status)
        else:
            r.update(measure(s, m, args, v))
            print(f"{s} v={v} m={m:2d}: median {r['step_time_s']['median'] * 1e3:.0f} ms, temp "
                  f"{r['temp_bytes'] / 2**20:.2f} MiB (compile {r['compile_s']:.1f} s)", flush=True)
        rows.append(r)

    timelines = {}
    for s, m, v, stem in TIMELINES:
        sc = build(s, P, m, v)
        text = render_text(sc)
        (out.parent / f"{stem}.txt").write_text(text + "\n")
        render_png(sc, str(out.parent / f"{stem}.png"))
        timelines[stem] = {"schedule": s, "p": P, "m": m, "v": v, "txt": f"{stem}.txt", "png": f"{stem}.png"}
        print(text)

    machine = machine_info()
    cmd = command("pipeline.py")
    result = {
        "benchmark": "pipeline", "date": machine["date"], "command": cmd, "machine": machine,
        "model": dict(MODEL, n_layers=args.layers), "microbatch_sequences": MICRO, "stages": P,
        "simulated_devices": DEVICES,
        "mesh": {"data": 1, "stage": P, "model": 1}, "steps": args.steps, "warmup": args.warmup,
        "timing": TIMING + "; compile_s is AOT lower+compile of the step",
        "bubble": "idle stage-time / all stage-time (simulate), F=1 B=2 and F=B=1",
        "rows": rows, "timelines": timelines,
    }
    write_result(out, result, markdown(rows, machine, args, cmd, status),
                 f"Pipeline schedules, p = {P} ({machine['platform']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
