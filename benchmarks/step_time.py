"""Wall-clock time of one compiled train step (jaxpar.train.step) on a config and mesh.

Data batches are built before timing, so the figures exclude host-side data generation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, TIMING, add_config_args, add_timing_args, check_timing_args, compile_step,  # noqa: E402
                    guarded, machine_info, summary, time_steps, write_json)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p, "YAML config (default: the bundled defaults)", "train.global_batch=32")
    p.add_argument("--devices", type=int, default=None,
                   help="run on N simulated CPU devices (sets runtime.cpu_devices; default: the config's)")
    add_timing_args(p, steps=20, warmup=3)
    p.add_argument("--out", default=None, help="JSON output (default: "
                   "benchmarks/results/step_time_<platform>_<data>x<stage>x<model>.json)")
    args = p.parse_args(argv)
    check_timing_args(p, args)
    return args


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

    step_fn, compile_s = compile_step(program)
    times, metrics = time_steps(cfg, program, step_fn, args.warmup, args.steps)

    median = statistics.median(times)
    tokens_per_step = tr.global_batch * cfg.model.seq_len
    result = {
        "config": cfg.to_dict(), "mesh": mesh, "steps": args.steps, "warmup": args.warmup,
        "step_time_s": summary(times),
        "step_times_s": times,
        "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / median,
        "compile_s": compile_s, "final_loss": float(metrics["loss"]),
        "timing": TIMING + ", so host data time is excluded; compile_s is AOT lower+compile of the step",
        "machine": machine_info(),
        "command": sys.argv,
    }
    out = Path(args.out) if args.out else (
        RESULTS / f"step_time_{jax.default_backend()}_{mesh['data']}x{mesh['stage']}x{mesh['model']}.json")
    write_json(out, result)

    shape = "x".join(str(v) for v in mesh.values())
    print(f"step_time {jax.default_backend()} mesh {shape} on {jax.device_count()} device(s): "
          f"median {median * 1e3:.1f} ms (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}) over "
          f"{args.steps} steps, {tokens_per_step / median:,.0f} tokens/s, compile {compile_s:.1f} s, "
          f"final loss {result['final_loss']:.3f} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
