"""What the benchmarks share: arguments, configs, simulated devices, timing, memory, results.

A script imports it after putting its own folder on the path:

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import RESULTS, guarded, machine_info, ...  # noqa: E402

Nothing here imports JAX at module level: a script can parse its arguments and set the devices
(`simulated_cpu`) before any backend starts.
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

TIMING = ("each step timed alone, dispatch to jax.block_until_ready on the new state and metrics; "
          "batches prebuilt with batch_at before timing")  # how `time_steps` times, for a result's "timing"


# --------------------------------------------------------------------------------------------
# Arguments


def add_config_args(p: argparse.ArgumentParser, config_help: str | None, example: str) -> None:
    """`--config FILE` (left out where `config_help` is None) and repeatable `--set K=V`
    (into `args.overrides`; `example` is the key=value its help shows)."""
    if config_help is not None:
        p.add_argument("--config", default=None, help=config_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help=f"override a config key, e.g. --set {example} (repeatable)")


def add_devices_arg(p: argparse.ArgumentParser, default: int = 8) -> None:
    """`--devices N`: simulated CPU devices."""
    p.add_argument("--devices", type=int, default=default, help=f"simulated CPU devices (default {default})")


def add_timing_args(p: argparse.ArgumentParser, steps: int, warmup: int, per: str | None = None) -> None:
    """`--steps N` timed steps (per `per`: a mesh, a mode, ...) and `--warmup N` untimed steps."""
    p.add_argument("--steps", type=int, default=steps,
                   help=f"timed steps{f' per {per}' if per else ''} (default {steps})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps after compiling (default {warmup})")


def add_out_arg(p: argparse.ArgumentParser, name: str) -> None:
    """`--out FILE.json`, default `benchmarks/results/<name>`; the Markdown table goes beside it."""
    p.add_argument("--out", default=str(RESULTS / name),
                   help=f"JSON output; the Markdown table goes next to it with suffix .md "
                        f"(default: benchmarks/results/{name})")


def check_timing_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error unless --steps and --devices (where given) are >= 1 and --warmup >= 0."""
    devices = getattr(args, "devices", None)
    if args.steps < 1 or args.warmup < 0 or (devices is not None and devices < 1):
        p.error("--steps and --devices must be at least 1, --warmup at least 0")


def guarded(run, args: argparse.Namespace) -> int:
    """Run a benchmark; a user's mistake in its config ends in one line and exit code 2."""
    from jaxpar.config import JaxparError
    try:
        return run(args)
    except JaxparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------------------------
# Configs and devices


def overrides(args: argparse.Namespace, defaults: tuple[str, ...], *extra: str) -> list[str]:
    """The `--set` list a benchmark's configs share: its default model (only without `--config`),
    `runtime.cpu_devices=--devices`, `extra`, then the user's `--set`s (which win)."""
    base = [] if getattr(args, "config", None) else list(defaults)
    return base + [f"runtime.cpu_devices={args.devices}", *extra] + list(args.overrides)


def simulated_cpu(n: int, cfg=None) -> None:
    """Run on `n` simulated CPU devices, even on a GPU host (`jaxpar.mesh.use_cpu_devices`: sets
    jax_platforms=cpu, the device count, XLA_FLAGS and the thread pool). Call before anything
    starts a JAX backend."""
    from jaxpar.mesh import use_cpu_devices

    use_cpu_devices(n, cfg)


def mesh_dict(mesh) -> dict[str, int]:
    """{axis: size} of a jax Mesh, in its axis order."""
    return {a: int(mesh.shape[a]) for a in mesh.axis_names}


# --------------------------------------------------------------------------------------------
# Compiling and timing


def compile_step(program, state=None):
    """AOT lower + compile of `program.step` (on `state`, or the abstract state) and the seconds it took."""
    t = time.perf_counter()
    compiled = program.step.lower(program.abstract_state() if state is None else state,
                                  program.abstract_batch()).compile()
    return compiled, time.perf_counter() - t


