"""Naive data parallelism (torch DataParallel's pattern) against DDP and ZeRO-1/2/3, side by side.

For `parallel.data_mode = naive` and for DDP with `parallel.zero` = 0, 1, 2, 3 (one microbatch),
the train step of one config is built and AOT-compiled on one mesh (data = all devices), and the
script reports per mode:

- the median wall time of one step over `--steps` steps after `--warmup` (batches prebuilt, each
  step timed from dispatch to `jax.block_until_ready`, as in `step_time.py`); the modes are timed
  in turns, one step of each per round, so that other work on a shared machine weighs on all alike;
- bytes sent and received per step by device 0 and by the other devices, from the compiled HLO's
  collectives (`jaxpar.inspect.device_traffic`): collective-permutes exactly as their
  source/target pairs say, group collectives by the ring model (all-reduce of B: 2B(n-1)/n each
  way; all-gather of result B: B(n-1)/n; reduce-scatter of result B: B(n-1));
- memory of device 0 and of the others: XLA's plan for the compiled step (argument and temp bytes
  from `compiled.memory_analysis()`: one SPMD program, the same on every device), and the bytes of
  live model state each device holds (parameters + optimizer state that is ever read; naive mode's
  other ranks allocate an optimizer-state slot that stays zeros).

One command reruns everything: `python benchmarks/naive_dp.py` (the ZeRO rows come from the same
code as benchmarks/zero.py's, so a change to ZeRO shows up here on rerun).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_config_args, add_devices_arg, add_out_arg, add_timing_args, command,  # noqa: E402
                    compile_step, guarded, load_avg, machine_info, memory_bytes, mesh_dict, mib, overrides,
                    simulated_cpu, summary, warmed_up, write_result)
from zero import DEFAULTS  # noqa: E402  (zero.py's model when no --config is given)
# (name, overrides): the modes compared.
MODES = (("naive", ("parallel.data_mode=naive", "parallel.zero=0")),
         ("ddp", ("parallel.data_mode=ddp", "parallel.zero=0")),
         ("zero1", ("parallel.data_mode=ddp", "parallel.zero=1")),
         ("zero2", ("parallel.data_mode=ddp", "parallel.zero=2")),
         ("zero3", ("parallel.data_mode=ddp", "parallel.zero=3")))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p, "YAML config (default: benchmarks/zero.py's model)", "model.d_model=512")
    add_devices_arg(p)
    add_timing_args(p, steps=20, warmup=2, per="mode")
    p.add_argument("--modes", default=",".join(n for n, _ in MODES),
                   help=f"comma-separated subset of {', '.join(n for n, _ in MODES)} (default: all)")
    add_out_arg(p, "naive_dp_cpu.json")
    args = p.parse_args(argv)
    known = {n for n, _ in MODES}
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.steps < 1 or args.warmup < 0 or args.devices < 2 or not args.modes or set(args.modes) - known:
        p.error(f"--steps at least 1, --warmup at least 0, --devices at least 2, --modes among {sorted(known)}")
    return args


def live_state_bytes(cfg, program, shapes) -> tuple[int, int]:
    """Bytes of model state that device 0 and another device hold and use: parameters plus
    optimizer state, per the program's layout (naive: the whole optimizer state on device 0 only)."""
    from jaxpar.parallel.zero import state_bytes

    acct = state_bytes(program.layout, shapes, program.mesh)
    params, opt = acct["params"]["per_device"], acct["optimizer"]["per_device"]
    if cfg.parallel.data_mode == "naive":
        return params + acct["optimizer"]["replicated"], params
    return params + opt, params + opt


def measure(name: str, cfg) -> tuple[dict, tuple]:
    import numpy as np
    from jaxpar.inspect import analyze, compiled_device_traffic
    from jaxpar.model import count_params, param_shapes
    from jaxpar.train.step import build

    program = build(cfg)
    mesh = program.mesh
    shapes = param_shapes(cfg.model)
    psi = count_params(cfg.model)
    compiled, compile_s = compile_step(program)
    report = analyze(compiled, mesh)
    sent, received = compiled_device_traffic(compiled, mesh)
    sent, received = sent.ravel(), received.ravel()  # mesh position 0 is device 0 (rank 0 of data)
    live0, live_other = live_state_bytes(cfg, program, shapes)
    mem = report.memory
    kinds = sorted({c.kind for c in report.select(spans="data")})
    return {
        "mode": name, "data_mode": cfg.parallel.data_mode, "zero": cfg.parallel.zero,
        "mesh": mesh_dict(mesh), "psi": psi,
        "compile_s": compile_s,
        "bytes_per_step": {
            "device0": {"sent": float(sent[0]), "received": float(received[0])},
            "others": {"sent_min": float(np.min(sent[1:])), "sent_max": float(np.max(sent[1:])),
                       "received_min": float(np.min(received[1:])), "received_max": float(np.max(received[1:]))},
            "per_device_sent": sent.tolist(), "per_device_received": received.tolist()},
        "collective_kinds_over_data": kinds,
        "collectives_over_data": len(report.select(spans="data")),
        "memory": {"xla_plan_per_device": memory_bytes(mem),
                   "live_state_device0": live0, "live_state_others": live_other},
    }, (cfg, program, compiled)


def time_interleaved(runs: list, warmup: int, steps: int) -> list[tuple[list[float], float]]:
    """Seconds of `steps` steps of every program, taken in turns (one step of each mode per round),
    so that load from other work on the machine falls on every mode alike; `warmup` untimed steps
    each first. Batches are built before the clock starts; each step is timed from dispatch to
    `jax.block_until_ready` of its state and metrics (as in step_time.py). Returns (times, last loss)."""
    import jax

    live = []
    for cfg, program, compiled in runs:
        state, batches = warmed_up(cfg, program, compiled, warmup, steps)
        live.append([compiled, state, batches, [], None])
    for k in range(steps):
        for run in live:
            compiled, state, batches, times, _ = run
            t = time.perf_counter()
            state, metrics = compiled(state, batches[k])
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t)
            run[1], run[4] = state, metrics
    return [(times, float(metrics["loss"])) for _, _, _, times, metrics in live]


