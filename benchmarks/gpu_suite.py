"""One GPU, one script: every GPU measurement of issues 44 (Hopper speed: bf16 MFU, FP8) and 45
(MoE at dense speed), within a time budget, into one results file. Made for a lent device's ~15
minutes: run it once (`--budget-s` leaves time to rerun), read the file, and give the machine back.

Parts, in order (each a list of cases; a case that fails is recorded and the others go on; a case
that would start past the budget is skipped and recorded as such):

1. **bf16**: the Llama-1B preset (`configs/llama_1b.yaml`: 16 layers, d_model 2048, seq 2048),
   8 sequences a step, remat none, cuDNN attention: step time, tokens/s and MFU, with attention
   counted in full (6N + 12·L·d·S per token, benchmarks/gpu.py's) and halved for causal masking
   (6N + 6·L·d·S, as MaxText counts it now).
2. **FP8** (`model.fp8`): the same step with FP8 matmuls; then a Llama-3.2-3B shape (28 layers,
   d_model 3072, 24/8 heads, d_ff 8192) in bf16, in FP8 and in FP8 with delayed scaling, remat
   full; and the loss of
   `--loss-steps` steps of the 1B shape on the same synthetic batches in bf16 and in FP8 (issue 44
   asks for 200; the budget decides).
3. **MoE**: `benchmarks/moe.py --gpu`'s measurement (its own cases), run as a subprocess with
   what is left of the budget.

MFU is against `--peak-tflops` (the datasheet's dense bf16 peak; FP8 steps too, so that the two
compare by tokens/s). Also recorded per case (benchmarks/gpu.py's `run_case`): compile time,
XLA's memory, and whether cuDNN's fused attention and cuBLASLt FP8 GEMMs
(`__cublas$lt$matmul$f8`: XLA rewrote the FP8 matmuls) are in the optimized HLO.

    python benchmarks/gpu_suite.py --peak-tflops 989 [--budget-s 480] [--loss-steps 200] \
        [--out benchmarks/results/gpu_suite_h100.json]
    python benchmarks/gpu_suite.py --tiny --peak-tflops 1   # a CPU check: tiny shapes, nothing written
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, write_json  # noqa: E402
from gpu import matmul_tflops, run_case  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ONE_B = ["train.global_batch=8", "model.attention=cudnn", "parallel.remat=none"]
THREE_B = ["model.n_layers=28", "model.d_model=3072", "model.n_heads=24", "model.n_kv_heads=8", "model.d_ff=8192",
           "train.global_batch=8", "model.attention=cudnn", "parallel.remat=full"]
# --tiny: the same cases at tiny shapes (a CPU check of the script itself).
TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
        "model.vocab_size=256", "model.seq_len=32", "train.global_batch=8", "model.attention=xla",
        "runtime.cpu_devices=1"]


def cases(tiny: bool) -> list[tuple[str, list[str]]]:
    one, three = (TINY, TINY) if tiny else (ONE_B, THREE_B)
    return [("llama_1b bf16", one), ("llama_1b fp8", [*one, "model.fp8=true"]),
            ("llama_3b-shape bf16", three), ("llama_3b-shape fp8", [*three, "model.fp8=true"]),
            # delayed scaling: x's and g's scales from a history (no amax on the quantization's path)
            ("llama_3b-shape fp8 delayed", [*three, "model.fp8=true", "model.fp8_scaling=delayed",
                                            "model.fp8_history=16"])]


def causal_mfu(r: dict, peak: float) -> float:
    """MFU with causal attention counted at half (6N + 6·L·d·S per token)."""
    m = r["config"]["model"]
    per_token = 6 * r["non_embedding_params"] + 6 * m["n_layers"] * m["d_model"] * m["seq_len"]
    return per_token * r["tokens_per_s"] / 1e12 / peak


def loss_curve(overrides: list[str], steps: int) -> list[float]:
    """The loss of each of `steps` steps from the same initial state and batches."""
    from jaxpar.config import load_config
    from jaxpar.train.data import batch_at, make_source
    from jaxpar.train.step import build

    import jax

    cfg = load_config(ROOT / "configs" / "llama_1b.yaml", ["data.source=synthetic", "mesh.data=1", *overrides])
    program = build(cfg)
    state = program.init(jax.random.key(cfg.train.seed))
    source = make_source(cfg)
    losses = []
    for k in range(steps):
        state, metrics = program.step(state, batch_at(source, k, cfg.train.global_batch, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peak-tflops", type=float, required=True, help="datasheet dense bf16 peak of the GPU")
    p.add_argument("--budget-s", type=float, default=480.0, help="no case starts after this many seconds")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--loss-steps", type=int, default=200, help="steps of the bf16-vs-FP8 loss comparison")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: a check of the script, writes nothing")
    p.add_argument("--out", default=None, help="results file (required unless --tiny)")
    args = p.parse_args(argv)
    if not args.tiny and not args.out:
        p.error("--out is required (or --tiny)")
    if args.tiny:
        args.steps, args.warmup, args.loss_steps = 2, 1, 3
    start = time.perf_counter()
    left = lambda: args.budget_s - (time.perf_counter() - start)  # noqa: E731
    from jaxpar.config import load_config
    from jaxpar.xla_flags import apply as apply_xla_flags

    xla = apply_xla_flags(load_config(None, []))
    import jax

    measured = matmul_tflops(256 if args.tiny else 8192)
    print(f"{jax.devices()[0].device_kind}: bf16 matmul {measured:.1f} TFLOP/s; xla {xla.describe()}", flush=True)
    out = {"machine": machine_info(), "datasheet_bf16_tflops": args.peak_tflops, "measured_matmul_bf16_tflops": measured,
           "xla_flags": xla.describe(), "command": " ".join(["python", "benchmarks/gpu_suite.py", *argv]),
           "cases": [], "loss": None, "moe": None}
    for name, overrides in cases(args.tiny):
        if left() <= 0:
            out["cases"].append({"case": name, "skipped": "past the budget"})
            continue
        try:
            r = run_case(name, "llama_1b", overrides, args.steps, args.warmup, args.peak_tflops, measured)
            r["mfu_causal_half"] = causal_mfu(r, args.peak_tflops)
        except Exception as e:  # record and go on
            r = {"case": name, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
        out["cases"].append(r)
        if "error" in r:
            print(f"{name}: FAILED {r['error'][:300]}", flush=True)
        else:
            print(f"{name}: {r['step_time_s']['median'] * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tok/s, MFU "
                  f"{r['mfu_vs_datasheet']:.1%} (causal half {r['mfu_causal_half']:.1%}), compile "
                  f"{r['compile_s']:.0f} s", flush=True)
    if left() > 0 and args.loss_steps:
        base = TINY if args.tiny else ONE_B
        try:
            bf16 = loss_curve(base, args.loss_steps)
            fp8 = loss_curve([*base, "model.fp8=true"], args.loss_steps)
            out["loss"] = {"steps": args.loss_steps, "bf16": bf16, "fp8": fp8,
                           "final_relative": fp8[-1] / bf16[-1] - 1}
            print(f"loss after {args.loss_steps} steps: bf16 {bf16[-1]:.4f}, fp8 {fp8[-1]:.4f} "
                  f"({out['loss']['final_relative']:+.2%})", flush=True)
        except Exception as e:
            out["loss"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    if not args.tiny and left() > 60:
        moe_out = str(Path(args.out).with_name(Path(args.out).stem + "_moe.json"))
        cmd = [sys.executable, str(ROOT / "benchmarks" / "moe.py"), "--gpu", "--out", moe_out]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=left())
            out["moe"] = {"command": " ".join(cmd[1:]), "returncode": done.returncode, "results": moe_out,
                          "tail": done.stdout[-3000:] + done.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            out["moe"] = {"command": " ".join(cmd[1:]), "error": "past the budget"}
    out["wall_s"] = time.perf_counter() - start
    if args.out and not args.tiny:
        write_json(args.out, out)
        print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