def warmed_up(cfg, program, step_fn, warmup: int, steps: int) -> tuple:
    """A fresh state after `warmup` untimed steps of `step_fn`, and the `steps` batches to time,
    all built (and on their devices) before any clock starts."""
    import jax
    from jaxpar.train.data import batch_at, make_source

    source = make_source(cfg)
    state = program.init(jax.random.key(cfg.train.seed))
    batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(warmup + steps)]
    jax.block_until_ready((state, batches))
    for batch in batches[:warmup]:
        state, _ = step_fn(state, batch)
    jax.block_until_ready(state)
    return state, batches[warmup:]


def time_steps(cfg, program, step_fn, warmup: int, steps: int) -> tuple[list[float], dict]:
    """Seconds of each of `steps` steps after `warmup` untimed ones, and the last step's metrics.

    Every batch is built (and on its devices) before the clock starts; each step is timed from
    dispatch to `jax.block_until_ready` of its state and metrics."""
    import jax

    state, batches = warmed_up(cfg, program, step_fn, warmup, steps)
    times = []
    for batch in batches:
        t = time.perf_counter()
        state, metrics = step_fn(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    return times, metrics


def summary(times: list[float]) -> dict[str, float]:
    """{"median", "min", "max"} of step times (a result's "step_time_s")."""
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def memory_bytes(mem) -> dict[str, int]:
    """XLA's plan for a compiled program per device (a `jaxpar.inspect.Memory`, from
    `compiled.memory_analysis()`): argument, temp, output and alias bytes."""
    return {"argument_bytes": mem.argument_bytes, "temp_bytes": mem.temp_bytes,
            "output_bytes": mem.output_bytes, "alias_bytes": mem.alias_bytes}


def wire_bytes(kind: str, result_bytes: int, n: int) -> float:
    """Estimated bytes one device sends in a ring collective over n devices, from its result size."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * result_bytes * (n - 1) / n
    if kind == "all-gather":
        return result_bytes * (n - 1) / n
    if kind == "reduce-scatter":
        return result_bytes * (n - 1)
    if kind == "all-to-all":
        return result_bytes * (n - 1) / n
    return float(result_bytes)  # collective-permute / broadcast: one buffer out


# --------------------------------------------------------------------------------------------
# The machine and the result files


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict:
    """The machine, library versions and today's date, as every result file records them (no hostname)."""
    import flax
    import jax
    import jaxlib

    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
            "platform": jax.default_backend(), "jax_version": jax.__version__,
            "jaxlib_version": jaxlib.__version__, "flax_version": flax.__version__,
            "python": platform.python_version(), "date": datetime.date.today().isoformat()}


def load_avg() -> float:
    """The 1-minute load average, rounded to 2 places: other work on the cores (2 cores: 2.0 = busy)."""
    return round(os.getloadavg()[0], 2)


def command(script: str) -> str:
    """How this run was started, as a result records it: `python benchmarks/<script> <args>`."""
    return " ".join(["python", f"benchmarks/{script}"] + sys.argv[1:])


def mib(x: float) -> str:
    """Bytes as MiB with two decimals, for a table."""
    return f"{x / 2**20:.2f}"


def write_json(out: str | Path, result: dict) -> Path:
    """Write `result` as indented JSON to `out` (its folder made first)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


def write_result(out: str | Path, result: dict, table: str, title: str | None = None) -> None:
    """Write `result` as JSON to `out` and the Markdown `table` (under `# title`, where given) beside
    it with suffix .md; print the table and both paths."""
    out = write_json(out, result)
    out.with_suffix(".md").write_text((f"# {title}\n\n" if title else "") + table)
    print(table)
    print(f"-> {out}, {out.with_suffix('.md')}")


# --------------------------------------------------------------------------------------------
# Worker processes (a driver that runs each program in a process of its own)


def say(kind: str, **data) -> None:
    """A worker's message to its driver: one JSON line on stdout, {"kind": kind, **data}."""
    print(json.dumps({"kind": kind, **data}), flush=True)


def read_message(proc, who: str, kind: str | None = None) -> dict:
    """The next `say` message (a stdout line that starts with "{") of the worker `proc`, skipping
    other kinds where `kind` is given; exits naming `who` if the worker ends first."""
    for line in proc.stdout:
        if line.startswith("{"):
            msg = json.loads(line)
            if kind is None or msg["kind"] == kind:
                return msg
    raise SystemExit(f"{who} worker exited ({proc.wait()}) "
                     + (f"before reporting {kind!r}" if kind else "without a report"))
