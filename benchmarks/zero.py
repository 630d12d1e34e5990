"""ZeRO stages 0-3 side by side: predicted and measured per-device memory, data-axis traffic, step time.

For each `parallel.zero` in 0, 1, 2, 3 (one microbatch) the train step of one config is built and
AOT-compiled on one mesh, and the script reports:

- the per-device bytes of model state predicted by the formula (DESIGN.md §6.4, Adam, bytes per
  parameter P = G = itemsize of `model.param_dtype`, O = 2 * itemsize): replicated (P+G+O)Ψ;
  ZeRO-1 (P+G)Ψ + OΨ/d; ZeRO-2 PΨ + (G+O)Ψ/d; ZeRO-3 (P+G+O)Ψ/d, divided by stage*model;
- the layout's own accounting (`jaxpar.parallel.zero.state_bytes`), which keeps small leaves
  (norm scales) and leaves without a divisible `embed` dim replicated;
- what XLA planned for the compiled step (`compiled.memory_analysis()` via `jaxpar.inspect`):
  argument bytes (parameters + optimizer state + batch; gradients are temporaries, not
  arguments) compared with the predicted P + O, and temp bytes;
- the collectives that span `data`, per kind: result bytes per device times executions per step,
  and estimated ring wire bytes per device (all-reduce of B: 2B(n-1)/n; all-gather of result B:
  B(n-1)/n; reduce-scatter of result B: B(n-1); n the group size), as a ratio to ZeRO-0's;
- the median wall time of one step over `--steps` steps after `--warmup` (batches prebuilt, each
  step timed from dispatch to `jax.block_until_ready`, as in `step_time.py`).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (TIMING, add_config_args, add_devices_arg, add_out_arg, add_timing_args,  # noqa: E402
                    check_timing_args, command, compile_step, guarded, machine_info, memory_bytes, mesh_dict, mib,
                    overrides, simulated_cpu, summary, time_steps, wire_bytes, write_result)
STAGES = (0, 1, 2, 3)
# The default model when no --config is given (user --set overrides come after these).
DEFAULTS = ("model.arch=llama", "model.n_layers=4", "model.d_model=256", "model.n_heads=4",
            "model.d_ff=1024", "model.vocab_size=256", "model.seq_len=64", "train.global_batch=16")
KINDS = ("all-reduce", "reduce-scatter", "all-gather")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p, "YAML config (default: llama, 4 layers, d_model 256, d_ff 1024, vocab 256, "
                       "seq_len 64, global_batch 16, mesh data = all devices)", "model.d_model=512")
    add_devices_arg(p)
    add_timing_args(p, steps=10, warmup=2, per="ZeRO stage")
    add_out_arg(p, "zero_cpu.json")
    args = p.parse_args(argv)
    check_timing_args(p, args)
    return args


def formula_bytes(zero: int, psi: int, itemsize: int, d: int, tp: int = 1) -> dict[str, float]:
    """Per-device bytes of params, grads and Adam moments by the ZeRO formula (DESIGN.md §6.4)."""
    P, G, O = itemsize * psi / tp, itemsize * psi / tp, 2 * itemsize * psi / tp
    return {"params": P / d if zero >= 3 else P,
            "grads": G / d if zero >= 2 else G,
            "optimizer": O / d if zero >= 1 else O}


def traffic(report, mesh) -> dict:
    """Per kind, over collectives spanning `data`: count, result bytes per step, wire bytes per step."""
    out: dict[str, dict] = {}
    for c in report.select(spans="data"):
        n = math.prod(int(mesh.shape[a]) for a in c.axes)
        row = out.setdefault(c.kind, {"collectives": 0, "in_loop": 0, "executions": 0,
                                      "result_bytes": 0, "wire_bytes": 0.0,
                                      "executions_known": True})
        row["collectives"] += 1
        row["in_loop"] += int(c.in_loop)
        row["executions"] += c.executions
        row["result_bytes"] += c.traffic
        row["wire_bytes"] += wire_bytes(c.kind, c.bytes, n) * c.executions
        row["executions_known"] &= c.executions_known
    return out


def measure(cfg, args) -> dict:
    import jax
    from jaxpar.inspect import analyze
    from jaxpar.model import count_params, param_shapes
    from jaxpar.parallel.zero import state_bytes
    from jaxpar.train.step import build

    program = build(cfg)
    mesh = program.mesh
    d, tp = int(mesh.shape["data"]), int(mesh.shape["stage"]) * int(mesh.shape["model"])
    shapes = param_shapes(cfg.model)
    psi = count_params(cfg.model)
    itemsize = jax.tree.leaves(shapes)[0].dtype.itemsize
    zero = cfg.parallel.zero

    formula = formula_bytes(zero, psi, itemsize, d, tp)
    layout = {k: v["per_device"] for k, v in state_bytes(program.layout, shapes, mesh).items()}
    batch_bytes = cfg.train.global_batch * (cfg.model.seq_len + 1) * 4 // d  # int32 rows

    compiled, compile_s = compile_step(program)
    report = analyze(compiled, mesh)
    flows = traffic(report, mesh)

    times, metrics = time_steps(cfg, program, compiled, args.warmup, args.steps)

    po_formula = formula["params"] + formula["optimizer"]
    po_layout = layout["params"] + layout["optimizer"]
    mem = report.memory
    return {
        "zero": zero, "mesh": mesh_dict(mesh),
        "psi": psi, "param_itemsize": itemsize,
        "predicted_formula": dict(formula, total=sum(formula.values())),
        "layout_accounting": dict(layout, total=sum(layout.values())),
        "batch_bytes_per_device": batch_bytes,
        "predicted_args_formula": po_formula,
        "predicted_args_layout": po_layout + batch_bytes,
        "memory": memory_bytes(mem),
        "argument_vs_formula_p_plus_o": mem.argument_bytes / po_formula,
        "argument_vs_layout_p_plus_o_plus_batch": mem.argument_bytes / (po_layout + batch_bytes),
        "traffic_data_axis": flows,
        "wire_bytes_total": sum(r["wire_bytes"] for r in flows.values()),
        "collectives_data_axis": [
            {"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes, "executions": c.executions,
             "in_loop": c.in_loop, "op_name": c.op_name} for c in report.select(spans="data")],
        "compile_s": compile_s,
        "step_time_s": summary(times),
        "step_times_s": times,
        "final_loss": float(metrics["loss"]),
    }


def theory_ratio(zero: int) -> float:
    """Wire bytes of the gradient/parameter collectives relative to ZeRO-0's all-reduce (2 units):
    ZeRO-1 and ZeRO-2 reduce-scatter the gradients (1) and all-gather the new parameters (1):
    1.0x; ZeRO-3 gathers twice and reduce-scatters: 1.5x."""
    return {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}[zero]


def markdown(rows: list[dict], machine: dict, cfg, command: str) -> str:
    m, d = cfg.model, rows[0]["mesh"]["data"]
    head = ["ZeRO", "predicted state/device, formula (MiB)", "layout accounting (MiB)",
            "measured argument bytes (MiB)", "argument / predicted P+O", "temp bytes (MiB)",
            "all-reduce bytes/step (MiB)", "reduce-scatter bytes/step (MiB)",
            "all-gather bytes/step (MiB)", "wire bytes vs ZeRO-0 (theory)", "median step (ms)"]
    base = rows[0]["wire_bytes_total"] or float("nan")
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        t = r["traffic_data_axis"]
        kind = lambda k: mib(t[k]["result_bytes"]) if k in t else "0"  # noqa: E731
        lines.append("| " + " | ".join([
            str(r["zero"]), mib(r["predicted_formula"]["total"]), mib(r["layout_accounting"]["total"]),
            mib(r["memory"]["argument_bytes"]), f"{r['argument_vs_formula_p_plus_o']:.3f}",
            mib(r["memory"]["temp_bytes"]), kind("all-reduce"), kind("reduce-scatter"),
            kind("all-gather"), f"{r['wire_bytes_total'] / base:.2f}× ({theory_ratio(r['zero']):.1f}×)",
            f"{r['step_time_s']['median'] * 1e3:.1f}"]) + " |")
    psi = rows[0]["psi"]
    note = (
        f"\nModel: {m.arch}, {m.n_layers} layers, d_model {m.d_model}, d_ff {m.d_ff}, vocab {m.vocab_size}, "
        f"seq_len {m.seq_len}, global batch {cfg.train.global_batch}, Ψ = {psi:,} {m.param_dtype} parameters, "
        f"AdamW; mesh data={d}, stage={rows[0]['mesh']['stage']}, model={rows[0]['mesh']['model']}; "
        f"one microbatch. Bytes are per device: the formula is (P+G+O)Ψ with P=G={rows[0]['param_itemsize']}, "
        f"O={2 * rows[0]['param_itemsize']} bytes split as ZeRO stage says; the layout accounting keeps small "
        f"leaves replicated; argument and temp bytes are XLA's plan for the compiled step "
        f"(`compiled.memory_analysis()`); argument / predicted P+O uses the formula's P+O (gradients are "
        f"temporaries). Collective bytes are result bytes per device × executions, over collectives spanning "
        f"`data`; wire bytes are ring estimates (all-reduce 2B(n-1)/n, all-gather B(n-1)/n, reduce-scatter "
        f"B(n-1)).\n\n"
        f"Measured {machine['date']} on {machine['device_count']} simulated {machine['platform']} devices on "
        f"{machine['cpu_count']} shared CPU cores ({machine['cpu_model']}), jax {machine['jax_version']}, "
        f"{rows[0]['steps']} timed steps after {rows[0]['warmup']} warmup. The memory and traffic columns are "
        f"properties of the compiled program; the step times are CPU times on 2 shared cores and say "
        f"nothing about GPU speed or about what ZeRO costs on real interconnects.\n\n"
        f"Command: `{command}`\n")
    return "\n".join(lines) + "\n" + note


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from jaxpar.config import load_config

    common = overrides(args, DEFAULTS)
    cfgs = [load_config(args.config, common + [f"parallel.zero={z}", "parallel.microbatches=1"])
            for z in STAGES]  # every config is checked before anything compiles
    simulated_cpu(args.devices)  # --devices means simulated CPU devices, even on a GPU host

    rows = []
    for cfg in cfgs:
        r = measure(cfg, args)
        r.update(steps=args.steps, warmup=args.warmup)
        rows.append(r)
        print(f"zero={r['zero']}: args {mib(r['memory']['argument_bytes'])} MiB, temp "
              f"{mib(r['memory']['temp_bytes'])} MiB, wire {mib(r['wire_bytes_total'])} MiB/step, "
              f"median {r['step_time_s']['median'] * 1e3:.1f} ms (compile {r['compile_s']:.1f} s)",
              flush=True)
    base_wire = rows[0]["wire_bytes_total"]
    for r in rows:
        r["wire_bytes_ratio_vs_zero0"] = r["wire_bytes_total"] / base_wire if base_wire else None
        r["wire_bytes_ratio_theory"] = theory_ratio(r["zero"])

    machine = machine_info()
    cmd = command("zero.py")
    result = {
        "benchmark": "zero", "date": machine["date"], "command": cmd, "machine": machine,
        "config": cfgs[0].to_dict(),  # parallel.zero: as in each row
        "timing": TIMING + "; compile_s is AOT lower+compile of the step",
        "rows": rows,
    }
    write_result(args.out, result, markdown(rows, machine, cfgs[0], cmd), f"ZeRO stages 0-3 ({machine['platform']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
