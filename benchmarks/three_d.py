"""The 3D table: every factorization of the devices into (data, stage, model), one config each.

For each mesh (d, p, t) with d·p·t = `--devices` (10 meshes for 8 devices) the train step of one
model is built and AOT-compiled, and the script reports:

- per-device memory XLA planned for the compiled step (`compiled.memory_analysis()` via
  `jaxpar.inspect`): argument bytes (parameters, optimizer state, batch) + temp bytes;
- bytes moved per step by mesh axis (the axes a collective spans: `data`, `stage`, `model`, or
  several): result bytes per device × executions per step, summed over the collectives of
  `jaxpar.inspect`'s Report, and their ring wire-byte estimate (as in `zero.py`). A collective
  inside a pipeline tick's `lax.cond` branch is counted as if its branch ran in every tick (the
  inspector's upper bound), so pipeline figures are upper bounds;
- the median wall time of one step (as in `step_time.py`).

Every mesh runs the same model, global batch and ZeRO stage; a pipeline runs `--schedule` with
m = p microbatches (and one microbatch without a pipeline), so that the global batch is the same
everywhere and divides every d·m.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (TIMING, add_config_args, add_devices_arg, add_out_arg, add_timing_args,  # noqa: E402
                    check_timing_args, command, compile_step, guarded, load_avg, machine_info, memory_bytes,
                    mib, overrides, simulated_cpu, summary, time_steps, wire_bytes, write_result)
# 8 heads and 8 layers: every factorization of 8 devices can split them (t up to 8, p up to 8).
DEFAULTS = ("model.arch=llama", "model.n_layers=8", "model.d_model=256", "model.n_heads=8", "model.d_ff=1024",
            "model.vocab_size=256", "model.seq_len=64", "train.global_batch=16", "parallel.zero=1")
AXES = ("data", "stage", "model")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p, "YAML config (default: llama, 8 layers, d_model 256, 8 heads, d_ff 1024, vocab 256, "
                       "seq_len 64, global_batch 16, ZeRO-1)", "parallel.zero=3")
    add_devices_arg(p)
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule where stage > 1 (default 1f1b)")
    add_timing_args(p, steps=5, warmup=1, per="mesh")
    add_out_arg(p, "three_d.json")
    args = p.parse_args(argv)
    check_timing_args(p, args)
    return args


def factorizations(n: int) -> list[tuple[int, int, int]]:
    """Every (d, p, t) with d·p·t = n, data-major."""
    return [(d, p, n // (d * p)) for d in range(n, 0, -1) for p in range(1, n + 1)
            if n % d == 0 and (n // d) % p == 0]


def by_axes(report, mesh) -> dict[str, dict]:
    """Per set of spanned axes ("data", "stage", "data,stage", ...): collectives, result bytes and
    ring wire bytes per step."""
    out: dict[str, dict] = {}
    for c in report.collectives:
        n = math.prod(int(mesh.shape[a]) for a in c.axes)
        row = out.setdefault(",".join(c.axes) or "-", {"collectives": 0, "result_bytes": 0, "wire_bytes": 0.0,
                                                       "in_loop": 0, "executions_known": True})
        row["collectives"] += 1
        row["in_loop"] += int(c.in_loop)
        row["result_bytes"] += c.traffic
        row["wire_bytes"] += wire_bytes(c.kind, c.bytes, n) * c.executions
        row["executions_known"] &= c.executions_known
    return out


def measure(cfg, args) -> dict:
    from jaxpar.inspect import analyze
    from jaxpar.train.step import build

    program = build(cfg)
    mesh = program.mesh
    compiled, compile_s = compile_step(program)
    report = analyze(compiled, mesh)
    times, metrics = time_steps(cfg, program, compiled, args.warmup, args.steps)
    mem = report.memory
    return {
        "mesh": {a: int(mesh.shape[a]) for a in AXES},
        "schedule": cfg.parallel.schedule if mesh.shape["stage"] > 1 else None,
        "microbatches": cfg.parallel.microbatches,
        "memory": dict(memory_bytes(mem), argument_plus_temp=mem.argument_bytes + mem.temp_bytes),
        "traffic_by_axes": by_axes(report, mesh),
        "compile_s": compile_s,
        "step_time_s": summary(times),
        "step_times_s": times,
        "final_loss": float(metrics["loss"]),
    }


def markdown(rows: list[dict], machine: dict, cfg, args, command: str) -> str:
    head = ["mesh (d, p, t)", "schedule, m", "args + temp per device (MiB)", "args (MiB)", "temp (MiB)",
            "data (MiB/step)", "stage (MiB/step)", "model (MiB/step)", "several axes (MiB/step)",
            "wire, all axes (MiB/step)", "median step (ms)", "compile (s)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        t = r["traffic_by_axes"]
        single = {a: t.get(a, {}).get("result_bytes", 0) for a in AXES}
        several = sum(v["result_bytes"] for k, v in t.items() if "," in k)
        wire = sum(v["wire_bytes"] for v in t.values())
        m = r["mesh"]
        lines.append("| " + " | ".join([
            f"({m['data']}, {m['stage']}, {m['model']})",
            f"{r['schedule']}, {r['microbatches']}" if r["schedule"] else f"—, {r['microbatches']}",
            mib(r["memory"]["argument_plus_temp"]), mib(r["memory"]["argument_bytes"]),
            mib(r["memory"]["temp_bytes"]), mib(single["data"]), mib(single["stage"]), mib(single["model"]),
            mib(several), mib(wire), f"{r['step_time_s']['median'] * 1e3:.0f}", f"{r['compile_s']:.1f}"]) + " |")
    mc = cfg.model
    note = (
        f"\nModel: {mc.arch}, {mc.n_layers} layers, d_model {mc.d_model}, {mc.n_heads} heads, d_ff {mc.d_ff}, "
        f"vocab {mc.vocab_size}, seq_len {mc.seq_len}, {mc.param_dtype}; global batch {cfg.train.global_batch}; "
        f"ZeRO-{cfg.parallel.zero}"
        + (f" (zero3_gather = {cfg.parallel.zero3_gather})" if cfg.parallel.zero == 3 else "")
        + f"; AdamW; remat {cfg.parallel.remat}. A pipeline runs {args.schedule} with m = p microbatches, "
        "otherwise one microbatch.\n\n"
        "Memory: XLA's plan for the compiled step on one device (`compiled.memory_analysis()`): argument bytes "
        "(parameters, optimizer state, batch shard) and temp bytes (activations, gradients, buffers). Traffic: "
        "result bytes per device × executions per step of the collectives that span exactly that mesh axis "
        "(`jaxpar.inspect`; \"several axes\": collectives over two or three axes at once, e.g. the loss and the "
        "shared parameters' gradients summed over data and stage); wire: ring estimates over all collectives "
        "(all-reduce 2B(n-1)/n, all-gather B(n-1)/n, reduce-scatter B(n-1), permute B). A collective inside a "
        "pipeline tick's `lax.cond` branch is counted as if its branch ran every tick, so the stage and model "
        "columns of pipelined meshes are upper bounds (idle ticks skip their compute and its collectives).\n\n"
        f"Measured {machine['date']} on {machine['device_count']} simulated {machine['platform']} devices on "
        f"{machine['cpu_count']} CPU cores ({machine['cpu_model']}; 1-minute load average "
        f"{machine['load_avg_1m_at_start']} when the run started), jax {machine['jax_version']}; median of {args.steps} steps after {args.warmup} warmup, each timed "
        "from dispatch to `jax.block_until_ready`, batches prebuilt. The step times say what the 8 simulated "
        "devices cost on 2 shared cores (where every device's compute runs on the same 2 cores, so more "
        "parallelism mostly adds collectives and per-tick overhead), not what any mesh costs on accelerators; "
        "the memory and traffic columns are properties of the compiled program.\n\n"
        f"Command: `{command}`\n")
    return "\n".join(lines) + "\n" + note


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from jaxpar.config import load_config

    common = overrides(args, DEFAULTS, f"parallel.schedule={args.schedule}")
    cfgs = [load_config(args.config, common + [f"mesh.data={d}", f"mesh.stage={p}", f"mesh.model={t}",
                                               f"parallel.microbatches={p}"])
            for d, p, t in factorizations(args.devices)]  # every config is checked before anything compiles
    simulated_cpu(args.devices)  # --devices means simulated CPU devices, even on a GPU host
    load = load_avg()  # other work on the cores when the run started (2 cores: 2.0 = busy)

    rows = []
    for cfg in cfgs:
        r = measure(cfg, args)
        rows.append(r)
        m = r["mesh"]
        print(f"mesh ({m['data']}, {m['stage']}, {m['model']}): args+temp {mib(r['memory']['argument_plus_temp'])} "
              f"MiB, traffic " + ", ".join(f"{k} {mib(v['result_bytes'])}" for k, v in r["traffic_by_axes"].items())
              + f" MiB/step, median {r['step_time_s']['median'] * 1e3:.0f} ms (compile {r['compile_s']:.1f} s)",
              flush=True)

    machine = {**machine_info(), "load_avg_1m_at_start": load}
    cmd = command("three_d.py")
    result = {
        "benchmark": "three_d", "date": machine["date"], "command": cmd, "machine": machine,
        "config": cfgs[0].to_dict(),  # mesh and parallel.microbatches: as in each row
        "timing": (TIMING + "; compile_s is AOT lower+compile of the step; "
                   "machine.load_avg_1m_at_start: other work on the cores when the run started"),
        "rows": rows,
    }
    write_result(args.out, result, markdown(rows, machine, cfgs[0], args, cmd),
                 f"3D composition: every factorization of {args.devices} devices ({machine['platform']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
