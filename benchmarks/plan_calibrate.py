"""Fit the planner's compute model (`jaxpar.costs.CALIBRATION`) to jaxpar's measured steps on one
H200: `benchmarks/results/gpu_h200.json` (benchmarks/gpu.py) and `plan_gpu_h200.json`
(benchmarks/plan_gpu.py). Non-negative least squares on the relative error of the step time;
prints the fitted coefficients and each case's measured and predicted time.

    python benchmarks/plan_calibrate.py
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

RESULTS = Path(__file__).parent / "results"
FITTED = ("flash", "scores", "elementwise", "layer_pass")


def cases():
    """(name, config, measured step seconds) of every recorded single-H200 step."""
    from jaxpar.config import from_dict
    from jaxpar.plan_presets import MODELS

    out = []
    for c in json.loads((RESULTS / "gpu_h200.json").read_text())["cases"]:
        out.append((c["case"], from_dict(c["config"]), c["step_time_s"]["median"]))
    for r in json.loads((RESULTS / "plan_gpu_h200.json").read_text())["rows"]:
        raw = MODELS[r["preset"]][1]
        # (These steps ran XLA's attention, not cuDNN's, though `attention: auto` should have picked
        # cuDNN: their times match the XLA-attention steps of gpu_h200.json — 8 layers of Llama-1B
        # at batch 8, remat full, 0.366 s, against 0.643 s for 16 layers with XLA's attention and
        # 0.329 s with cuDNN's — and their remat-none memory missed by the [seq, seq] scores XLA
        # saves: README, "Planning a run".)
        cfg = from_dict({"model": {**raw["model"], **r["overrides"], "attention": "xla"},
                         "parallel": {"remat": r["remat"]},
                         "train": {"global_batch": r["global_batch"]}})
        out.append((f"{r['name']} b{r['global_batch']}", cfg, r["step_s"]))
    return out


def main():
    from scipy.optimize import nnls

    from jaxpar.costs import CALIBRATION, compute_terms, hardware_flops_per_token
    from jaxpar.plan_presets import HARDWARE

    jax.config.update("jax_platforms", "cpu")
    hw = HARDWARE["h200-141gb"]
    rows, fixed, measured, flops = [], [], [], []
    data = cases()
    for name, cfg, seconds in data:
        terms = compute_terms(cfg, (1, 1, 1), hw)
        rows.append([terms[k] for k in FITTED])
        fixed.append(sum(v for k, v in terms.items() if k not in FITTED))
        measured.append(seconds)
        flops.append(hardware_flops_per_token(cfg, 1) * cfg.train.global_batch * cfg.model.seq_len)
    A, f, T = np.array(rows), np.array(fixed), np.array(measured)
    coef, _ = nnls(A / T[:, None], 1 - f / T)
    print("fitted:", {k: float(f"{c:.3g}") for k, c in zip(FITTED, coef)}, " in use:", CALIBRATION)
    use = np.array([CALIBRATION[k] for k in FITTED])
    print(f"{'case':45s} {'measured s':>10s} {'predicted':>10s} {'error':>7s} {'FLOPs/peak':>10s} {'model':>6s}")
    for (name, _, _), a, fx, t, fl in zip(data, A, f, T, flops):
        pred = fx + a @ use
        print(f"{name:45s} {t:10.4f} {pred:10.4f} {pred / t - 1:+7.1%} {fl / t / hw.peak_flops:10.1%} "
              f"{fl / pred / hw.peak_flops:6.1%}")


if __name__ == "__main__":
    main()
