"""The tiled attention kernel's memory and work against the query-blocked `xla_lse` kernel, from the
compiled forward and backward (issue 41's target: at seq 4,096 temp bytes at most 1/8 of
`xla_lse`'s, FLOPs within 1.1x the causal optimum).

One attention, B 1, 4 query heads over 4 kv heads of 64, float32, on one CPU device: XLA's temp
bytes (`memory_analysis`) and the matmul FLOPs with loop trips counted (`jaxpar.inspect.dot_flops`;
`cost_analysis` counts a scan's body once). The causal optimum: the n(n + 1)/2 tiles of the lower
triangle (half the [seq, seq] work plus the diagonal tiles), 7 matmuls each (q·kᵀ and p·v forward;
q·kᵀ again, dv, dp, dq, dk backward).

    python benchmarks/tiled_attention.py [--seq 4096 ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, command, machine_info, mib, write_result  # noqa: E402

B, N, K, H = 1, 4, 4, 64


def measure(T: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxpar.inspect import dot_flops
    from jaxpar.model import tiled_attention as ta
    from jaxpar.model.lse_attention import lse_attention

    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.float32)
    out = {}
    for name, f in (("xla_lse", lse_attention), ("tiled", lambda q, k, v: ta.attention(q, k, v))):
        c = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        flops, known = dot_flops(c.as_text())
        out[name] = {"temp_bytes": int(c.memory_analysis().temp_size_in_bytes), "dot_flops": flops, "trips_known": known}
    b = ta.tile(T)
    n = T // b
    out["tile"] = b
    out["causal_optimum_flops"] = 7 * 2 * H * N * B * (n * (n + 1) // 2) * b * b
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--out", default=str(RESULTS / "tiled_attention_cpu.json"))
    args = p.parse_args()
    rows = {T: measure(T) for T in args.seq}
    table = ["| seq | tile | xla_lse temp MiB | tiled temp MiB | ratio | tiled GFLOP | causal optimum GFLOP | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for T, r in rows.items():
        x, t = r["xla_lse"], r["tiled"]
        table.append(f"| {T} | {r['tile']} | {mib(x['temp_bytes'])} | {mib(t['temp_bytes'])} | "
                     f"{t['temp_bytes'] / x['temp_bytes']:.3f} | {t['dot_flops'] / 1e9:.2f} | "
                     f"{r['causal_optimum_flops'] / 1e9:.2f} | {t['dot_flops'] / r['causal_optimum_flops']:.3f} |")
    write_result(args.out, {"command": command("tiled_attention.py"), "machine": machine_info(),
                            "shape": {"batch": B, "heads": N, "kv_heads": K, "head_dim": H, "dtype": "float32"},
                            "rows": {str(T): r for T, r in rows.items()}},
                 "\n".join(table) + "\n", "Tiled attention against xla_lse, forward and backward (one CPU device)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
