"""Muon against AdamW: the optimizer step's cost per ZeRO stage, and loss curves at tuned learning rates.

Two parts, both on `--devices` simulated CPU devices (default 8, mesh data = all of them):

**cost** — for `parallel.zero` 0, 1, 2, 3 (one microbatch) and ZeRO-2 with 2 microbatches (so that
ZeRO-2 differs from ZeRO-1: the gradients are reduce-scattered into sharded accumulators), each
with `train.optimizer` adamw and muon, the train step of docs/muon.md's llama (4 layers, d_model
128, d_ff 384, 4 heads, 2 KV heads, vocab 256, seq 128, global batch 16) is AOT-compiled and read:
per-device FLOPs (`compiled.cost_analysis()`), the result bytes of every collective spanning
`data` (`jaxpar.inspect.analyze(...).traffic(spans="data")`, per device per step) and their
ratio to ZeRO-1 AdamW's, XLA's temp and argument bytes (`memory_analysis()`), the optimizer
state's bytes per device (from the state's shardings), and the median wall time of the step
(batches prebuilt, warm-up excluded, each step timed from dispatch to `block_until_ready`).

The optimizer alone is compiled and timed too: one jitted function that takes the parameters,
the optimizer state and a fixed gradient tree (the step's own gradients of one batch, laid out
as the step holds them) and runs the same update as the step (`program.optimizer.update` with
the global gradient norm, the update constrained to the optimizer-state layout, `apply_updates`),
with the step's shardings and donation. It is not the step's own update fused into the step
(XLA may schedule it differently there), but it is the same program text.

**curves** — a byte-level corpus prepared from the `.py` files at the top level of the Python
standard library of this interpreter (sorted; each copied as a `.txt` document; `python -m
jaxpar.data prepare --val-fraction 0.05`), then `configs/tiny_llama.yaml`'s llama (ZeRO-1 on
mesh data 8) trained `--sweep-steps` steps (16 × 128 tokens a step, the same batches for every
run) with each optimizer at each learning rate of `--lrs`, through `jaxpar.train.loop.train`
(the CLI's loop: warmup and cosine schedule, clipping, validation every quarter of the run on
`train.eval_batches` batches of the validation split). Per run: the final train loss (the mean
of the last `--tail` logged losses, and the last one) and the final validation loss; each
optimizer's best learning rate by final validation loss; both best curves (train loss every
`train.log_every` steps, validation at each evaluation). One seed per run.

    python benchmarks/muon.py [--quick] [--parts cost,curves] [--steps 10] [--warmup 2] \
        [--sweep-steps 300] [--lrs 1e-3 3e-3 1e-2 3e-2] [--out FILE.json]

`--quick` is a smoke run (timing 2 steps, ZeRO 0 and 1 only, 20 sweep steps at two learning
rates) that writes nothing unless `--out` is given. CPU times are on shared simulated devices:
they say nothing about accelerator speed.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (TIMING, add_devices_arg, add_timing_args, check_timing_args, command, compile_step,  # noqa: E402
                    guarded, load_avg, machine_info, memory_bytes, mesh_dict, simulated_cpu, summary, time_steps,
                    warmed_up, write_json)

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
# docs/muon.md's model (tests/test_muon.py's _cost_cfg): llama, 4 layers, d_model 128, d_ff 384.
COST_MODEL = ("model.arch=llama", "model.n_layers=4", "model.d_model=128", "model.n_heads=4", "model.n_kv_heads=2",
              "model.d_ff=384", "model.vocab_size=256", "model.seq_len=128", "train.global_batch=16",
              "mesh.data=-1", "mesh.stage=1", "mesh.model=1")
CASES = ((0, 1), (1, 1), (2, 1), (2, 2), (3, 1))  # (parallel.zero, parallel.microbatches)
OPTIMIZERS = ("adamw", "muon")
CURVE_CONFIG = REPO / "configs" / "tiny_llama.yaml"


def add_curve_args(p: argparse.ArgumentParser) -> None:
    """The loss-curve runs' arguments (`sweep_run`; benchmarks/fp8.py's too)."""
    p.add_argument("--tail", type=int, default=5, help="logged losses averaged for the final train loss (default 5)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation (default 8)")
    p.add_argument("--data", default="/tmp/muon_bench_data", help="prepared corpus directory (made if missing)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_devices_arg(p)
    add_timing_args(p, steps=10, warmup=2, per="case")
    p.add_argument("--parts", default="cost,curves", help="comma-separated: cost, curves (default both)")
    p.add_argument("--sweep-steps", type=int, default=300, help="training steps per sweep run (default 300)")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2],
                   help="peak learning rates swept for each optimizer (default 1e-3 3e-3 1e-2 3e-2)")
    p.add_argument("--optimizers", default="adamw,muon", help="comma-separated optimizers swept (default adamw,muon)")
    add_curve_args(p)
    p.add_argument("--runs", default="/tmp/muon_bench_runs", help="run_dir parent for the sweep (replaced)")
    p.add_argument("--quick", action="store_true", help="smoke run; writes nothing unless --out is given")
    p.add_argument("--out", default=None, help="JSON output (default benchmarks/results/muon_cpu.json)")
    args = p.parse_args(argv)
    check_timing_args(p, args)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    args.optimizers = [s.strip() for s in args.optimizers.split(",") if s.strip()]
    if bad := set(args.optimizers) - set(OPTIMIZERS):
        p.error(f"--optimizers: unknown {sorted(bad)}; use adamw, muon")
    if bad := set(args.parts) - {"cost", "curves"}:
        p.error(f"--parts: unknown {sorted(bad)}; use cost, curves")
    if args.quick:
        args.steps, args.warmup, args.sweep_steps, args.lrs = 2, 1, 20, args.lrs[:2]
    if args.out is None and not args.quick:
        args.out = str(RESULTS / "muon_cpu.json")
    return args


# --------------------------------------------------------------------------------------------
# cost


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def _state_bytes(tree) -> int:
    """Per-device bytes of a tree of ShapeDtypeStructs with shardings (one device's shard of each leaf)."""
    import math

    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _collectives(report) -> list[dict]:
    return [{"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes, "executions": c.executions,
             "in_loop": c.in_loop} for c in report.select(spans="data")]


def optimizer_only(program):
    """The step's update alone, jitted with the step's shardings: (params, opt_state, grads) ->
    (params, opt_state), donating the first two."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh, shard = program.mesh, program.state_shardings
    moments = jax.tree.map(lambda s: NamedSharding(mesh, s), program.layout.moments, is_leaf=lambda x: isinstance(x, P))
    grads = jax.tree.map(lambda s: NamedSharding(mesh, s), program.layout.grads, is_leaf=lambda x: isinstance(x, P))

    def update(params, opt_state, g):
        updates, opt_state = program.optimizer.update(g, opt_state, params, grad_norm=optax.tree.norm(g))
        updates = jax.lax.with_sharding_constraint(updates, moments)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(update, in_shardings=(shard.params, shard.opt_state, grads),
                   out_shardings=(shard.params, shard.opt_state), donate_argnums=(0, 1)), grads


def measure_cost(cfg, args) -> dict:
    import jax
    from jaxpar.inspect import analyze
    from jaxpar.train.step import build

    program = build(cfg)
    mesh = program.mesh
    abstract = program.abstract_state()
    compiled, compile_s = compile_step(program)
    report = analyze(compiled, mesh)
    times, metrics = time_steps(cfg, program, compiled, args.warmup, args.steps)

    # The optimizer alone, on the step's gradients of one batch (fixed), state after warm-up.
    opt_fn, grad_shardings = optimizer_only(program)
    g_abstract = jax.tree.map(lambda p, sh: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sh),
                              abstract.params, grad_shardings)
    t = time.perf_counter()
    opt_compiled = opt_fn.lower(abstract.params, abstract.opt_state, g_abstract).compile()
    opt_compile_s = time.perf_counter() - t
    opt_report = analyze(opt_compiled, mesh)
    state, batches = warmed_up(cfg, program, compiled, args.warmup, 1)
    _, g = program.loss_and_grads(state.params, batches[0])
    g = jax.device_put(g, grad_shardings)
    params, opt_state = state.params, state.opt_state
    jax.block_until_ready((params, opt_state, g))
    for _ in range(args.warmup):
        params, opt_state = opt_compiled(params, opt_state, g)
    jax.block_until_ready((params, opt_state))
    opt_times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        params, opt_state = opt_compiled(params, opt_state, g)
        jax.block_until_ready((params, opt_state))
        opt_times.append(time.perf_counter() - t)

    return {
        "optimizer": cfg.train.optimizer, "zero": cfg.parallel.zero, "microbatches": cfg.parallel.microbatches,
        "mesh": mesh_dict(mesh),
        "step": {
            "flops_per_device": _flops(compiled),
            "data_bytes_per_device": report.traffic(spans="data"),
            "collectives_data_axis": _collectives(report),
            "memory": memory_bytes(report.memory),
            "compile_s": compile_s,
            "time_s": summary(times), "times_s": times,
            "final_loss": float(metrics["loss"]),
        },
        "optimizer_state_bytes_per_device": _state_bytes(abstract.opt_state),
        "params_bytes_per_device": _state_bytes(abstract.params),
        "optimizer_only": {
            "flops_per_device": _flops(opt_compiled),
            "data_bytes_per_device": opt_report.traffic(spans="data"),
            "collectives_data_axis": _collectives(opt_report),
            "temp_bytes": opt_report.memory.temp_bytes,
            "compile_s": opt_compile_s,
            "time_s": summary(opt_times), "times_s": opt_times,
        },
    }


def run_cost(args) -> list[dict]:
    from jaxpar.config import load_config

    cases = CASES if not args.quick else ((0, 1), (1, 1))
    rows = []
    for zero, mb in cases:
        for opt in OPTIMIZERS:
            cfg = load_config(None, list(COST_MODEL) + [f"runtime.cpu_devices={args.devices}", f"parallel.zero={zero}",
                                                        f"parallel.microbatches={mb}", f"train.optimizer={opt}"])
            r = measure_cost(cfg, args)
            rows.append(r)
            s = r["step"]
            print(f"zero={zero} mb={mb} {opt:5s}: {s['flops_per_device']:.4g} FLOPs/dev, data "
                  f"{s['data_bytes_per_device']:,} B, temp {s['memory']['temp_bytes']:,} B, opt state "
                  f"{r['optimizer_state_bytes_per_device']:,} B, step {s['time_s']['median'] * 1e3:.1f} ms, "
                  f"optimizer alone {r['optimizer_only']['time_s']['median'] * 1e3:.1f} ms", flush=True)
    base = next((r for r in rows if r["zero"] == 1 and r["microbatches"] == 1 and r["optimizer"] == "adamw"), None)
    for r in rows:
        same = next(a for a in rows if a["optimizer"] == "adamw" and a["zero"] == r["zero"]
                    and a["microbatches"] == r["microbatches"])
        r["data_bytes_vs_zero1_adamw"] = (r["step"]["data_bytes_per_device"] / base["step"]["data_bytes_per_device"]
                                          if base else None)
        r["flops_minus_adamw"] = r["step"]["flops_per_device"] - same["step"]["flops_per_device"]
        r["step_time_vs_adamw"] = r["step"]["time_s"]["median"] / same["step"]["time_s"]["median"]
        r["optimizer_only_time_vs_adamw"] = (r["optimizer_only"]["time_s"]["median"]
                                             / same["optimizer_only"]["time_s"]["median"])
    return rows


# --------------------------------------------------------------------------------------------
# curves


def stdlib_inputs() -> tuple[str, list[str]]:
    """The top-level `.py` files of this interpreter's standard library, sorted (the corpus)."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    return root, sorted(glob.glob(os.path.join(root, "*.py")))


def prepare_corpus(data: str) -> dict:
    """Prepare the byte-level corpus at `data` (once: an existing directory is reused)."""
    import json

    root, files = stdlib_inputs()
    if not os.path.exists(os.path.join(data, "meta.json")):
        src = data.rstrip("/") + "_src"
        shutil.rmtree(src, ignore_errors=True)
        os.makedirs(src)
        for f in files:  # prepare reads .txt: each file copied unchanged as one document
            shutil.copyfile(f, os.path.join(src, os.path.basename(f) + ".txt"))
        subprocess.run([sys.executable, "-m", "jaxpar.data", "prepare", "--input", src, "--out", data,
                        "--val-fraction", "0.05", "--force"], check=True, cwd=REPO)
    meta = json.loads(Path(data, "meta.json").read_text())
    return {"source": f"top-level *.py of the Python standard library ({root}), sorted, each one document",
            "files": len(files), "bytes": meta["n_bytes"], "train_tokens": meta["train"]["n_tokens"],
            "val_tokens": meta["val"]["n_tokens"], "tokenizer": meta["tokenizer"], "val_fraction": 0.05,
            "prepare": f"python -m jaxpar.data prepare --input <copies as .txt> --out {data} --val-fraction 0.05"}


def sweep_run(opt: str, lr: float, args, extra: tuple = (), name: str | None = None) -> dict:
    """One run of `CURVE_CONFIG` with optimizer `opt` at `lr` (and the `--set`s `extra`), in
    `args.runs`/`name` (default `<opt>_lr<lr>`). benchmarks/fp8.py runs it too."""
    from jaxpar.config import load_config
    from jaxpar.train.loop import train

    run_dir = os.path.join(args.runs, name or f"{opt}_lr{lr:g}")
    shutil.rmtree(run_dir, ignore_errors=True)
    steps = args.sweep_steps
    sets = [f"runtime.cpu_devices={args.devices}", f"data.source={args.data}", "model.vocab_size=256",
            "parallel.zero=1", f"train.optimizer={opt}", f"train.lr={lr}", f"train.steps={steps}",
            f"train.warmup_steps={max(1, min(20, steps // 10))}", f"train.log_every={max(1, min(10, steps // 10))}",
            f"train.eval_every={max(1, steps // 4)}", f"train.eval_batches={args.eval_batches}",
            f"train.run_dir={run_dir}", "train.checkpoint_every=0", *extra]
    cfg = load_config(str(CURVE_CONFIG), sets)
    t = time.perf_counter()
    history = train(cfg)
    wall = time.perf_counter() - t
    losses = [(r["step"], r["loss"]) for r in history if "loss" in r]
    vals = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    tail = [v for _, v in losses[-args.tail:]]
    finite = all(v == v and abs(v) != float("inf") for _, v in losses)
    return {"optimizer": opt, "lr": lr, "steps": steps, "wall_s": wall,
            "final_train_loss_tail_mean": statistics.fmean(tail), "final_train_loss_last": losses[-1][1],
            "final_val_loss": vals[-1][1] if vals else None, "finite": finite,
            "skipped_steps": history[-1].get("skipped_steps") if history else None,
            "train_loss": losses, "val_loss": vals,
            "median_step_time_s": statistics.median(r["step_time_s"] for r in history[1:]) if len(history) > 1 else None,
            "config": {k: v for k, v in cfg.to_dict()["train"].items()
                       if k in ("lr", "steps", "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip", "b1", "b2",
                                "muon_momentum", "muon_ns_dtype", "global_batch", "seed", "log_every", "eval_every",
                                "eval_batches")}}


def run_curves(args) -> dict:
    corpus = prepare_corpus(args.data)
    runs = []
    for opt in args.optimizers:
        for lr in args.lrs:
            r = sweep_run(opt, lr, args)
            runs.append(r)
            print(f"{opt:5s} lr {lr:g}: train {r['final_train_loss_tail_mean']:.4f} (last {r['final_train_loss_last']:.4f})"
                  f", val {r['final_val_loss']}, {r['wall_s']:.0f} s", flush=True)
    best = {}
    for opt in args.optimizers:
        ok = [r for r in runs if r["optimizer"] == opt and r["final_val_loss"] is not None
              and r["final_val_loss"] == r["final_val_loss"]]
        if ok:
            b = min(ok, key=lambda r: r["final_val_loss"])
            best[opt] = {"lr": b["lr"], "final_val_loss": b["final_val_loss"],
                         "final_train_loss_tail_mean": b["final_train_loss_tail_mean"],
                         "at_grid_edge": b["lr"] in (min(args.lrs), max(args.lrs)),
                         "train_loss": b["train_loss"], "val_loss": b["val_loss"]}
    from jaxpar.config import load_config

    model = load_config(str(CURVE_CONFIG), []).to_dict()["model"]
    return {"corpus": corpus, "model": model, "mesh": {"data": args.devices, "stage": 1, "model": 1}, "zero": 1,
            "tokens_per_run": args.sweep_steps * 16 * 128, "seed": 0, "seeds_per_point": 1,
            "best_by": "final validation loss", "runs": [{k: v for k, v in r.items() if k not in ("train_loss", "val_loss")}
                                                         | {"val_loss": r["val_loss"]} for r in runs],
            "best": best}


# --------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


def run(args: argparse.Namespace) -> int:
    simulated_cpu(args.devices)
    t0 = time.perf_counter()
    result = {"benchmark": "muon", "command": command("muon.py"), "load_avg_start": load_avg(),
              "timing": TIMING + "; optimizer alone: the same update jitted by itself on fixed gradients"}
    if "cost" in args.parts:
        t = time.perf_counter()
        result["cost"] = {"model": "llama, 4 layers, d_model 128, d_ff 384, 4 heads, 2 KV heads, vocab 256, seq 128, "
                                   "global batch 16, float32", "steps": args.steps, "warmup": args.warmup,
                          "rows": run_cost(args)}
        result["cost"]["wall_s"] = time.perf_counter() - t
    if "curves" in args.parts:
        t = time.perf_counter()
        result["curves"] = run_curves(args)
        result["curves"]["wall_s"] = time.perf_counter() - t
    result["wall_s"] = time.perf_counter() - t0
    result["load_avg_end"] = load_avg()
    result["machine"] = machine_info()
    result["date"] = result["machine"]["date"]
    try:
        result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                          text=True).stdout.strip()
        # Whether jaxpar and configs/ differ from that commit (the figures are of the commit only if not).
        result["uncommitted_changes"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "--", "jaxpar", "configs"], cwd=REPO, capture_output=True,
            text=True).stdout.strip())
    except OSError:
        result["commit"] = None
    if args.out:
        print(f"-> {write_json(args.out, result)}")
    print(f"done in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
