"""Accelerators as their datasheets state them: `Hardware` (memory, dense peaks, links, HBM
bandwidth), the `HARDWARE` presets, and the dense peak of a device JAX names (`known_peak_tflops`).

A leaf of the foundation: the planner (`jaxpar.plan`) costs layouts on these figures and a training
run (`jaxpar.train.efficiency`) measures its MFU against the same peaks. Figures are the vendor's
datasheet numbers, named as such: dense (no sparsity) tensor-core peaks, and per-GPU,
per-direction link bandwidths.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator model and how its nodes are wired."""

    name: str
    memory_bytes: int
    """HBM per device, as the datasheet states it (decimal GB)."""
    peak_flops: float
    """Dense bf16/fp16 tensor-core peak, FLOP/s."""
    peak_flops_fp32: float
    """Dense TF32 tensor-core peak, FLOP/s (what XLA uses for float32 matmuls on these GPUs)."""
    intra_node_bw: float
    """NVLink bytes/s one GPU sends in one direction (half the datasheet's bidirectional figure)."""
    inter_node_bw: float
    """InfiniBand bytes/s per GPU in one direction (one NIC per GPU)."""
    node_size: int = 8
    """GPUs per node (one NVLink domain)."""
    hbm_bw: float = 2.0e12
    """HBM bytes/s (the datasheet's memory bandwidth): what the memory-bound parts of a step run at."""
    peak_flops_fp8: float | None = None
    """Dense FP8 tensor-core peak, FLOP/s (Hopper: twice bf16's); None where the GPU has no FP8
    tensor cores (A100: `model.fp8`'s products then run at the bf16 rate)."""


GB = 10**9

HARDWARE = {
    # NVIDIA A100 datasheet: 312 TFLOPS bf16 dense, 156 TF32 dense, NVLink 3 600 GB/s bidirectional,
    # HDR InfiniBand 200 Gb/s per GPU, HBM 1555 GB/s (40GB) and 2039 GB/s (80GB).
    "a100-40gb": Hardware("A100-SXM4-40GB", 40 * GB, 312e12, 156e12, 300e9, 25e9, hbm_bw=1555e9),
    "a100-80gb": Hardware("A100-SXM4-80GB", 80 * GB, 312e12, 156e12, 300e9, 25e9, hbm_bw=2039e9),
    # NVIDIA H100 SXM datasheet: 989 TFLOPS bf16 dense (1979 with sparsity), 494 TF32 dense, 1979
    # FP8 dense, NVLink 4 900 GB/s bidirectional, NDR InfiniBand 400 Gb/s per GPU, HBM3 3.35 TB/s.
    "h100-80gb": Hardware("H100-SXM5-80GB", 80 * GB, 989e12, 494e12, 450e9, 50e9, hbm_bw=3.35e12,
                          peak_flops_fp8=1979e12),
    # NVIDIA H800 SXM (the export form of the H100 that trained DeepSeek-V3): H100's compute and
    # HBM, NVLink cut to 400 GB/s bidirectional; DeepSeek-V3's cluster has 400 Gb/s InfiniBand per GPU.
    "h800-80gb": Hardware("H800-SXM5-80GB", 80 * GB, 989e12, 494e12, 200e9, 50e9, hbm_bw=3.35e12,
                          peak_flops_fp8=1979e12),
    # NVIDIA H200 SXM datasheet: H100's compute (1979 TFLOPS FP8 dense) and NVLink, 141 GB HBM3e at 4.8 TB/s.
    "h200-141gb": Hardware("H200-SXM-141GB", 141 * GB, 989e12, 494e12, 450e9, 50e9, hbm_bw=4.8e12,
                           peak_flops_fp8=1979e12),
}


# device_kind as JAX reports it ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
# "NVIDIA A100 80GB PCIe") -> the datasheet entry of `HARDWARE` (its comments give the
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
    TF32 for float32 compute, as `jaxpar.plan.steptime.step_time` charges them); None for a device
    not in the table."""
    kind = device_kind.lower()
    for need, refuse, key in KNOWN_DEVICES:
        if all(w in kind for w in need) and not any(w in kind for w in refuse):
            hw = HARDWARE[key]
            return (hw.peak_flops_fp32 if dtype == "float32" else hw.peak_flops) / 1e12
    return None
