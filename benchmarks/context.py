"""Context parallelism's memory and bytes, from the compiled step (issue 41's targets).

On 8 simulated CPU devices, a small llama (2 layers, d_model 256, 8 heads over 4 kv heads of 32,
float32, remat none), one compile per configuration, nothing run:

1. **Memory per device** (XLA's temp bytes: the activations and transients, and the step's
   fixed part, the gradients, their reduction and the optimizer's update, measured alone as the
   temp bytes of the same layout's 16-token step; parameters and optimizer state are arguments): a 4,096-token sequence on one
   device against the same sequence split over c = 8 data ranks (all_gather and ring); and at
   equal tokens per device, a 512-token sequence on one device against the 4,096-token one over
   c = 8. Activation memory = temp − the fixed part.
2. **Context bytes per layer** on `data`, from the compiled step's collectives (loop trips
   counted): all-gather (K and V, forward and again in the backward) and reduce-scatter (their
   cotangents) against 2 · (c − 1)/c · seq · d_kv · bytes; ring's collective-permutes against the same bytes in c − 1
   steps (forward), and the backward's K, V and dK, dV hops.
3. **The longest sequence that fits** 8 devices with 24 GiB in all (3 GiB each: arguments +
   outputs + temporaries − aliased), c = 8 against c = 1 (one sequence per device), by doubling
   and then bisecting in steps of 1,024 tokens.

    python benchmarks/context.py [--skip-longest]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, command, machine_info, mib, simulated_cpu, write_result  # noqa: E402

MODEL = {"arch": "llama", "n_layers": 2, "d_model": 256, "n_heads": 8, "n_kv_heads": 4, "d_ff": 512,
         "vocab_size": 512, "dtype": "float32", "param_dtype": "float32"}
BUDGET = 3 * 2**30  # per device: 24 GiB over 8


def config(seq: int, data: int, c: int, kind: str = "all_gather", batch: int = 1):
    from jaxpar.config import from_dict

    return from_dict({"model": {**MODEL, "seq_len": seq}, "mesh": {"data": data},
                      "parallel": {"context": c, "context_attention": kind},
                      "train": {"global_batch": batch, "steps": 1}})


def compiled(cfg):
    import jax

    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import lower_step

    n = cfg.mesh.data
    return lower_step(cfg, make_mesh(cfg, jax.devices()[:n]))


def memory(cfg) -> dict:
    m = compiled(cfg)[0].memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {"temp_bytes": int(m.temp_size_in_bytes), "argument_bytes": int(m.argument_size_in_bytes),
            "peak_bytes": int(peak)}


def context_bytes(cfg) -> dict:
    """Per layer, bytes one device receives (all-gather: (n − 1)/n of its result; reduce-scatter: its
    result × (n − 1); collective-permute: its result) in the step's context collectives."""
    from jaxpar.inspect import parse_hlo

    comp, mesh = compiled(cfg)
    c = cfg.parallel.context
    out = {"all-gather": 0.0, "reduce-scatter": 0.0, "collective-permute": 0.0}
    counts = dict.fromkeys(out, 0)
    for col in parse_hlo(comp.as_text(), mesh):
        if col.kind not in out or "data" not in col.axes:
            continue
        share = {"all-gather": (c - 1) / c, "reduce-scatter": c - 1, "collective-permute": 1}[col.kind]
        out[col.kind] += col.bytes * col.executions * share
        counts[col.kind] += col.executions
    L = cfg.model.n_layers
    return {k: v / L for k, v in out.items()} | {f"{k} per layer": v / L for k, v in counts.items()}


