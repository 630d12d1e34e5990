"""CPU seconds per step of jaxpar's pipelined step against its data-parallel step: the pipeline's extra work.

    python benchmarks/pipeline_work.py [--schedule 1f1b] [--microbatches 8] [--short 3] [--long 13]
        [--repeats 3] [--warmup 2] [--layers 8] [--d-model 256] ... [--quick] [--out FILE.json]

Two jaxpar train steps of the same model and the same batch (`torch_pipeline.py`'s model: llama, 8
layers, d_model 256, 8 heads, 8 kv heads, d_ff 704, vocab 1024, seq 128, float32, AdamW, clip 1.0,
`parallel.remat: none`; global batch 2·m sequences), on 4 simulated CPU devices each:

- pipe: mesh (data 1, stage 4, model 1), `parallel.schedule` = `--schedule`, `parallel.microbatches`
  = m (`--microbatches`, microbatches of 2 sequences);
- dp: mesh (data 4, stage 1, model 1), ZeRO-0, one microbatch (m/2 sequences per device).

Each runs in its own process (`jaxpar.mesh.use_cpu_devices(4, cfg)` sizes the CPU client's thread
pool per program: 32 threads for the pipeline, XLA's own 4 for ZeRO-0 data parallelism, as
`jaxpar.train` would run them), AOT-compiled and warmed up (`--warmup` steps) before anything is
measured. The work of a step is the process's CPU time (`time.process_time()`: user + sys of all
threads) over a run of N consecutive steps, each dispatched and waited for
(`jax.block_until_ready`) in turn on prebuilt batches: per step it is

    (cpu(N_long) - cpu(N_short)) / (N_long - N_short),

so what a run costs once (the first dispatch, the wait for the last step) cancels as compile
would. Runs alternate between the two processes in ABBA order (pipe short, dp short, dp long, pipe
long; then the reverse), `--repeats` times; each repeat gives one estimate per program and the
median is reported, with the ratio pipe / dp (goal of issue 14, part 7: within 10%; the executor's
B recomputes each chunk's forward, so about 4/3 plus per-tick overhead is expected before that
rewrite). Wall seconds per step are reported the same way, for reference only: the 4 devices
share 2 cores and other work shares them too. CPU time counts every thread of the process,
including pool threads that spin while they wait, so it is the cost of the program as run, not
FLOPs alone; `--pool N` runs both with PJRT_NPROC=N instead, to separate the pool's share.

Writes benchmarks/results/pipeline_work_cpu.json (machine, load average, every run's figures,
command). `--quick` is a smoke run (m = 4, a small model, 1 and 3 steps, 1 repeat) that writes
nothing unless `--out` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, read_message, say  # noqa: E402
from torch_pipeline import MICRO, P, QUICK, SHAPES, jaxpar_config  # noqa: E402  (the same model and config)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default="1f1b", help="parallel.schedule of the pipelined step (default 1f1b)")
    p.add_argument("--microbatches", type=int, default=None, help="m, microbatches of 2 sequences (default 8)")
    p.add_argument("--short", type=int, default=None, help="steps in a short run (default 3)")
    p.add_argument("--long", type=int, default=None, help="steps in a long run (default 13)")
    p.add_argument("--repeats", type=int, default=None, help="ABBA repeats of short and long runs (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling (default 2)")
    p.add_argument("--pool", type=int, default=None,
                   help="PJRT_NPROC for both programs (default: each as jaxpar.mesh.use_cpu_devices sizes it; fewer "
                        "threads than jaxpar asks for can hang a pipeline, so this is for separating the pool's cost "
                        "from the executor's)")
    p.add_argument("--stage-layers", default=None,
                   help="parallel.stage_layers of the pipelined step, comma-separated (e.g. 1,3,3,1; default even)")
    p.add_argument("--dp-microbatches", type=int, default=1,
                   help="parallel.microbatches of the data-parallel step (default 1; m/4 gives each of its "
                        "matmuls the pipeline's microbatch of 2 sequences, separating microbatching's cost)")
    p.add_argument("--attention", default="auto", choices=["auto", "xla_lse", "xla"],
                   help="model.attention of both steps (default auto: xla_lse on a CPU)")
    p.add_argument("--quick", action="store_true", help="smoke run: m = 4, a small model, 1 and 3 steps, nothing written")
    p.add_argument("--out", default=None, help="JSON output (default: benchmarks/results/pipeline_work_cpu.json)")
    for name in SHAPES:
        p.add_argument("--" + name, type=int, default=None, help=f"model shape (default {SHAPES[name]})")
    p.add_argument("--worker", choices=["pipe", "dp"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in SHAPES:
        key = name.replace("-", "_")
        if getattr(args, key) is None:
            setattr(args, key, (QUICK if args.quick else SHAPES)[name])
    q = args.quick
    args.microbatches = args.microbatches or (4 if q else 8)
    args.short = args.short if args.short is not None else (1 if q else 3)
    args.long = args.long if args.long is not None else (3 if q else 13)
    args.repeats = args.repeats if args.repeats is not None else (1 if q else 3)
    if args.short < 1 or args.long <= args.short or args.repeats < 1 or args.warmup < 0 or args.microbatches < 1:
        p.error("need 1 <= --short < --long, --repeats >= 1, --warmup >= 0, --microbatches >= 1")
    return args


def worker(args) -> int:
    from jaxpar.config import ConfigError

    try:
        cfg = jaxpar_config(args, args.microbatches, args.schedule if args.worker == "pipe" else None)
        if args.worker == "pipe" and args.stage_layers:
            cfg = cfg.replace(parallel={"stage_layers": [int(c) for c in args.stage_layers.split(",")]})
        if args.worker == "dp" and args.dp_microbatches > 1:
            cfg = cfg.replace(parallel={"microbatches": args.dp_microbatches})
    except ConfigError as e:
        say("refused", reason=str(e))
        return 0
    from jaxpar.mesh import cpu_threads, use_cpu_devices

    use_cpu_devices(P, cfg)
    import jax
    from jaxpar.train.data import batch_at, make_source
    from jaxpar.train.step import build
    from common import machine_info

    program = build(cfg)
    t, c = time.perf_counter(), time.process_time()
    compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
    compile_s, compile_cpu_s = time.perf_counter() - t, time.process_time() - c
    mem = compiled.memory_analysis()
    source = make_source(cfg)
    n = args.warmup + args.repeats * (args.short + args.long)
    batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(n)]
    state = program.init(jax.random.key(cfg.train.seed))
    jax.block_until_ready((state, batches))
    k = 0
    for _ in range(args.warmup):
        state, metrics = compiled(state, batches[k % n])
        k += 1
    jax.block_until_ready(state)
    say("ready", mesh={a: int(program.mesh.shape[a]) for a in ("data", "stage", "model")},
        compile_s=compile_s, compile_cpu_s=compile_cpu_s, temp_bytes=int(mem.temp_size_in_bytes),
        pool_threads=max(cpu_threads(), jax.local_device_count()), PJRT_NPROC=os.environ.get("PJRT_NPROC"),
        machine=machine_info())
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        walls, cpus = [], []
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(cmd["n"]):
            t, c = time.perf_counter(), time.process_time()
            state, metrics = compiled(state, batches[k % n])
            jax.block_until_ready((state, metrics))
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
            k += 1
        say("run", n=cmd["n"], cpu_s=time.process_time() - c0, wall_s=time.perf_counter() - t0,
            step_wall_s=walls, step_cpu_s=cpus, loss=float(metrics["loss"]))
    return 0


class Worker:
    def __init__(self, kind: str, args):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--schedule", args.schedule,
               "--microbatches", str(args.microbatches), "--short", str(args.short), "--long", str(args.long),
               "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
        cmd += ["--pool", str(args.pool)] if args.pool else []
        cmd += ["--stage-layers", args.stage_layers] if args.stage_layers else []
        cmd += ["--dp-microbatches", str(args.dp_microbatches), "--attention", args.attention]
        cmd += [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in SHAPES]
        env = dict(os.environ)
        for var in ("PJRT_NPROC", "NPROC", "XLA_FLAGS"):
            env.pop(var, None)
        if args.pool:
            env["PJRT_NPROC"] = str(args.pool)  # use_cpu_devices keeps a PJRT_NPROC already set
        repo = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([repo] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.kind = kind
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def read(self) -> dict:
        return read_message(self.proc, self.kind)

    def run(self, n: int) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": "run", "n": n}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    command = " ".join(["python", "benchmarks/pipeline_work.py"] + sys.argv[1:])
    load = {"start": os.getloadavg()}
    workers, ready = {}, {}
    try:
        for kind in ("pipe", "dp"):  # one compile at a time
            workers[kind] = Worker(kind, args)
            ready[kind] = workers[kind].read()
            if ready[kind]["kind"] == "refused":
                print(f"error: jaxpar refuses the {kind} config: {ready[kind]['reason']}", file=sys.stderr)
                return 2
            print(f"{kind}: mesh {ready[kind]['mesh']}, compiled in {ready[kind]['compile_s']:.1f} s, "
                  f"{ready[kind]['pool_threads']} pool threads", flush=True)
        runs = {"pipe": [], "dp": []}
        loads = []
        for rep in range(args.repeats):
            a, b = ("pipe", "dp") if rep % 2 == 0 else ("dp", "pipe")
            got = {}
            for kind, n in ((a, args.short), (b, args.short), (b, args.long), (a, args.long)):
                got[(kind, n)] = workers[kind].run(n)
                loads.append(os.getloadavg())
            for kind in ("pipe", "dp"):
                s, lg = got[(kind, args.short)], got[(kind, args.long)]
                d = args.long - args.short
                runs[kind].append({"cpu_s_per_step": (lg["cpu_s"] - s["cpu_s"]) / d,
                                   "wall_s_per_step": (lg["wall_s"] - s["wall_s"]) / d,
                                   "short": s, "long": lg})
            print(f"repeat {rep}: CPU s/step pipe {runs['pipe'][-1]['cpu_s_per_step']:.3f}, "
                  f"dp {runs['dp'][-1]['cpu_s_per_step']:.3f}; load {loads[-1][0]:.1f}", flush=True)
        load["end"] = os.getloadavg()
    finally:
        for w in workers.values():
            w.close()
    load["during"] = loads
    load["median_1min"] = statistics.median(x[0] for x in loads)
    cpu = {k: statistics.median(r["cpu_s_per_step"] for r in v) for k, v in runs.items()}
    wall = {k: statistics.median(r["wall_s_per_step"] for r in v) for k, v in runs.items()}
    ratio = cpu["pipe"] / cpu["dp"]
    machine = ready["pipe"]["machine"]
    print(f"\n| program | mesh (data, stage, model) | CPU s per step | wall s per step | pool threads | temp MiB per device |\n"
          f"|---|---|---:|---:|---:|---:|")
    split = f", stage_layers {args.stage_layers}" if args.stage_layers else ""
    for kind, label in (("pipe", f"pipelined ({args.schedule}, m = {args.microbatches}{split})"),
                        ("dp", "data-parallel ZeRO-0" + (f", m = {args.dp_microbatches}"
                                                         if args.dp_microbatches > 1 else ""))):
        r = ready[kind]
        mesh = ", ".join(str(r["mesh"][a]) for a in ("data", "stage", "model"))
        print(f"| {label} | ({mesh}) | {cpu[kind]:.3f} | {wall[kind]:.3f} | {r['pool_threads']} | "
              f"{r['temp_bytes'] / 2**20:.1f} |")
    print(f"\nCPU time per step, pipelined / data-parallel: {ratio:.3f} (goal: within 1.10); wall: "
          f"{wall['pipe'] / wall['dp']:.3f}. Median of {args.repeats} estimates, each (cpu({args.long}) - "
          f"cpu({args.short})) / {args.long - args.short}. Measured {machine['date']} on {machine['cpu_count']} "
          f"shared CPU cores ({machine['cpu_model']}), jax {machine['jax_version']}; 1-minute load average "
          f"{load['start'][0]:.1f} at the start, median {load['median_1min']:.1f}, {load['end'][0]:.1f} at the end.")
    result = {
        "benchmark": "pipeline_work", "date": machine["date"], "command": command, "machine": machine,
        "model": {"arch": "llama", **{k.replace("-", "_"): getattr(args, k.replace("-", "_")) for k in SHAPES},
                  "dtype": "float32", "remat": "none"},
        "pool": args.pool, "schedule": args.schedule, "stage_layers": args.stage_layers,
        "microbatches": args.microbatches, "microbatch_sequences": MICRO, "dp_microbatches": args.dp_microbatches,
        "global_batch": MICRO * args.microbatches, "devices": P,
        "short": args.short, "long": args.long, "repeats": args.repeats, "warmup": args.warmup,
        "cpu_s_per_step": cpu, "wall_s_per_step": wall, "ratio_cpu_pipe_over_dp": ratio,
        "ratio_wall_pipe_over_dp": wall["pipe"] / wall["dp"],
        "method": ("process CPU time (time.process_time, all threads) over runs of N consecutive steps, each "
                   "dispatched and block_until_ready'd, on prebuilt batches after compile and warmup; per step = "
                   "(cpu(long) - cpu(short)) / (long - short); runs alternated ABBA between the two processes; "
                   "median over repeats"),
        "programs": {k: {kk: vv for kk, vv in v.items() if kk not in ("kind", "machine")} for k, v in ready.items()},
        "runs": runs, "loadavg": load,
    }
    if args.out or not args.quick:
        out = Path(args.out) if args.out else RESULTS / "pipeline_work_cpu.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
