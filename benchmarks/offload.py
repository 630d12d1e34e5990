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
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import guarded, machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STAGES = (0, 1, 3)
DEFAULTS = ("model.arch=llama", "model.n_layers=4", "model.d_model=256", "model.n_heads=4",
            "model.d_ff=1024", "model.vocab_size=256", "model.seq_len=64", "train.global_batch=16")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override a config key (repeatable); default model: benchmarks/zero.py's")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per program (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling (default 2)")
    p.add_argument("--out", default=str(RESULTS / "offload_cpu.json"), help="JSON output (.md beside it)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.devices < 1:
        p.error("--steps and --devices must be at least 1, --warmup at least 0")
    return args


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def run(args: argparse.Namespace) -> int:
    import jax
    from jaxpar import model
    from jaxpar.config import load_config
    from jaxpar.inspect import analyze
    from jaxpar.mesh import make_mesh, use_cpu_devices
    from jaxpar.parallel.zero import state_bytes
    from jaxpar.train.data import batch_at, make_source
    from jaxpar.train.step import build

    jax.config.update("jax_platforms", "cpu")
    common = list(DEFAULTS) + [f"runtime.cpu_devices={args.devices}"] + list(args.overrides)
    cfgs = {(z, o): load_config(None, common + [f"parallel.zero={z}", f"parallel.offload={o}"])
            for z in STAGES for o in ("none", "optimizer")}
    use_cpu_devices(args.devices)
    rows = []
    for z in STAGES:
        programs, steps, states = {}, {}, {}
        for o in ("none", "optimizer"):
            cfg = cfgs[z, o]
            mesh = make_mesh(cfg)
            program = build(cfg, mesh)
            state = program.init(jax.random.key(cfg.train.seed))
            t = time.perf_counter()
            compiled = program.step.lower(state, program.abstract_batch()).compile()
            compile_s = time.perf_counter() - t
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
    command = " ".join(["python", "benchmarks/offload.py"] + sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "offload", "date": machine["date"], "command": command,
                               "machine": machine, "config": cfgs[0, "none"].to_dict(), "rows": rows},
                              indent=2) + "\n")
    lines = [f"# parallel.offload: optimizer ({machine['platform']})", "",
             f"`{command}`; {machine.get('cpu_model')}, {machine.get('cpu_count')} cores, jax {machine['jax_version']}, "
             f"{args.devices} simulated devices; MiB per device; steps timed in turns", "",
             "| ZeRO | offload | device args | host args | optimizer state | temp | median step (ms) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['zero']} | {r['offload']} | {mib(r['device_argument_bytes'])} | "
                     f"{mib(r['host_argument_bytes'])} | {mib(r['optimizer_bytes'])} | {mib(r['temp_bytes'])} | "
                     f"{r['step_time_s']['median'] * 1e3:.1f} |")
    table = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"-> {out}, {out.with_suffix('.md')}")
    return 0


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
