"""How well a run uses its devices: model TFLOP/s per device and MFU (DESIGN.md §6.1) against the
dense peaks of known devices (`jaxpar.hardware`), and the step time's split into host work and
waiting for the devices."""

from __future__ import annotations

import dataclasses

from jaxpar.config import Config
from jaxpar.hardware import KNOWN_DEVICES, known_peak_tflops  # noqa: F401 (re-exported)
from jaxpar.model.flops import model_flops_per_token


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Per-step model FLOPs of a run and the peak it is measured against."""

    model_flops_per_step: float
    """model.flops.model_flops_per_token x tokens per step (train.global_batch x model.seq_len)."""
    devices: int
    peak_tflops: float | None
    """One device's dense peak (runtime.peak_tflops, or the table); None: no MFU."""

    @classmethod
    def of(cls, cfg: Config, devices: int, device_kind: str) -> "Efficiency":
        peak = cfg.runtime.peak_tflops or known_peak_tflops(device_kind, cfg.model.dtype)
        tokens = cfg.train.global_batch * cfg.model.seq_len
        return cls(model_flops_per_token(cfg) * tokens, devices, peak)

    def metrics(self, step_time_s: float) -> dict[str, float]:
        """`model_tflops_per_device` and, with a known peak, `mfu` (a fraction) of a step time."""
        tflops = self.model_flops_per_step / step_time_s / self.devices / 1e12
        out = {"model_tflops_per_device": tflops}
        if self.peak_tflops is not None:
            out["mfu"] = tflops / self.peak_tflops
        return out


HOST_BOUND = 0.1
"""A logging window is host-bound when the host waited for the devices less than this fraction of
the step time: the devices finished each step before the host asked, so the host set the pace."""


def describe(rec: dict) -> str:
    """`1.23 TFLOP/s/dev, MFU 12.3%` (or `MFU n/a`), plus where the host set the step time."""
    text = f"{rec['model_tflops_per_device']:.3g} TFLOP/s/dev, " + (
        f"MFU {rec['mfu']:.1%}" if "mfu" in rec else "MFU n/a")
    if rec["device_wait_s"] < HOST_BOUND * rec["step_time_s"]:
        text += f", host-bound (data {rec['data_time_s'] / rec['step_time_s']:.0%})"
    return text