def markdown(rows: list[dict], machine: dict, cfg, command: str) -> str:
    head = ["mode", "median step (ms)", "device 0 sent / received (MiB/step)",
            "other devices sent / received (MiB/step)", "device 0 bytes vs DDP's",
            "XLA plan per device: arguments + temp (MiB)", "live state device 0 / others (MiB)"]
    ddp = next((r for r in rows if r["mode"] == "ddp"), None)
    base = (ddp["bytes_per_step"]["device0"]["sent"] + ddp["bytes_per_step"]["device0"]["received"]) if ddp else None
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        b, o, m = r["bytes_per_step"]["device0"], r["bytes_per_step"]["others"], r["memory"]
        other = (f"{mib(o['sent_max'])} / {mib(o['received_max'])}" if o["sent_min"] == o["sent_max"]
                 and o["received_min"] == o["received_max"] else
                 f"{mib(o['sent_min'])}–{mib(o['sent_max'])} / {mib(o['received_min'])}–{mib(o['received_max'])}")
        plan = m["xla_plan_per_device"]
        lines.append("| " + " | ".join([
            r["mode"], f"{r['step_time_s']['median'] * 1e3:.1f}", f"{mib(b['sent'])} / {mib(b['received'])}", other,
            f"{(b['sent'] + b['received']) / base:.2f}×" if base else "-",
            f"{mib(plan['argument_bytes'])} + {mib(plan['temp_bytes'])}",
            f"{mib(m['live_state_device0'])} / {mib(m['live_state_others'])}"]) + " |")
    mdl, r0 = cfg.model, rows[0]
    note = (
        f"\nModel: {mdl.arch}, {mdl.n_layers} layers, d_model {mdl.d_model}, d_ff {mdl.d_ff}, vocab "
        f"{mdl.vocab_size}, seq_len {mdl.seq_len}, global batch {cfg.train.global_batch}, Ψ = {r0['psi']:,} "
        f"{mdl.param_dtype} parameters ({mib(4 * r0['psi'])} MiB), AdamW; mesh data={r0['mesh']['data']}; one "
        "microbatch. Bytes per step from the compiled HLO: collective-permutes exact (source/target pairs), "
        "group collectives by the ring model. XLA's memory plan is one SPMD program, the same on every "
        "device; live state is parameters plus the optimizer state a device reads (naive: all of it on "
        "device 0, none elsewhere).\n\n"
        f"Measured {machine['date']} on {machine['device_count']} simulated {machine['platform']} devices on "
        f"{machine['cpu_count']} shared CPU cores ({machine['cpu_model']}), jax {machine['jax_version']}; 1-minute "
        f"load average {machine['load_avg_1m_at_start']} at the start, {machine['load_avg_1m_before_timing']} "
        f"before timing and {machine['load_avg_1m_after_timing']} after; median of {r0['steps']} steps after "
        f"{r0['warmup']} warmup, the modes timed in turns (one step of each per round). Step times on simulated "
        "devices sharing two cores measure compute and memory copies, not interconnect bandwidth.\n\n"
        f"Command: `{command}`\n")
    return "\n".join(lines) + "\n" + note


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from jaxpar.config import load_config

    common = overrides(args, DEFAULTS, "mesh.data=-1", "mesh.stage=1", "mesh.model=1", "parallel.microbatches=1")
    modes = dict(MODES)
    cfgs = [(name, load_config(args.config, common + list(modes[name]))) for name in args.modes]  # all checked first
    simulated_cpu(args.devices)  # --devices means simulated CPU devices, even on a GPU host
    load = load_avg()

    rows, runs = [], []
    for name, cfg in cfgs:
        r, run_ = measure(name, cfg)
        rows.append(r)
        runs.append(run_)
    load_timing = load_avg()
    for r, (times, loss) in zip(rows, time_interleaved(runs, args.warmup, args.steps)):
        r.update(steps=args.steps, warmup=args.warmup, final_loss=loss, step_times_s=times,
                 step_time_s=summary(times))
        b = r["bytes_per_step"]
        print(f"{r['mode']}: median {r['step_time_s']['median'] * 1e3:.1f} ms, device 0 sent {mib(b['device0']['sent'])} "
              f"received {mib(b['device0']['received'])} MiB, others sent <= {mib(b['others']['sent_max'])} "
              f"received <= {mib(b['others']['received_max'])} MiB (compile {r['compile_s']:.1f} s)", flush=True)

    machine = {**machine_info(), "load_avg_1m_at_start": load,
               "load_avg_1m_before_timing": load_timing, "load_avg_1m_after_timing": load_avg()}
    cmd = command("naive_dp.py")
    result = {
        "benchmark": "naive_dp", "date": machine["date"], "command": cmd, "machine": machine,
        "config": cfgs[0][1].to_dict(),  # data_mode and zero: as in each row
        "timing": ("modes timed in turns, one step of each per round; each step timed alone, dispatch to "
                   "jax.block_until_ready on the new state and metrics; batches prebuilt; compile_s is AOT "
                   "lower+compile of the step; load averages: other work on the cores (2 cores: 2.0 = busy)"),
        "rows": rows,
    }
    write_result(args.out, result, markdown(rows, machine, cfgs[0][1], cmd),
                 f"Naive data parallelism vs DDP and ZeRO ({machine['platform']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
