"""The planner against one GPU: predicted vs compiled memory (cuDNN flash attention, bf16) and
predicted vs measured step time, for a few published model shapes on mesh (1, 1, 1).

For each config: `compiled.memory_analysis()` arguments + temp against
`jaxpar.plan.memory(platform="gpu")`; the median time of `--steps` steps (after `--warmup`, timed
as in `step_time.py`) against the planner's compute time at `--efficiency` of the hardware
preset's dense bf16 peak, and the measured fraction of that peak (model FLOPs per second over
the datasheet peak, i.e. MFU). Writes JSON to `--out` and prints one line per config.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compile_step, guarded, machine_info, time_steps  # noqa: E402

CASES = {
    # name: (model preset, overrides of the model section, global batch, remat)
    "gpt2-small-none": ("gpt2-small", {}, 8, "none"),
    "gpt2-small-full": ("gpt2-small", {}, 8, "full"),
    "gpt2-medium-dots": ("gpt2-medium", {}, 8, "dots"),
    "llama-1b-8layers-none": ("llama-1b", {"n_layers": 8}, 4, "none"),
    "llama-1b-8layers-full": ("llama-1b", {"n_layers": 8}, 8, "full"),
}


def run(args) -> int:
    from jaxpar.config import from_dict, load_config
    from jaxpar.xla_flags import apply as apply_xla_flags

    # Before the backend starts: compiled with the flags training gets (runtime.xla_flags' default, auto).
    xla = apply_xla_flags(load_config(None, []))
    print(f"xla     {xla.describe()}", flush=True)
    from jaxpar.inspect import analyze
    from jaxpar.costs import Roofline, memory, model_flops_per_token, step_time
    from jaxpar.plan_presets import HARDWARE, MODELS
    from jaxpar.train.step import build

    hw = HARDWARE[args.hardware]
    rows = []
    for name, (preset, over, batch, remat) in CASES.items():
        raw = MODELS[preset][1]
        cfg = from_dict({"model": {**raw["model"], **over}, "mesh": {"data": 1, "stage": 1, "model": 1},
                         "parallel": {"remat": remat}, "train": {"global_batch": batch, "steps": 100}})
        row = {"name": name, "preset": preset, "overrides": over, "global_batch": batch, "remat": remat}
        try:
            program = build(cfg)
            compiled, row["compile_s"] = compile_step(program)
            mem = analyze(compiled, program.mesh).memory
            row["memory_measured"] = mem.argument_bytes + mem.temp_bytes
            pred = memory(cfg, (1, 1, 1), platform="gpu")
            row["memory_predicted"] = pred
            row["memory_error"] = pred["total"] / row["memory_measured"] - 1
            times, _ = time_steps(cfg, program, compiled, args.warmup, args.steps)
            row["step_s"] = statistics.median(times)
            predicted = step_time(cfg, (1, 1, 1), Roofline(hw, args.efficiency, 1))
            row["step_predicted_s"] = predicted["total"]
            flops = model_flops_per_token(cfg) * batch * cfg.model.seq_len
            row["mfu_measured"] = flops / row["step_s"] / hw.peak_flops
        except Exception as e:  # noqa: BLE001 - one failing config must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "memory_predicted"}), flush=True)
    Path(args.out).write_text(json.dumps({"machine": machine_info(), "hardware_preset": args.hardware,
                                          "efficiency": args.efficiency, "xla_flags": xla.describe(),
                                          "rows": rows}, indent=1))
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default="h200-141gb")
    p.add_argument("--efficiency", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="plan_gpu.json")
    return guarded(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
