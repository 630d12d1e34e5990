"""Checkpoint save and restore: time and bytes for a mid-size model on 8 simulated CPU devices,
restored onto the same mesh and resharded onto others; and the resident memory that saving keeps.

    python benchmarks/checkpoint.py            # writes benchmarks/results/checkpoint_cpu.json

Saving is timed in two parts: the blocking part (`save` returns once the arrays are copied off
the devices; training continues from there) and the total until the files are committed.

Memory (`memory`): each case runs in a fresh process (jax's caches live as long as the process):
a model's state on (8, 1, 1), orbax imported and the checkpoint manager created, then 4 saves,
each waited for. VmRSS is read (after `gc.collect()`) before the first save and after each one,
then again after `malloc_trim(0)` (`held`: what glibc cannot hand back, i.e. live memory), with
the number of XLA compilations the save triggered. A save's RSS growth is its VmRSS minus the
held figure before it (what it adds, glibc's retained free memory included); its held growth is
the difference of the held figures. Each case is run twice: with jaxpar's saver
(no replica-parallel writes) and with orbax's CPU default (replica-parallel), for the default
config's model (ZeRO-0, as the default config; and ZeRO-1) and a 64M-parameter one (ZeRO-1: its
state replicated 8 times would not fit this machine), so the cost can be compared with the state.

Training (`training`): the default config trained `--loop-steps` steps on (8, 1, 1) in a fresh
process, without checkpoints and with one every quarter of the run (both savers); VmRSS at every
logged step (every 10), with its median before and after the first save, and at the end before
and after `malloc_trim(0)`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, guarded, machine_info, simulated_cpu  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"arch": "llama", "n_layers": 8, "d_model": 512, "n_heads": 8, "n_kv_heads": 4, "d_ff": 2048,
         "vocab_size": 32000, "seq_len": 128}
SAVE_MESH = {"data": 2, "stage": 2, "model": 2}
SAVE_PARALLEL = {"zero": 1, "schedule": "1f1b", "microbatches": 2}
RESTORES = [  # (mesh, parallel)
    (SAVE_MESH, SAVE_PARALLEL),
    ({"data": 8, "stage": 1, "model": 1}, {"zero": 3, "microbatches": 1}),
    ({"data": 1, "stage": 1, "model": 8}, {"zero": 0, "microbatches": 1}),
    ({"data": 1, "stage": 2, "model": 4}, {"zero": 0, "schedule": "gpipe", "microbatches": 2}),
]
MEMORY_CASES = [  # (name, model section, ZeRO stage) on mesh (8, 1, 1)
    ("default config (1.1M parameters), ZeRO-0", {}, 0),
    ("default config's model, ZeRO-1", {}, 1),
    ("64M parameters, ZeRO-1", MODEL, 1),
]
SAVERS = ("jaxpar", "orbax_replica_parallel")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def use_saver(saver: str) -> None:
    """Make jaxpar's Checkpoints save with `saver` (orbax_replica_parallel: orbax's CPU default)."""
    import functools

    from jaxpar.train import checkpoint as ckpt_lib

    if saver == "orbax_replica_parallel":
        ckpt_lib._save_registry = functools.partial(ckpt_lib._save_registry, replica_parallel=True)


def memory_child(spec: dict) -> dict:
    import ctypes

    from jaxpar.mesh import use_cpu_devices

    use_cpu_devices(8)
    import jax

    from jaxpar import model
    from jaxpar.config import from_dict
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.step import build

    use_saver(spec["saver"])
    libc = ctypes.CDLL("libc.so.6")
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(secs) if event == "/jax/core/compile/backend_compile_duration" else None)
    run_dir = tempfile.mkdtemp(prefix="jaxpar_ckpt_mem_")
    try:
        cfg = from_dict({"model": spec["model"], "mesh": {"data": 8}, "parallel": {"zero": spec["zero"]},
                         "train": {"run_dir": run_dir, "checkpoint_every": 1, "keep_checkpoints": 2}})
        program = build(cfg)
        state = jax.block_until_ready(program.init(jax.random.key(0)))
        ckpt = Checkpoints(cfg)
        ckpt.manager  # noqa: B018  (imports orbax and creates the manager: not counted in the saves)

        def point(name: str, n_compiles: int, t: float | None = None) -> dict:
            gc.collect()
            rss = rss_mib()
            libc.malloc_trim(0)
            out = {"at": name, "rss_mib": round(rss, 1), "held_mib": round(rss_mib(), 1),
                   "compiles": len(compiles) - n_compiles}
            if t is not None:
                out["save_s"] = round(time.perf_counter() - t, 3)
            return out

        points = [{**point("before the first save", 0), "compiles": None}]
        for k in range(4):
            state = state._replace(step=state.step + 1)
            n, t = len(compiles), time.perf_counter()
            ckpt.save(state, program.mesh)
            ckpt.wait()
            points.append(point(f"after save {k + 1}", n, t))
        ckpt.close()
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        per_device = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)
        first, last = points[0], points[-1]
        return {**spec, "params": model.count_params(cfg.model), "state_mib": round(state_bytes / 2**20, 1),
                "state_on_devices_mib": round(per_device / 2**20, 1), "points": points,
                "first_save_rss_mib": round(points[1]["rss_mib"] - first["held_mib"], 1),
                "first_save_held_mib": round(points[1]["held_mib"] - first["held_mib"], 1),
                "later_saves_held_mib": round(last["held_mib"] - points[1]["held_mib"], 1)}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def training_child(spec: dict) -> dict:
    import ctypes

    from jaxpar.mesh import use_cpu_devices

    use_cpu_devices(8)
    import jaxpar
    from jaxpar.config import from_dict

    use_saver(spec["saver"])
    run_dir = tempfile.mkdtemp(prefix="jaxpar_ckpt_loop_")
    try:
        every = spec["checkpoint_every"]
        cfg = from_dict({"mesh": {"data": 8}, "train": {"steps": spec["steps"], "log_every": 10,
                                                       "checkpoint_every": every, "run_dir": run_dir}})
        trace = []
        jaxpar.train(cfg, callback=lambda rec: trace.append([rec["step"], round(rss_mib(), 1)]))
        gc.collect()
        end = rss_mib()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        held = rss_mib()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    first_save = every if every else spec["steps"] // 4
    before = [r for s, r in trace if 10 <= s < first_save]  # the record of step `every` comes after its save
    after = [r for s, r in trace if s > first_save]
    return {**spec, "median_rss_mib_before_first_save": statistics.median(before),
            "median_rss_mib_after_first_save": statistics.median(after),
            "first_save_at": first_save, "rss_mib_at_end": round(end, 1), "held_mib_at_end": round(held, 1),
            "rss_mib_at_logged_steps": trace}


def child(kind: str, spec: dict) -> dict:
    """`kind` (memory / training) of `spec` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, __file__, f"--{kind}-child", json.dumps(spec)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} child {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory(args) -> list[dict]:
    rows = []
    for name, model_section, zero in MEMORY_CASES:
        for saver in SAVERS:
            r = child("memory", {"case": name, "model": model_section, "zero": zero, "saver": saver})
            rows.append(r)
            print(f"memory: {name}, {saver}: state {r['state_on_devices_mib']:.0f} MiB on the devices; first save "
                  f"RSS {r['first_save_rss_mib']:+.0f} MiB, held {r['first_save_held_mib']:+.0f} MiB "
                  f"({r['points'][1]['compiles']} compilations); 3 later saves held "
                  f"{r['later_saves_held_mib']:+.0f} MiB", flush=True)
    return rows


def training(args) -> list[dict]:
    rows = []
    every = args.loop_steps // 4
    for saver, ckpt_every in (("none", 0), *((s, every) for s in SAVERS)):
        r = child("training", {"steps": args.loop_steps, "checkpoint_every": ckpt_every,
                               "saver": "jaxpar" if saver == "none" else saver, "checkpoints": saver != "none"})
        rows.append(r)
        b, a = r["median_rss_mib_before_first_save"], r["median_rss_mib_after_first_save"]
        print(f"training {args.loop_steps} steps, checkpoints: {saver if ckpt_every else 'none'}: median RSS "
              f"{b:.0f} MiB up to step {r['first_save_at']}, {a:.0f} MiB after ({a - b:+.0f} MiB, "
              f"{100 * (a - b) / b:+.1f}%); at the end {r['rss_mib_at_end']:.0f} MiB, held "
              f"{r['held_mib_at_end']:.0f} MiB", flush=True)
    return rows


def timing(args) -> dict:
    import jax

    from jaxpar import model
    from jaxpar.config import from_dict
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.step import build

    base = {"model": MODEL, "train": {"global_batch": 8, "checkpoint_every": 1, "keep_checkpoints": 5}}
    run_dir = tempfile.mkdtemp(prefix="jaxpar_ckpt_bench_")
    try:
        cfg = from_dict({**base, "mesh": SAVE_MESH, "parallel": SAVE_PARALLEL,
                         "train": {**base["train"], "run_dir": run_dir}})
        program = build(cfg)
        state = program.init(jax.random.key(0))
        # One training step, so that Adam's moments are not zeros (which would compress to nothing).
        from jaxpar.train.data import batch_at, make_source

        state, _ = program.step(state, batch_at(make_source(cfg), 0, 8, program.batch_sharding))
        jax.block_until_ready(state)
        ckpt = Checkpoints(cfg)
        saves = []
        for k in range(args.repeats):
            state = state._replace(step=state.step + 1)
            t = time.perf_counter()
            path = ckpt.save(state, program.mesh)
            blocking = time.perf_counter() - t
            ckpt.wait()
            saves.append({"blocking_s": blocking, "total_s": time.perf_counter() - t, "bytes": dir_bytes(path)})
        ckpt.close()
        last = int(state.step)
        restores = []
        for mesh, parallel in RESTORES:
            rcfg = cfg.replace(mesh=mesh, parallel=parallel)
            rprog = build(rcfg)
            rck = Checkpoints(rcfg)
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                restored, _ = rck.restore(rprog, last)
                jax.block_until_ready(restored)
                times.append(time.perf_counter() - t)
            rck.close()
            restores.append({"mesh": mesh, "parallel": parallel, "restore_s": min(times), "restore_s_all": times})
            print(f"restore onto {tuple(mesh.values())} {parallel}: {min(times):.2f} s", flush=True)
        n = model.count_params(cfg.model)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    best = min(saves, key=lambda s: s["total_s"])
    print(f"{n:,} parameters, checkpoint {best['bytes'] / 2**20:.0f} MiB: first save blocks {saves[0]['blocking_s']:.2f} s, "
          f"later ones {best['blocking_s']:.2f} s, committed after {best['total_s']:.2f} s", flush=True)
    return {"model": MODEL, "params": n, "state_bytes_float32": n * 4 * 3,
            "saved_on": {"mesh": SAVE_MESH, "parallel": SAVE_PARALLEL}, "saves": saves, "restores": restores}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(args) -> int:
    simulated_cpu(8)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"load_average_start": load_average(), "machine": machine_info(), "command": sys.argv,
              "note": "8 simulated CPU devices on one host; local disk; min over repeats for restores; "
                      "memory and training rows each ran in a fresh process"}
    if args.sections != "timing,memory,training" and out.exists():  # a part rerun: keep the others' results
        kept = json.loads(out.read_text())
        result = {**kept, "load_averages_before": {**kept.get("load_averages_before", {}),
                                                   "first run": kept.get("load_average_start")},
                  "load_average_start": result["load_average_start"], "command": sys.argv}
    sections = {"timing": lambda: timing(args), "memory": lambda: {"memory": memory(args)},
                "training": lambda: {"training": training(args)} if args.loop_steps else {}}
    for name in args.sections.split(","):
        result.update(sections[name]())
        result["load_average_end"] = load_average()
        out.write_text(json.dumps(result, indent=2) + "\n")  # after each section: a long run keeps what it did
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--memory-child", "--training-child"):
        fn = memory_child if sys.argv[1] == "--memory-child" else training_child
        print(json.dumps(fn(json.loads(sys.argv[2]))))
        sys.exit(0)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loop-steps", type=int, default=1000,
                   help="steps of the training-memory runs (default 1000; 0 skips them)")
    p.add_argument("--sections", default="timing,memory,training", help="comma-separated (default: all three)")
    p.add_argument("--out", default=str(RESULTS / "checkpoint_cpu.json"))
    sys.exit(guarded(run, p.parse_args()))
