"""FP8 against bf16: the loss of the tiny Llama trained with `model.fp8` beside the same run in
bf16, on prepared text (issue 44's CPU target: within 2% after 300 steps).

The corpus is benchmarks/muon.py's (the top-level `.py` files of this interpreter's standard
library, byte-level, `python -m jaxpar.data prepare --val-fraction 0.05`, made once under
`--data`). `configs/tiny_llama.yaml`'s llama (ZeRO-1 on mesh data = `--devices`, compute dtype
bfloat16, float32 parameters, AdamW at `--lr`, the same batches for every run) is trained
`--steps` steps through `jaxpar.train.loop.train`, once in bf16 and once with `model.fp8: true`
(every weight matmul of the blocks in e4m3 / e5m2 with current scaling; docs/fp8.md). Per run:
the final train loss (the mean of the last `--tail` logged losses), the final validation loss,
and both curves; then FP8's relative difference from bf16 in each. On CPU the FP8 matmuls run
emulated (converts to the compute dtype): the numbers say how FP8 trains, not how fast.

With `--seeds 0 1 2` every arm runs once per seed (`train.seed`: the initial parameters), and
the differences are reported per seed and as their mean; `--arms` adds `fp8_delayed`
(`model.fp8_scaling: delayed`, a 16-step amax history).

    python benchmarks/fp8.py [--quick] [--steps 300] [--lr 3e-3] [--seeds 0 1 2]
                             [--arms bf16,fp8,fp8_delayed] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_devices_arg, command, guarded, machine_info, write_json  # noqa: E402
from muon import add_curve_args, prepare_corpus, sweep_run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_devices_arg(p)
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate (default 3e-3: "
                                                          "benchmarks/muon.py's best for AdamW on this corpus)")
    add_curve_args(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="train.seed of each run of every arm (default 0)")
    p.add_argument("--arms", default="bf16,fp8", help="comma-separated, of " + ", ".join(ARMS) + " (default bf16,fp8)")
    p.add_argument("--runs", default="/tmp/fp8_bench_runs", help="run directories (scratch)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 20 steps, nothing written without --out")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/fp8_cpu.json)")
    args = p.parse_args(argv)
    args.arms = args.arms.split(",")
    bad = [a for a in args.arms if a not in ARMS]
    if bad or "bf16" not in args.arms:
        p.error(f"--arms {','.join(args.arms)}: each must be one of {', '.join(ARMS)}, bf16 among them (the baseline)")
    if args.quick:
        args.steps = 20
    return args


ARMS = {"bf16": ["model.dtype=bfloat16"],
        "fp8": ["model.dtype=bfloat16", "model.fp8=true"],
        "fp8_delayed": ["model.dtype=bfloat16", "model.fp8=true", "model.fp8_scaling=delayed", "model.fp8_history=16"]}
KEYS = ("final_train_loss_tail_mean", "final_val_loss")


def run(args: argparse.Namespace) -> int:
    corpus = prepare_corpus(args.data)
    sweep = argparse.Namespace(runs=args.runs, sweep_steps=args.steps, data=args.data, devices=args.devices,
                               eval_batches=args.eval_batches, tail=args.tail)
    runs: dict[str, dict[int, dict]] = {arm: {} for arm in args.arms}
    for seed in args.seeds:
        for arm in args.arms:
            r = sweep_run("adamw", args.lr, sweep, extra=[*ARMS[arm], f"train.seed={seed}"], name=f"{arm}_seed{seed}")
            runs[arm][seed] = r
            print(f"{arm} seed {seed}: train {r['final_train_loss_tail_mean']:.4f} (last {r['final_train_loss_last']:.4f}), "
                  f"val {r['final_val_loss']:.4f}, {r['wall_s']:.0f} s", flush=True)
    # Each FP8 arm against bf16 of the same seed, then the mean and range over seeds.
    rel = {arm: {str(seed): {k: runs[arm][seed][k] / runs["bf16"][seed][k] - 1 for k in KEYS} for seed in args.seeds}
           for arm in args.arms if arm != "bf16"}
    for arm, per_seed in rel.items():
        for k in KEYS:
            vals = [per_seed[str(seed)][k] for seed in args.seeds]
            per_seed.setdefault("mean", {})[k] = sum(vals) / len(vals)
            per_seed.setdefault("min", {})[k], per_seed.setdefault("max", {})[k] = min(vals), max(vals)
        print(f"{arm} vs bf16 over seeds {args.seeds}: train mean {per_seed['mean'][KEYS[0]]:+.2%} "
              f"({per_seed['min'][KEYS[0]]:+.2%} .. {per_seed['max'][KEYS[0]]:+.2%}), val mean "
              f"{per_seed['mean'][KEYS[1]]:+.2%} ({per_seed['min'][KEYS[1]]:+.2%} .. {per_seed['max'][KEYS[1]]:+.2%}) "
              "(target: within 2%)")
    out = args.out or (None if args.quick else str(RESULTS / "fp8_cpu.json"))
    if out:
        write_json(out, {"benchmark": "fp8", "command": command("fp8.py"), "machine": machine_info(), "corpus": corpus,
                         "steps": args.steps, "lr": args.lr, "mesh": {"data": args.devices, "stage": 1, "model": 1},
                         "zero": 1, "seeds": args.seeds, "runs": {a: {str(k): v for k, v in r.items()} for a, r in runs.items()},
                         "vs_bf16": rel, "target": "within 2% (issue 44, CPU)"})
        print(f"wrote {os.path.relpath(out)}")
    return 0


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
