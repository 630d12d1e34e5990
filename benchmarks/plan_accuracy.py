"""The planner against the compiled program: predicted vs XLA's per-device memory and bytes per axis.

For each configuration of a 3D matrix (small llama / gpt2, d_model 128, seq 128, global batch 16 on
8 simulated CPU devices; every axis alone and together, every ZeRO stage, remat policy and
schedule, sequence parallelism, accumulation), compiles the train step (`lower_step`, nothing
runs) and reports:

- memory: `jaxpar.plan.memory(platform="cpu")` total against `compiled.memory_analysis()`
  arguments + temp, and the predicted parts;
- traffic: `jaxpar.plan.compiled_bytes_per_axis` against `jaxpar.inspect`'s
  `Report.traffic(spans=axis)` for data, stage and model.

Writes `results/plan_accuracy_cpu.json` and `.md` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, guarded, machine_info, simulated_cpu  # noqa: E402

MATRIX = {
    "one-device": dict(mesh=(1, 1, 1)),
    "dp8": dict(mesh=(8, 1, 1)),
    "dp8-zero1": dict(mesh=(8, 1, 1), zero=1),
    "dp8-zero3": dict(mesh=(8, 1, 1), zero=3),
    "dp8-m2": dict(mesh=(8, 1, 1), microbatches=2),
    "dp8-zero3-m2": dict(mesh=(8, 1, 1), zero=3, microbatches=2),
    "dp8-full": dict(mesh=(8, 1, 1), remat="full"),
    "dp8-zero2-dots": dict(mesh=(8, 1, 1), zero=2, remat="dots"),
    "dp2-tp4-zero1": dict(mesh=(2, 1, 4), zero=1),
    "dp4-tp2-sp": dict(mesh=(4, 1, 2), sequence_parallel=True),
    "tp8-sp-dots": dict(mesh=(1, 1, 8), N=8, K=4, sequence_parallel=True, remat="dots"),
    "3d-1f1b-sp": dict(mesh=(2, 2, 2), zero=1, microbatches=4, sequence_parallel=True),
    "pp4-tp2-gpipe": dict(mesh=(1, 4, 2), schedule="gpipe", microbatches=4),
    "dp2-pp4-1f1b": dict(mesh=(2, 4, 1), microbatches=8),
    "3d-interleaved": dict(mesh=(2, 2, 2), schedule="interleaved_1f1b", virtual_stages=2, microbatches=4),
    "pp8-full": dict(mesh=(1, 8, 1), L=8, microbatches=8, remat="full"),
    "gpt2-dp8-zero3": dict(arch="gpt2", mesh=(8, 1, 1), zero=3),
    "gpt2-3d-1f1b": dict(arch="gpt2", mesh=(2, 2, 2), microbatches=4),
    "gpt2-dp2-tp4-sp": dict(arch="gpt2", mesh=(2, 1, 4), sequence_parallel=True),
    "dp2-tp4-dots": dict(mesh=(2, 1, 4), remat="dots"),
    "dp2-pp4-zb": dict(mesh=(2, 4, 1), schedule="zb_h1", microbatches=4),
    "pp4-tp2-zb-dots": dict(mesh=(1, 4, 2), schedule="zb_h1", microbatches=8, remat="dots"),
    "gpt2-3d-1f1b-dots": dict(arch="gpt2", mesh=(2, 2, 2), microbatches=4, remat="dots"),
    # The V placement (tests/test_plan.py's V cases).
    "dp2-pp4-zbv-dots": dict(mesh=(2, 4, 1), L=8, schedule="zb_v", virtual_stages=2, microbatches=8, remat="dots"),
    "3d-dualpipe-v": dict(mesh=(2, 2, 2), schedule="dualpipe_v", virtual_stages=2, microbatches=4),
    "dp2-pp4-dualpipe-v-full": dict(mesh=(2, 4, 1), L=8, schedule="dualpipe_v", virtual_stages=2, microbatches=8,
                                    remat="full"),
    # A known gap (not in the tests): a split table with tensor parallelism and no remat.
    "pp4-tp2-1f1b-L8": dict(mesh=(1, 4, 2), L=8, microbatches=8),
    # Where the gradients' reduction rule takes its other branches (tests/test_plan.py, REDUCTION).
    "dp8-zero3-step-m2": dict(mesh=(8, 1, 1), zero=3, microbatches=2, zero3_gather="step"),
    "dp4-pp2-zero3-1f1b": dict(mesh=(4, 2, 1), zero=3, microbatches=4),
    "dp4-pp2-zero3-zb": dict(mesh=(4, 2, 1), zero=3, microbatches=4, schedule="zb_h1"),
    "dp4-pp2-zero2-microbatch": dict(mesh=(4, 2, 1), zero=2, microbatches=4, zero2_reduce="microbatch"),
    "3d-zero3-interleaved-dots": dict(mesh=(2, 2, 2), zero=3, microbatches=4, schedule="interleaved_1f1b",
                                      virtual_stages=2, remat="dots"),
}


def small(arch="llama", mesh=(8, 1, 1), L=4, N=4, K=2, **par):
    from jaxpar.config import from_dict
    return from_dict({
        "model": {"arch": arch, "n_layers": L, "d_model": 128, "n_heads": N, "n_kv_heads": K if arch == "llama" else None,
                  "d_ff": 384, "vocab_size": 256, "seq_len": 128},
        "mesh": dict(zip(("data", "stage", "model"), mesh)), "parallel": par, "train": {"global_batch": 16}})


def run(args) -> int:
    simulated_cpu(8)
    import jax

    from jaxpar.inspect import analyze
    from jaxpar.mesh import make_mesh
    from jaxpar.costs import compiled_bytes_per_axis, memory
    from jaxpar.train.step import lower_step

    rows = []
    for name, case in MATRIX.items():
        cfg = small(**case)
        shape = tuple(case["mesh"])
        mesh = make_mesh(cfg, jax.devices()[:math.prod(shape)])
        report = analyze(lower_step(cfg, mesh)[0], mesh)
        measured = report.memory.argument_bytes + report.memory.temp_bytes
        pred = memory(cfg, shape, platform="cpu")
        traffic = compiled_bytes_per_axis(cfg, shape, "cpu")
        row = {"name": name, "case": case, "memory_measured": measured, "memory_predicted": pred,
               "memory_error": pred["total"] / measured - 1, "traffic": {}}
        for axis in ("data", "stage", "model"):
            got = report.traffic(spans=axis)
            row["traffic"][axis] = {"measured": got, "predicted": traffic[axis],
                                    "error": (traffic[axis] / got - 1) if got else None}
        rows.append(row)
        print(f"{name:18s} memory {measured / 2**20:8.2f} MiB predicted {pred['total'] / 2**20:8.2f} "
              f"({row['memory_error']:+.1%}); traffic " + ", ".join(
                  f"{a} {v['error']:+.1%}" for a, v in row["traffic"].items() if v["error"] is not None), flush=True)
    out = Path(args.out)
    out.write_text(json.dumps({"machine": machine_info(), "command": " ".join(sys.argv), "rows": rows}, indent=1))
    lines = ["| config | measured MiB (args + temp) | predicted MiB | error | data bytes error | stage | model |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        err = {a: ("" if v["error"] is None else f"{v['error']:+.1%}") for a, v in r["traffic"].items()}
        lines.append(f"| {r['name']} | {r['memory_measured'] / 2**20:.2f} | {r['memory_predicted']['total'] / 2**20:.2f} "
                     f"| {r['memory_error']:+.1%} | {err['data']} | {err['stage']} | {err['model']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(RESULTS / "plan_accuracy_cpu.json"), help="JSON output (.md next to it)")
    return guarded(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
