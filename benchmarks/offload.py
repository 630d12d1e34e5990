"""ZeRO-Offload (`parallel.offload: optimizer`) against the optimizer state in device memory: the
compiled step's arguments in device and in host memory, its temp bytes, and the step time.

For each `parallel.zero` in 0, 1, 3 the train step is built and AOT-compiled twice on one mesh,
with `parallel.offload` none and optimizer, and the script reports per device:

- argument bytes of `compiled.memory_analysis()`, and of them those the compiled entry layout
  places in host memory (`jaxpar.inspect.host_argument_bytes`: memory space S(5)); XLA:CPU's
  analysis counts host arguments among its arguments, so the device's share is the difference;
- the optimizer state's bytes on the ZeRO layout (`jaxpar.parallel.zero.state_bytes`), which the
  device's share must fall by;
- temp bytes;
- the median wall time of a step over `--steps` steps after `--warmup`, the two programs of a ZeRO
  stage timed in turns (one step of each per round), so load on the machine falls on both alike.

On CPU the host and device memories are one: this measures the program's placement and what the
copies cost as XLA:CPU runs them, not a PCIe transfer (that needs a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_config_args, add_devices_arg, add_out_arg, add_timing_args, check_timing_args, command,  # noqa: E402
                    compile_step, guarded, machine_info, mib, overrides, simulated_cpu, write_result)
from zero import DEFAULTS  # noqa: E402  (zero.py's model)

STAGES = (0, 1, 3)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p, None, "model.d_model=512")  # the model: benchmarks/zero.py's
    add_devices_arg(p)
    add_timing_args(p, steps=10, warmup=2, per="program")
    add_out_arg(p, "offload_cpu.json")
    args = p.parse_args(argv)
    check_timing_args(p, args)
    return args


def run(args: argparse.Namespace) -> int:
    import jax
    from jaxpar import model
    from jaxpar.config import load_config
    from jaxpar.inspect import analyze
    from jaxpar.mesh import make_mesh
    from jaxpar.parallel.zero import state_bytes
    from jaxpar.train.data import batch_at, make_source
    from jaxpar.train.step import build

    common = overrides(args, DEFAULTS)
    cfgs = {(z, o): load_config(None, common + [f"parallel.zero={z}", f"parallel.offload={o}"])
            for z in STAGES for o in ("none", "optimizer")}
    simulated_cpu(args.devices)  # --devices means simulated CPU devices, even on a GPU host
    rows = []
    for z in STAGES:
        programs, steps, states = {}, {}, {}
        for o in ("none", "optimizer"):
            cfg = cfgs[z, o]
            mesh = make_mesh(cfg)
            program = build(cfg, mesh)
            state = program.init(jax.random.key(cfg.train.seed))
            compiled, compile_s = compile_step(program, state)
            mem = analyze(compiled, mesh).memory
            shapes = model.param_shapes(cfg.model)
            opt = state_bytes(program.layout, shapes, mesh)["optimizer"]["per_device"]
            programs[o], steps[o], states[o] = program, compiled, state
            rows.append({"zero": z, "offload": o, "argument_bytes": mem.argument_bytes,
                         "host_argument_bytes": mem.host_argument_bytes,
                         "device_argument_bytes": mem.argument_bytes - mem.host_argument_bytes,
                         "optimizer_bytes": opt, "temp_bytes": mem.temp_bytes, "compile_s": compile_s})
        cfg = cfgs[z, "none"]
        source = make_source(cfg)
        batches = [batch_at(source, k, cfg.train.global_batch, programs["none"].batch_sharding)
                   for k in range(args.warmup + args.steps)]
        times = {"none": [], "optimizer": []}
        for k, batch in enumerate(batches):  # in turns: one step of each per round
            for o in ("none", "optimizer"):
                t = time.perf_counter()
                states[o], metrics = steps[o](states[o], batch)
                jax.block_until_ready((states[o], metrics))
                if k >= args.warmup:
                    times[o].append(time.perf_counter() - t)
        for r in rows[-2:]:
            r["step_time_s"] = {"median": statistics.median(times[r["offload"]]), "all": times[r["offload"]]}
            print(f"zero={z} offload={r['offload']}: device args {mib(r['device_argument_bytes'])} MiB, host args "
                  f"{mib(r['host_argument_bytes'])} MiB, temp {mib(r['temp_bytes'])} MiB, median "
                  f"{r['step_time_s']['median'] * 1e3:.1f} ms", flush=True)

    machine = machine_info()
    cmd = command("offload.py")
    result = {"benchmark": "offload", "date": machine["date"], "command": cmd,
              "machine": machine, "config": cfgs[0, "none"].to_dict(), "rows": rows}
    lines = [f"# parallel.offload: optimizer ({machine['platform']})", "",
             f"`{cmd}`; {machine.get('cpu_model')}, {machine.get('cpu_count')} cores, jax {machine['jax_version']}, "
             f"{args.devices} simulated devices; MiB per device; steps timed in turns", "",
             "| ZeRO | offload | device args | host args | optimizer state | temp | median step (ms) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['zero']} | {r['offload']} | {mib(r['device_argument_bytes'])} | "
                     f"{mib(r['host_argument_bytes'])} | {mib(r['optimizer_bytes'])} | {mib(r['temp_bytes'])} | "
                     f"{r['step_time_s']['median'] * 1e3:.1f} |")
    write_result(args.out, result, "\n".join(lines) + "\n")
    return 0


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