def longest(data: int, c: int, kind: str = "all_gather") -> int:
    """The longest seq_len (a multiple of 1,024) whose step fits BUDGET per device."""
    def fits(seq):
        ok = memory(config(seq, data, c, kind, batch=data // c))["peak_bytes"] <= BUDGET
        print(f"  c={c} seq {seq}: {'fits' if ok else 'too big'}", flush=True)
        return ok

    lo, hi = 1024, 2048
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-longest", action="store_true", help="skip the longest-sequence search (minutes)")
    p.add_argument("--out", default=str(RESULTS / "context_cpu.json"))
    args = p.parse_args()
    simulated_cpu(8)

    T, c = 4096, 8
    d_kv = MODEL["n_kv_heads"] * MODEL["d_model"] // MODEL["n_heads"]
    # The fixed part of each layout, its temp bytes at 2c tokens (the gradients and the update, next
    # to no activations): on 8 data ranks it holds the gradient reduction's buffers as well.
    fixed = {(1, 1, "all_gather"): memory(config(2 * c, 1, 1))["temp_bytes"],
             **{(8, c, kind): memory(config(2 * c, 8, c, kind))["temp_bytes"] for kind in ("all_gather", "ring")}}
    layouts = {"whole_4096_one_device": (T, 1, 1, "all_gather"), "tokens_512_one_device": (T // c, 1, 1, "all_gather"),
               **{f"{kind}_4096_c8": (T, 8, c, kind) for kind in ("all_gather", "ring")}}
    mem = {}
    for name, (seq, data, cc, kind) in layouts.items():
        mem[name] = memory(config(seq, data, cc, kind))
        mem[name]["fixed_temp_bytes"] = fixed[data, cc, kind]
        mem[name]["activation_bytes"] = mem[name]["temp_bytes"] - fixed[data, cc, kind]
    whole, equal = mem["whole_4096_one_device"]["activation_bytes"], mem["tokens_512_one_device"]["activation_bytes"]
    formula = 2 * (c - 1) / c * T * d_kv * 4
    nbytes = {kind: context_bytes(config(T, 8, c, kind)) for kind in ("all_gather", "ring")}
    result = {"command": command("context.py"), "machine": machine_info(), "model": MODEL, "seq_len": T,
              "context": c, "memory": mem, "context_bytes_per_layer": nbytes,
              "formula_bytes_per_layer": formula}
    rows = ["Activation = temp − the layout's fixed temp (its step at 2c = 16 tokens: the gradients, their "
            "reduction over data, the update).", "",
            "| configuration | temp MiB | fixed MiB | activation MiB | vs whole sequence | vs 512 tokens on one device |",
            "|---|---|---|---|---|---|"]
    for name, m in mem.items():
        a = m["activation_bytes"]
        rows.append(f"| {name} | {mib(m['temp_bytes'])} | {mib(m['fixed_temp_bytes'])} | {mib(a)} | {a / whole:.3f} | "
                    f"{a / equal:.3f} |")
    rows += ["", f"Context bytes per layer received per device (formula 2·(c−1)/c·seq·d_kv·bytes = {formula:,.0f}; "
             "all_gather gathers K and V twice, in the forward and again in the backward):", "",
             "| kind | all-gather | reduce-scatter | collective-permute | ops per layer (ag, rs, cp) |", "|---|---|---|---|---|"]
    for kind, b in nbytes.items():
        rows.append(f"| {kind} | {b['all-gather']:,.0f} | {b['reduce-scatter']:,.0f} | {b['collective-permute']:,.0f} | "
                    f"{b['all-gather per layer']:.0f}, {b['reduce-scatter per layer']:.0f}, "
                    f"{b['collective-permute per layer']:.0f} |")
    if not args.skip_longest:
        one = longest(8, 1)
        eight = {kind: longest(8, 8, kind) for kind in ("all_gather", "ring")}
        result["longest"] = {"budget_bytes_per_device": BUDGET, "c1": one, **{f"c8_{k}": v for k, v in eight.items()}}
        rows += ["", f"Longest sequence on 8 devices, {BUDGET / 2**30:.0f} GiB each (multiples of 1,024 tokens):", "",
                 "| layout | tokens | vs c = 1 |", "|---|---|---|", f"| c = 1 (a sequence per device) | {one:,} | 1 |"]
        rows += [f"| c = 8, {k} | {v:,} | {v / one:.2f} |" for k, v in eight.items()]
    write_result(args.out, result, "\n".join(rows) + "\n", "Context parallelism from the compiled step (CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
