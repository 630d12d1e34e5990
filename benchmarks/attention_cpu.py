"""Causal attention's forward and backward on one CPU thread: jaxpar's `xla_lse` (in causal query
blocks, and in one block), jax's reference path (`attention: xla`) and torch's
`scaled_dot_product_attention`.

    python benchmarks/attention_cpu.py [--shapes 16x128 4x256 2x512 1x1024] [--heads 8] [--head-dim 32]
        [--repeats 10] [--out FILE.json]

Each shape is batch x seq, float32, causal, n heads of the given size (kv heads = heads). Per
implementation: `jax.vjp` of the attention and its pullback of a random cotangent, jitted, on one
device of an XLA:CPU client with one thread (PJRT_NPROC=1), and torch's autograd with
`torch.set_num_threads(1)`; process CPU time per call, the minimum over `--repeats` calls after a
warm-up (the loads here are single-threaded, so CPU time is the time). Also prints the largest
difference of the one-block and the blocked results (outputs and the three gradients). Writes
benchmarks/results/attention_cpu.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["16x128", "4x256", "2x512", "1x1024"])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention_cpu.json"))
    args = p.parse_args(argv)
    os.environ["PJRT_NPROC"] = "1"
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import jaxpar.model.lse_attention as la
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import machine_info

    torch.set_num_threads(1)

    def cpu_time(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(args.repeats):
            t = time.process_time()
            fn()
            best = min(best, time.process_time() - t)
        return best

    def jax_call(attn):
        f = jax.jit(lambda q, k, v, g: (lambda o, pull: (o, *pull(g)))(*jax.vjp(attn, q, k, v)))
        return lambda *a: jax.block_until_ready(f(*a))

    def one_block(q, k, v):
        saved, la.MAX_BLOCKS = la.MAX_BLOCKS, 1
        try:
            return la.lse_attention(q, k, v)
        finally:
            la.MAX_BLOCKS = saved

    impls = {
        "xla_lse": jax_call(la.lse_attention),
        "xla_lse, one block": jax_call(one_block),
        "xla": jax_call(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")),
    }
    rows = []
    for shape in args.shapes:
        B, T = (int(x) for x in shape.split("x"))
        rng = np.random.default_rng(0)
        arrays = [rng.standard_normal((B, T, args.heads, args.head_dim), dtype=np.float32) for _ in range(4)]
        jx = [jnp.asarray(a) for a in arrays]
        row = {"batch": B, "seq": T, "blocks": len(la.query_blocks(T, T)), "ms": {}}
        outs = {}
        for name, call in impls.items():
            outs[name] = call(*jx)
            row["ms"][name] = 1e3 * cpu_time(lambda call=call: call(*jx))
        row["max_diff_blocked_vs_one_block"] = max(
            float(jnp.max(jnp.abs(a - b))) for a, b in zip(outs["xla_lse"], outs["xla_lse, one block"]))
        tq, tk, tv = (torch.from_numpy(a).transpose(1, 2).contiguous().requires_grad_() for a in arrays[:3])
        tg = torch.from_numpy(arrays[3]).transpose(1, 2).contiguous()

        def torch_call():
            o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
            return torch.autograd.grad(o, (tq, tk, tv), tg)

        row["ms"]["torch sdpa"] = 1e3 * cpu_time(torch_call)
        rows.append(row)
        print(f"{B}x{T}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in row["ms"].items()), flush=True)
    names = list(rows[0]["ms"])
    table = ["| batch x seq | query blocks | " + " | ".join(f"{n} ms" for n in names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    table += [f"| {r['batch']} x {r['seq']} | {r['blocks']} | " + " | ".join(f"{r['ms'][n]:.1f}" for n in names) + " |"
              for r in rows]
    command = "python benchmarks/attention_cpu.py " + " ".join(argv)
    machine = machine_info()
    print("\n".join(table))
    print(f"\nForward and backward, float32, causal, {args.heads} heads of {args.head_dim}; one thread each; "
          f"CPU ms per call, minimum of {args.repeats}. {machine.get('cpu_model')}, jax {jax.__version__}, "
          f"torch {torch.__version__}.")
    Path(args.out).write_text(json.dumps({"benchmark": "attention_cpu", "command": command.strip(), "machine": machine,
                                          "heads": args.heads, "head_dim": args.head_dim, "repeats": args.repeats,
                                          "torch_version": torch.__version__, "rows": rows}, indent=2))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
