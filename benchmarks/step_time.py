"""Wall-clock time of one compiled train step (jaxpar.train.step) on a config and mesh.

Data batches are built before timing, so the figures exclude host-side data generation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML config (default: the bundled defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override a config key, e.g. --set train.global_batch=32 (repeatable)")
    p.add_argument("--devices", type=int, default=None,
                   help="run on N simulated CPU devices (sets runtime.cpu_devices; default: the config's)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling (default 3)")
    p.add_argument("--out", default=None, help="JSON output (default: "
                   "benchmarks/results/step_time_<platform>_<data>x<stage>x<model>.json)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or (args.devices is not None and args.devices < 1):
        p.error("--steps and --devices must be at least 1, --warmup at least 0")
    return args


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict:
    import flax
    import jax
    import jaxlib

    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
            "platform": jax.default_backend(), "jax_version": jax.__version__,
            "jaxlib_version": jaxlib.__version__, "flax_version": flax.__version__,
            "python": platform.python_version(), "date": datetime.date.today().isoformat()}


def time_steps(cfg, program, step_fn, warmup: int, steps: int) -> tuple[list[float], dict]:
    """Seconds of each of `steps` steps after `warmup` untimed ones, and the last step's metrics.

    Every batch is built (and on its devices) before the clock starts; each step is timed from
    dispatch to `jax.block_until_ready` of its state and metrics."""
    import jax
    from jaxpar.train.data import batch_at, make_source

    source = make_source(cfg)
    state = program.init(jax.random.key(cfg.train.seed))
    batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(warmup + steps)]
    jax.block_until_ready((state, batches))
    for batch in batches[:warmup]:
        state, _ = step_fn(state, batch)
    jax.block_until_ready(state)
    times = []
    for batch in batches[warmup:]:
        t = time.perf_counter()
        state, metrics = step_fn(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    return times, metrics


def guarded(run, args: argparse.Namespace) -> int:
    """Run a benchmark; a user's mistake in its config ends in one line and exit code 2."""
    from jaxpar.config import JaxparError
    try:
        return run(args)
    except JaxparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


def run(args: argparse.Namespace) -> int:
    import jax
    from jaxpar.config import load_config
    from jaxpar.mesh import use_cpu_devices

    overrides = list(args.overrides)
    if args.devices is not None:
        overrides.append(f"runtime.cpu_devices={args.devices}")
        jax.config.update("jax_platforms", "cpu")  # --devices means simulated CPU devices, even on a GPU host
    cfg = load_config(args.config, overrides)
    use_cpu_devices(cfg.runtime.cpu_devices, cfg)  # before anything below starts a JAX backend

    from jaxpar.train.data import make_source
    from jaxpar.train.step import build

    make_source(cfg)  # a data error ends here, before anything compiles
    program = build(cfg)
    mesh = {a: int(program.mesh.shape[a]) for a in ("data", "stage", "model")}
    tr = cfg.train

    t = time.perf_counter()
    step_fn = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
    compile_s = time.perf_counter() - t
    times, metrics = time_steps(cfg, program, step_fn, args.warmup, args.steps)

    median = statistics.median(times)
    tokens_per_step = tr.global_batch * cfg.model.seq_len
    result = {
        "config": cfg.to_dict(), "mesh": mesh, "steps": args.steps, "warmup": args.warmup,
        "step_time_s": {"median": median, "min": min(times), "max": max(times)},
        "step_times_s": times,
        "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / median,
        "compile_s": compile_s, "final_loss": float(metrics["loss"]),
        "timing": ("each step timed alone, dispatch to jax.block_until_ready on the new state and "
                   "metrics; batches prebuilt with batch_at before timing, so host data time is excluded; "
                   "compile_s is AOT lower+compile of the step"),
        "machine": machine_info(),
        "command": sys.argv,
    }
    out = Path(args.out) if args.out else (
        RESULTS / f"step_time_{jax.default_backend()}_{mesh['data']}x{mesh['stage']}x{mesh['model']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    shape = "x".join(str(v) for v in mesh.values())
    print(f"step_time {jax.default_backend()} mesh {shape} on {jax.device_count()} device(s): "
          f"median {median * 1e3:.1f} ms (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}) over "
          f"{args.steps} steps, {tokens_per_step / median:,.0f} tokens/s, compile {compile_s:.1f} s, "
          f"final loss {result['final_loss']:.3f} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
