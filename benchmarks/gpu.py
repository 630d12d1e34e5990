"""One GPU: bf16 step time, tokens/s and MFU of the GPU presets, and cuDNN's fused attention
against XLA's, with the achieved matmul peak measured on the same chip for reference.

Model FLOPs per token are DESIGN.md §6.1's 6·N + 12·L·d_model·S (N the non-embedding parameters,
causal attention not halved); MFU divides the achieved model FLOP/s by the datasheet's dense
bf16 peak (given with --peak-tflops) and, separately, by the matmul rate measured here.

    python benchmarks/gpu.py --peak-tflops 989 --out benchmarks/results/gpu_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compile_step, machine_info, summary, time_steps, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

CASES = [  # (name, preset, overrides)
    ("gpt2_124m b16 remat=dots attention=xla", "gpt2_124m", ["train.global_batch=16", "model.attention=xla"]),
    ("gpt2_124m b16 remat=dots attention=cudnn", "gpt2_124m", ["train.global_batch=16", "model.attention=cudnn"]),
    ("gpt2_124m b16 remat=none attention=cudnn", "gpt2_124m",
     ["train.global_batch=16", "model.attention=cudnn", "parallel.remat=none"]),
    ("llama_1b b8 remat=full attention=xla", "llama_1b", ["train.global_batch=8", "model.attention=xla"]),
    ("llama_1b b8 remat=full attention=cudnn", "llama_1b", ["train.global_batch=8", "model.attention=cudnn"]),
    ("llama_1b b8 remat=dots attention=cudnn", "llama_1b",
     ["train.global_batch=8", "model.attention=cudnn", "parallel.remat=dots"]),
]


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    for _ in range(3):
        f(a, b).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = f(a, b)
    out.block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def model_flops_per_token(m) -> float:
    from jaxpar import model

    import math

    import jax

    shapes = model.param_shapes(m)  # N: the blocks and the final norm (embeddings and lm_head excluded)
    n = sum(math.prod(x.shape) for k in ("blocks", "final_norm") for x in jax.tree.leaves(shapes[k]))
    return 6 * n + 12 * m.n_layers * m.d_model * m.seq_len, n


def run_case(name, preset, overrides, steps, warmup, peak, measured):
    from jaxpar.config import load_config
    from jaxpar.train.step import build

    cfg = load_config(ROOT / "configs" / f"{preset}.yaml", ["data.source=synthetic", "mesh.data=1", *overrides])
    program = build(cfg)
    compiled, compile_s = compile_step(program)
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    times, metrics = time_steps(cfg, program, compiled, warmup, steps)
    median = statistics.median(times)
    per_token, n_nonembed = model_flops_per_token(cfg.model)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    achieved = per_token * tokens / median / 1e12
    return {
        "case": name, "overrides": overrides, "config": cfg.to_dict(),
        "non_embedding_params": n_nonembed, "tokens_per_step": tokens,
        "step_time_s": summary(times),
        "tokens_per_s": tokens / median, "model_tflops_per_s": achieved,
        "mfu_vs_datasheet": achieved / peak, "mfu_vs_measured_matmul": achieved / measured,
        "compile_s": compile_s, "final_loss": float(metrics["loss"]),
        "cudnn_fused_attention_in_hlo": "__cudnn$fmha" in hlo,
        "cublaslt_fp8_gemm_in_hlo": "__cublas$lt$matmul$f8" in hlo,  # (model.fp8: XLA's FP8 rewrite)
        "memory_bytes": {"arguments": mem.argument_size_in_bytes, "temp": mem.temp_size_in_bytes,
                         "output": mem.output_size_in_bytes},
        "xla_cost_analysis_flops": (compiled.cost_analysis() or {}).get("flops"),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peak-tflops", type=float, required=True, help="datasheet dense bf16 peak of the GPU")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", default=None, help="run only cases whose name contains this")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from jaxpar.config import load_config
    from jaxpar.xla_flags import apply as apply_xla_flags

    # Before the backend starts: the cases run with the flags training gets (no preset sets
    # runtime.xla_flags, so its default, auto).
    xla = apply_xla_flags(load_config(None, []))
    print(f"xla     {xla.describe()}", flush=True)
    import jax

    measured = matmul_tflops()
    print(f"{jax.devices()[0].device_kind}: bf16 8192^3 matmul {measured:.0f} TFLOP/s", flush=True)
    results = []
    for name, preset, overrides in CASES:
        if args.only and args.only not in name:
            continue
        try:
            r = run_case(name, preset, overrides, args.steps, args.warmup, args.peak_tflops, measured)
        except Exception as e:  # record and go on: one failing case must not lose the others
            r = {"case": name, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
        results.append(r)
        if "error" in r:
            print(f"{name}: FAILED {r['error'][:300]}", flush=True)
        else:
            print(f"{name}: {r['step_time_s']['median'] * 1e3:.1f} ms/step, {r['tokens_per_s']:,.0f} tok/s, "
                  f"MFU {r['mfu_vs_datasheet']:.1%} of datasheet ({r['mfu_vs_measured_matmul']:.1%} of measured "
                  f"matmul), cudnn fmha in HLO: {r['cudnn_fused_attention_in_hlo']}, "
                  f"mem args {r['memory_bytes']['arguments'] / 2**30:.2f} GiB temp "
                  f"{r['memory_bytes']['temp'] / 2**30:.2f} GiB, compile {r['compile_s']:.0f} s", flush=True)
    out = {"machine": machine_info(), "datasheet_bf16_tflops": args.peak_tflops,
           "measured_matmul_bf16_tflops": measured, "xla_flags": xla.describe(), "cases": results, "command": sys.argv,
           "timing": "each step timed alone, dispatch to block_until_ready; batches prebuilt"}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
