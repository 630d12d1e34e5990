"""Tensor (and sequence) parallelism over `model`: per-layer collectives and activation memory, measured vs predicted.

For each model-axis size t (mesh data = devices / t) and `parallel.sequence_parallel` off / on, the train
step of one config is AOT-compiled (`jaxpar.train.step.lower_step`, one microbatch, nothing run) and
read with `jaxpar.inspect`. Per transformer layer (the collectives inside the layer-scan while loops
that span `model` and have activation size, i.e. result bytes >= b·s·h/t elements; b the sequences per
data shard per microbatch, s = seq_len, h = d_model) it reports, split forward / backward (backward
ops carry "transpose" in their op_name):

- the count of collectives by kind; predicted without SP: 2 all-reduces forward (attention output,
  MLP down) and 2 backward (gradients of the inputs of the column-parallel matmuls); with SP each
  all-reduce becomes an all-gather + reduce-scatter pair;
- the result bytes of each collective, predicted b·s·h·itemsize for all-reduce and all-gather and
  b·s·h·itemsize / t for reduce-scatter;
- the ring wire bytes per device per layer (all-reduce of B: 2B(t-1)/t; all-gather with result B:
  B(t-1)/t; reduce-scatter with result B: B(t-1)), predicted 8·(t-1)/t·b·s·h·itemsize (DESIGN.md §6.3);

plus XLA's temp bytes of the whole step (an activation-memory proxy), with and without SP, and
their ratio. Smaller model-axis collectives in the loops (e.g. SP's all-reduce of norm-scale
gradients) and those outside the loops (embedding, output head, loss) are listed in the JSON.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_config_args, add_devices_arg, add_out_arg, command, guarded, machine_info,  # noqa: E402
                    memory_bytes, mesh_dict, mib, overrides, simulated_cpu, wire_bytes, write_result)
# The default model when no --config is given (user --set overrides come after these).
DEFAULTS = ("model.arch=llama", "model.n_layers=2", "model.d_model=256", "model.n_heads=8",
            "model.n_kv_heads=8", "model.d_ff=1024", "model.vocab_size=512", "model.seq_len=128",
            "train.global_batch=16", "parallel.remat=none")
KINDS = ("all-reduce", "all-gather", "reduce-scatter")
ABBREV = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p, "YAML config (default: llama, 2 layers, d_model 256, 8 heads, d_ff 1024, "
                       "vocab 512, seq_len 128, global batch 16, remat none)", "model.d_model=512")
    add_devices_arg(p)
    p.add_argument("--t", dest="tp_sizes", type=int, nargs="+", default=[2, 4, 8],
                   help="model-axis sizes to compare (default 2 4 8); each must divide --devices")
    add_out_arg(p, "tensor_parallel_cpu.json")
    args = p.parse_args(argv)
    if args.devices < 1 or any(t < 1 or args.devices % t for t in args.tp_sizes):
        p.error(f"every --t must be a positive divisor of --devices = {args.devices}")
    return args


def collective_dict(c) -> dict:
    return {"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes, "executions": c.executions,
            "executions_known": c.executions_known, "in_loop": c.in_loop, "op_name": c.op_name}


def measure(cfg) -> dict:
    import jax.numpy as jnp

    from jaxpar.inspect import analyze
    from jaxpar.train.step import lower_step

    start = time.perf_counter()
    compiled, mesh = lower_step(cfg)
    compile_s = time.perf_counter() - start
    report = analyze(compiled, mesh)

    m, par = cfg.model, cfg.parallel
    d, t = int(mesh.shape["data"]), int(mesh.shape["model"])
    b = cfg.train.global_batch // (d * par.microbatches)  # sequences per data shard per microbatch
    itemsize = jnp.dtype(m.dtype).itemsize
    act = b * m.seq_len * m.d_model * itemsize  # one b·s·h activation, bytes
    layer_runs = m.n_layers * par.microbatches  # executions of a layer-loop body per step
    predicted_bytes = {"all-reduce": act, "all-gather": act, "reduce-scatter": act // t}

    layer, small = [], []
    for c in report.select(spans="model", in_loop=True):
        (layer if c.bytes >= act // t else small).append(c)
    per_dir = {}
    for direction in ("forward", "backward"):
        cs = [c for c in layer if ("transpose" in c.op_name) == (direction == "backward")]
        n = {c.kind: 0 for c in cs}
        for c in cs:
            n[c.kind] += 1
        per_dir[direction] = {
            "count": n,
            # Collectives per layer: each in-loop op runs once per layer (and microbatch).
            "count_per_layer": {k: sum(c.executions for c in cs if c.kind == k) / layer_runs for k in n},
            "result_bytes": {k: sorted({c.bytes for c in cs if c.kind == k}) for k in n},
            "wire_bytes_per_layer": sum(
                wire_bytes(c.kind, c.bytes, math.prod(int(mesh.shape[a]) for a in c.axes)) * c.executions
                for c in cs) / layer_runs,
            "collectives": [collective_dict(c) for c in cs],
        }
    wire = per_dir["forward"]["wire_bytes_per_layer"] + per_dir["backward"]["wire_bytes_per_layer"]
    wire_predicted = 8 * (t - 1) / t * act
    mem = report.memory
    return {
        "t": t, "sequence_parallel": par.sequence_parallel,
        "mesh": mesh_dict(mesh),
        "b": b, "s": m.seq_len, "h": m.d_model, "itemsize": itemsize, "bsh_bytes": act,
        "predicted_result_bytes": {k: v for k, v in predicted_bytes.items()
                                   if (k == "all-reduce") != par.sequence_parallel},
        "layer": per_dir,
        "result_bytes_match": all(c.bytes == predicted_bytes.get(c.kind) for c in layer),
        "wire_bytes_per_layer": wire,
        "wire_bytes_per_layer_predicted": wire_predicted,
        "wire_ratio_measured_to_predicted": wire / wire_predicted if wire_predicted else None,
        "memory": memory_bytes(mem),
        "small_in_loop_model_collectives": [collective_dict(c) for c in small],
        "outside_loop_model_collectives": [collective_dict(c) for c in
                                           report.select(spans="model", in_loop=False)],
        "compile_s": compile_s,
    }


def kib(x: float) -> str:
    return f"{x / 2**10:.0f}"


def order(kind: str) -> int:
    return KINDS.index(kind) if kind in KINDS else len(KINDS)


def counts(row: dict, direction: str) -> str:
    n = row["layer"][direction]["count_per_layer"]
    return " + ".join(f"{n[k]:g} {ABBREV.get(k, k)}" for k in sorted(n, key=order)) or "0"


def result_bytes(row: dict) -> str:
    seen: dict[str, set] = {}
    for direction in ("forward", "backward"):
        for k, v in row["layer"][direction]["result_bytes"].items():
            seen.setdefault(k, set()).update(v)
    pred = row["predicted_result_bytes"]
    parts = []
    for k in sorted(seen, key=order):
        got = "/".join(kib(v) for v in sorted(seen[k]))
        parts.append(f"{ABBREV.get(k, k)} {got} ({kib(pred[k]) if k in pred else '-'})")
    return ", ".join(parts)


def markdown(rows: list[dict], machine: dict, cfg, command: str) -> str:
    head = ["t", "mesh data×model", "SP", "b", "forward / layer (predicted)",
            "backward / layer (predicted)", "result bytes per collective, KiB (predicted)",
            "wire bytes / layer, MiB", "predicted 8(t−1)/t·b·s·h, MiB", "measured / predicted",
            "temp bytes, MiB", "temp SP / no SP"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        pred = "2 AG + 2 RS" if r["sequence_parallel"] else "2 AR"
        ratio = f"{r['temp_ratio_sp_to_no_sp']:.3f}" if "temp_ratio_sp_to_no_sp" in r else ""
        lines.append("| " + " | ".join([
            str(r["t"]), f"{r['mesh']['data']}×{r['mesh']['model']}", "on" if r["sequence_parallel"] else "off",
            str(r["b"]), f"{counts(r, 'forward')} ({pred})", f"{counts(r, 'backward')} ({pred})",
            result_bytes(r), mib(r["wire_bytes_per_layer"]), mib(r["wire_bytes_per_layer_predicted"]),
            f"{r['wire_ratio_measured_to_predicted']:.3f}", mib(r["memory"]["temp_bytes"]), ratio]) + " |")
    m = cfg.model
    note = (
        f"\nModel: {m.arch}, {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads ({m.kv_heads} kv), "
        f"d_ff {m.d_ff}, vocab {m.vocab_size}, seq_len {m.seq_len}, global batch {cfg.train.global_batch}, "
        f"{m.dtype} activations, remat {cfg.parallel.remat}, one microbatch; b = global batch / data. "
        f"Per layer = collectives inside the layer-scan loops that span `model` with result ≥ b·s·h/t elements, "
        f"executions / n_layers; backward = op_name contains `transpose`. AR/AG/RS = all-reduce / all-gather / "
        f"reduce-scatter; wire bytes are ring estimates per device (AR 2B(t−1)/t, AG B(t−1)/t, RS B(t−1), "
        f"B the result). Temp bytes are XLA's planned temporaries of the whole step per device.\n\n"
        f"Method: each config AOT-compiled with `jaxpar.train.step.lower_step` and read with `jaxpar.inspect` "
        f"(nothing executed), {machine['date']}, {machine['device_count']} simulated {machine['platform']} devices "
        f"on {machine['cpu_count']} shared CPU cores ({machine['cpu_model']}), jax {machine['jax_version']}. "
        f"All figures are properties of the compiled program, not timings; they say nothing about speed.\n\n"
        f"Command: `{command}`\n")
    return "\n".join(lines) + "\n" + note


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from jaxpar.config import load_config

    common = overrides(args, DEFAULTS, "mesh.stage=1")
    cfgs = [load_config(args.config, common + [f"mesh.data={args.devices // t}", f"mesh.model={t}",
                                               f"parallel.sequence_parallel={sp}", "parallel.microbatches=1"])
            for t in args.tp_sizes for sp in (False, True)]  # every config is checked before anything compiles
    simulated_cpu(args.devices)  # jax_platforms=cpu, jax_num_cpu_devices=N, before any backend starts

    rows = []
    for cfg in cfgs:
        r = measure(cfg)
        rows.append(r)
        print(f"t={r['t']} sp={'on' if r['sequence_parallel'] else 'off'}: wire "
              f"{mib(r['wire_bytes_per_layer'])} MiB/layer (predicted {mib(r['wire_bytes_per_layer_predicted'])}), "
              f"temp {mib(r['memory']['temp_bytes'])} MiB (compile {r['compile_s']:.1f} s)", flush=True)

    # SP's memory saving counted in replicated b·s·h activations it shards: each saves (t-1)/t of one.
    temp_off = {r["t"]: r["memory"]["temp_bytes"] for r in rows if not r["sequence_parallel"]}
    for r in rows:
        if r["sequence_parallel"] and r["t"] in temp_off:
            saved = temp_off[r["t"]] - r["memory"]["temp_bytes"]
            r["temp_ratio_sp_to_no_sp"] = r["memory"]["temp_bytes"] / temp_off[r["t"]]
            r["temp_saved_in_bsh_activations"] = saved / (r["bsh_bytes"] * (r["t"] - 1) / r["t"])

    machine = machine_info()
    cmd = command("tensor_parallel.py")
    result = {
        "benchmark": "tensor_parallel", "date": machine["date"], "command": cmd, "machine": machine,
        "config": cfgs[0].to_dict(),  # mesh and parallel.sequence_parallel: as in each row
        "method": ("AOT lower+compile of the train step per (t, SP); collectives and memory from "
                   "jaxpar.inspect.analyze; nothing executed"),
        "rows": rows,
    }
    write_result(args.out, result, markdown(rows, machine, cfgs[0], cmd),
                 f"Tensor and sequence parallelism: per-layer collectives and memory ({machine['platform']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
