"""Bytes per parameter of the compiled train step, ZeRO-0..3 at data = 8, with float32 parameters and
with bf16 parameters plus a float32 master copy (`train.master_weights: float32`).

For each (ZeRO stage, mode) the step of one small llama (activations tiny next to the state: one
16-token row per device) is AOT-compiled on 8 simulated CPU devices, and the script records from
`compiled.memory_analysis()` the argument bytes (parameters + optimizer state + the batch) and temp
bytes (gradients and every other transient) per parameter Ψ, next to

- the textbook state per device, params + grads + optimizer: float32 16 (ZeRO-0), 8 + 8/d, 4 + 12/d,
  16/d; master weights 2 + 4 + 12 (ZeRO-0), 6 + 12/d (Megatron's distributed optimizer), 2 + 16/d,
  18/d;
- its stored part (params + optimizer), which the arguments must equal (less the batch);
- the planner's prediction of the total (`jaxpar.costs.memory(..., platform="cpu")`).

Nothing is timed: these are properties of the compiled program.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_out_arg, command, guarded, machine_info, memory_bytes, simulated_cpu, write_result  # noqa: E402

MODEL = ("model.arch=llama", "model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.d_ff=1024",
         "model.vocab_size=256", "model.seq_len=16", "model.dtype=bfloat16", "train.global_batch=8",
         "mesh.data=8")
MODES = {"float32 params": ("model.param_dtype=float32", "train.master_weights=none"),
         "bf16 params + fp32 master": ("model.param_dtype=bfloat16", "train.master_weights=float32")}


def textbook(mode: str, zero: int, d: int) -> dict[str, float]:
    """Bytes per parameter of params, grads and optimizer state on one device."""
    if mode.startswith("float32"):
        p, g, o = 4.0, 4.0, 8.0
    else:
        p, g, o = 2.0, 4.0, 12.0
    return {"params": p / d if zero >= 3 else p, "grads": g / d if zero >= 2 else g,
            "optimizer": o / d if zero >= 1 else o}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_arg(p, "master_weights_cpu.json")
    return guarded(run, p.parse_args(argv))


def run(args) -> int:
    from jaxpar import model
    from jaxpar.config import load_config
    from jaxpar.costs import memory
    from jaxpar.inspect import analyze
    from jaxpar.train.step import lower_step

    simulated_cpu(8)
    rows = []
    for mode, keys in MODES.items():
        for zero in (0, 1, 2, 3):
            cfg = load_config(None, [*MODEL, *keys, f"parallel.zero={zero}", "runtime.cpu_devices=8"])
            psi = model.count_params(cfg.model)
            compiled, mesh = lower_step(cfg)
            mem = analyze(compiled, mesh).memory
            batch = cfg.train.global_batch * (cfg.model.seq_len + 1) * 4 // 8
            book = textbook(mode, zero, 8)
            predicted = memory(cfg, (8, 1, 1), platform="cpu")
            row = {"mode": mode, "zero": zero, "psi": psi,
                   "arguments_per_param": (mem.argument_bytes - batch) / psi,
                   "temp_per_param": mem.temp_bytes / psi,
                   "total_per_param": (mem.argument_bytes + mem.temp_bytes) / psi,
                   "textbook": dict(book, stored=book["params"] + book["optimizer"], total=sum(book.values())),
                   "predicted_total_per_param": predicted["total"] / psi,
                   "predicted": predicted,
                   "memory": memory_bytes(mem)}
            rows.append(row)
            print(f"{mode}, ZeRO-{zero}: arguments {row['arguments_per_param']:.3f} B/param (textbook stored "
                  f"{row['textbook']['stored']:.3f}), temp {row['temp_per_param']:.3f}, total "
                  f"{row['total_per_param']:.3f} (textbook state {row['textbook']['total']:.3f}, planner "
                  f"{row['predicted_total_per_param']:.3f})", flush=True)
    machine = machine_info()
    cmd = command("master_weights.py")
    result = {"benchmark": "master_weights", "date": machine["date"], "command": cmd,
              "machine": machine, "model_overrides": list(MODEL), "rows": rows}
    lines = ["| mode | ZeRO | textbook params + grads + optimizer | textbook stored (params + opt.) | "
             "measured arguments | measured temp | measured total | planner total |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = r["textbook"]
        lines.append(f"| {r['mode']} | {r['zero']} | {b['params']:g} + {b['grads']:g} + {b['optimizer']:g} = "
                     f"{b['total']:.2f} | {b['stored']:.2f} | {r['arguments_per_param']:.2f} | "
                     f"{r['temp_per_param']:.2f} | {r['total_per_param']:.2f} | "
                     f"{r['predicted_total_per_param']:.2f} |")
    table = "\n".join(lines)
    note = (f"\n\nBytes per parameter per device (Ψ = {rows[0]['psi']:,}), data = 8. Measured {machine['date']} on "
            f"8 simulated CPU devices on {machine['cpu_count']} shared cores ({machine['cpu_model']}), jax "
            f"{machine['jax_version']}; `compiled.memory_analysis()` of the train step. Command: `{cmd}`\n")
    write_result(args.out, result, table + note, "Master weights: bytes per parameter (cpu)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
