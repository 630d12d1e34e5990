"""Checkpoint save and restore: time and bytes for a mid-size model on 8 simulated CPU devices,
restored onto the same mesh and resharded onto others.

    python benchmarks/checkpoint.py            # writes benchmarks/results/checkpoint_cpu.json

Saving is timed in two parts: the blocking part (`save` returns once the arrays are copied off
the devices; training continues from there) and the total until the files are committed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import RESULTS, guarded, machine_info  # noqa: E402

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


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run(args) -> int:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
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
        result = {"model": MODEL, "params": n, "state_bytes_float32": n * 4 * 3,
                  "saved_on": {"mesh": SAVE_MESH, "parallel": SAVE_PARALLEL}, "saves": saves, "restores": restores,
                  "note": "8 simulated CPU devices on one host; local disk; min over repeats for restores",
                  "machine": machine_info(), "command": sys.argv}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    best = min(saves, key=lambda s: s["total_s"])
    print(f"{n:,} parameters, checkpoint {best['bytes'] / 2**20:.0f} MiB: save blocks {best['blocking_s']:.2f} s, "
          f"committed after {best['total_s']:.2f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "checkpoint_cpu.json"))
    sys.exit(guarded(run, p.parse_args()))
