"""How well a run uses its devices: model TFLOP/s per device and MFU (DESIGN.md §6.1), the dense
peaks of known devices, and the step time's split into host work and waiting for the devices."""

from __future__ import annotations

import dataclasses

from jaxpar.config import Config
from jaxpar.costs import model_flops_per_token
from jaxpar.plan_presets import HARDWARE

# device_kind as JAX reports it ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
# "NVIDIA A100 80GB PCIe") -> the datasheet entry of `plan_presets.HARDWARE` (its comments give the
# figures: A100 312 bf16 / 156 TF32, H100 SXM and H200 SXM 989 bf16 / 494 TF32 TFLOP/s, dense).
# The PCIe and NVL H100 / H200 have lower clocks and peaks (756 and 835 bf16 TFLOP/s): not matched,
# so they show no MFU unless runtime.peak_tflops gives theirs. The A100's peak is the same in
# every form factor.
KNOWN_DEVICES: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    # (words the kind must hold, words it must not, HARDWARE key)
    (("h200",), ("pcie", "nvl"), "h200-141gb"),
    (("h100",), ("pcie", "nvl"), "h100-80gb"),
    (("a100", "80gb"), (), "a100-80gb"),
    (("a100",), (), "a100-40gb"),
)


def known_peak_tflops(device_kind: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of one `device_kind` computing in `dtype` (bf16/fp16 tensor cores, or
    TF32 for float32 compute, as `costs.step_time` charges them); None for a device not in the table."""
    kind = device_kind.lower()
    for need, refuse, key in KNOWN_DEVICES:
        if all(w in kind for w in need) and not any(w in kind for w in refuse):
            hw = HARDWARE[key]
            return (hw.peak_flops_fp32 if dtype == "float32" else hw.peak_flops) / 1e12
    return None


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Per-step model FLOPs of a run and the peak it is measured against."""

    model_flops_per_step: float
    """costs.model_flops_per_token x tokens per step (train.global_batch x model.seq_len)."""
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
