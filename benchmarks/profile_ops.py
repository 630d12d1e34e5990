"""Where a step's time goes, op by op: the self time of every XLA op in a `jax.profiler` trace.

    python benchmarks/profile_ops.py --program pipe --schedule 1f1b --microbatches 8 --pool 4
    python benchmarks/profile_ops.py --program dp --pool 4
    python benchmarks/profile_ops.py --trace runs/x/profile --steps 3     # a training run's trace

With `--program`, builds `pipeline_work.py`'s program (the torch benchmark's llama; `pipe`: the
pipelined step on (1, 4, 1), `dp`: ZeRO-0 on (4, 1, 1)), runs two warm-up steps, traces `--steps`
steps and prints, per op, its self time per step (the op's time on its thread less the ops nested
in it, summed over the pool's threads and the client's, which start each device's program), its
executions per step and, from the compiled program's HLO, its shape and the JAX operation it came
from. With `--trace`, reads an existing trace (a
`.xplane.pb` or a folder holding one, e.g. a run's `train.profile_start` output) instead.

Executions per step tell where an op runs: in a pipeline of p = 4 stages and T ticks, 4·T per
step is once per tick on every stage (work that idle ticks pay too), 4·m once per action. Self
time is thread time, not CPU time: on 2 cores a thread's op also counts the time it waited for a
core, and `Wait: ...` / `Rendezvous` rows are collectives waiting for the other devices. Use it to
rank ops, and `pipeline_work.py` (CPU seconds) to measure a change. How this found the pipeline's
per-tick stash copies: README "Benchmarks", DESIGN.md §5.3.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def self_times(xplane: str) -> tuple[collections.Counter, collections.Counter]:
    """(op -> self nanoseconds, op -> executions) over the trace's XLA threads: the pool's, and the
    client's, which start each device's program (its first ops, e.g. the zero fills) and then wait
    for it (`ThunkExecutor` rows, left out of `report`'s figures)."""
    import jax

    data = jax.profiler.ProfileData.from_file(xplane)
    total, count = collections.Counter(), collections.Counter()
    for line in (line for plane in data.planes for line in plane.lines
                 if line.name.startswith(("tf_XLAEigen", "tf_XLAPjRtCpuClient"))):
        events = sorted(((e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events),
                        key=lambda e: (e[0], -e[1]))
        stack = []  # [end, name, start, nested time]

        def pop():
            end, name, start, nested = stack.pop()
            total[name] += (end - start) - nested
            count[name] += 1
            if stack:
                stack[-1][3] += end - start

        for start, end, name in events:
            while stack and stack[-1][0] <= start:
                pop()
            stack.append([end, name, start, 0])
        while stack:
            pop()
    return total, count


def hlo_index(text: str) -> dict:
    """op name -> (shape, JAX op_name) from a compiled program's HLO text."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) (.*)$", text, re.MULTILINE):
        op = re.search(r'op_name="([^"]*)"', m.group(3))
        out[m.group(1)] = (m.group(2), op.group(1) if op else "")
    return out


def report(total, count, steps: int, hlo: dict, top: int) -> str:
    rows = ["| self s per step | per step | op | shape | from |", "|---:|---:|---|---|---|"]
    executor = lambda k: k.startswith("ThunkExecutor") or "PjRt" in k  # noqa: E731  (the runtime's own rows)
    for name, ns in [(k, v) for k, v in total.most_common() if not executor(k)][:top]:
        shape, op = hlo.get(name, ("", ""))
        op = re.sub(r"^jit\([^)]*\)/(shard_map/)?", "", op)
        rows.append(f"| {ns / steps / 1e9:.4f} | {count[name] / steps:g} | {name} | {shape[:40]} | {op[-90:]} |")
    busy = sum(v for k, v in total.items() if not (k.startswith(("Wait", "Rendezvous")) or executor(k)))
    rows.append(f"\nAll ops' self time: {busy / steps / 1e9:.3f} thread-s per step (waits and the executor's own "
                f"rows excluded).")
    return "\n".join(rows)


def trace_program(args) -> tuple[str, str]:
    """Trace `args.steps` steps of pipeline_work's program; returns (xplane path, HLO text)."""
    from pipeline_work import parse_args
    from torch_pipeline import jaxpar_config

    if args.pool:
        os.environ["PJRT_NPROC"] = str(args.pool)
    bench = parse_args(["--schedule", args.schedule, "--microbatches", str(args.microbatches),
                        *(["--layers", str(args.layers)] if args.layers else [])])
    cfg = jaxpar_config(bench, args.microbatches, args.schedule if args.program == "pipe" else None)
    from jaxpar.mesh import use_cpu_devices

    use_cpu_devices(4, cfg)
    import jax
    from jaxpar.train.data import batch_at, make_source
    from jaxpar.train.step import build

    program = build(cfg)
    compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
    source = make_source(cfg)
    batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(2 + args.steps)]
    state = program.init(jax.random.key(cfg.train.seed))
    for k in range(2):
        state, _ = compiled(state, batches[k])
    jax.block_until_ready(state)
    with jax.profiler.trace(args.out):
        for k in range(2, 2 + args.steps):
            state, metrics = compiled(state, batches[k])
            jax.block_until_ready((state, metrics))
    return newest(args.out), compiled.as_text()


def newest(path: str) -> str:
    if path.endswith(".xplane.pb"):
        return path
    found = sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not found:
        raise SystemExit(f"error: no .xplane.pb under {path}; pass a trace folder or file")
    return found[-1]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--program", choices=["pipe", "dp"], help="trace pipeline_work.py's program")
    p.add_argument("--trace", help="read this trace (.xplane.pb or a folder) instead")
    p.add_argument("--hlo", help="the traced program's HLO text (compiled.as_text()), for shapes and op names")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=None, help="the model's layers (default pipeline_work.py's, 8)")
    p.add_argument("--pool", type=int, default=None, help="PJRT_NPROC (default: as jaxpar.mesh sizes it)")
    p.add_argument("--steps", type=int, default=3, help="steps traced (or in --trace), to divide by")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", default="/tmp/jaxpar_profile_ops", help="where --program writes its trace")
    args = p.parse_args(argv)
    if (args.program is None) == (args.trace is None):
        p.error("give one of --program and --trace")
    if args.program:
        xplane, hlo_text = trace_program(args)
    else:
        xplane, hlo_text = newest(args.trace), (Path(args.hlo).read_text() if args.hlo else "")
    total, count = self_times(xplane)
    print(report(total, count, args.steps, hlo_index(hlo_text), args.top))
    print(f"(trace: {xplane})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
