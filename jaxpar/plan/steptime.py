"""The planner's time model: hardware FLOPs per token, the compute of one device calibrated on
jaxpar's own steps (`compute_terms`, `CALIBRATION`), the `Roofline` assumptions, and the predicted
step time with its bubble (the schedule simulator) and exposed traffic (`jaxpar.plan.collectives`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxpar.config import Config
from jaxpar.hardware import Hardware
from jaxpar.mesh import AXES
from jaxpar.model.flops import count_active_params, model_flops_per_token
from jaxpar.parallel.pipeline.placement import placement_of
from jaxpar.parallel.stages import valid_stage_layout
from jaxpar.plan import moe as moe_costs
from jaxpar.plan.collectives import collectives
from jaxpar.plan.memory import _BYTES, _cached_schedule, _paired_ticks, schedule_key, model_state, muon_deal, uses_flash_attention


@functools.lru_cache(maxsize=4096)
def _simulated(key: tuple, b_over_f: float) -> tuple[float, float]:
    """(time in units of F, bubble fraction) of a schedule (`memory.schedule_key`) simulated with
    F = 1, B = b_over_f."""
    from jaxpar.parallel.pipeline.simulate import simulate
    sim = simulate(_cached_schedule(*key)[0], 1.0, b_over_f)
    return sim.total_time, sim.bubble_fraction


def hardware_flops_per_token(cfg: Config, p: int) -> float:
    """FLOPs the devices run per token: the model FLOPs, a tied output projection (GPT-2, tied llamas: 2·d·V
    forward, twice that backward, outside N), and the recomputed forwards: remat `full`
    recomputes every block (2·N + 4·L·d·S), `dots` and `offload` the attention core (4·L·d·S),
    `dots_except_mlp` the attention core and the MLP's matmuls whose outputs its backward needs
    (up and gate, not down: 2·L·D·F each). A pipeline adds nothing: B (or I and W) runs from what
    F saved."""
    m, remat = cfg.model, cfg.parallel.remat
    n = count_active_params(m, False)
    attn_fwd = 4 * m.n_layers * m.n_heads * m.head_size * m.seq_len
    total = model_flops_per_token(cfg) + (6 * m.d_model * m.padded_vocab if m.tied else 0)
    forward = 2 * n + attn_fwd
    # MoE layers (`jaxpar.plan.moe`): the experts' forward again under dots_except_mlp; the
    # dense layers' MLP inputs (every layer of a dense model, some of a mixed one).
    experts_again = moe_costs.recomputed_flops_per_token(m, remat) if m.moe else 0
    mlp_in = 2 * (m.n_layers - m.n_moe_layers) * m.d_model * m.d_ff * (2 if m.arch == "llama" else 1)
    return total + experts_again + {"none": 0, "full": forward, "dots": attn_fwd, "offload": attn_fwd,
                                   "dots_except_mlp": attn_fwd + mlp_in}[remat]


# The compute model, calibrated on jaxpar's own steps on one H200 (`benchmarks/plan_calibrate.py`;
# README, "Planning a run"): a step's compute is the sum of its parts, each at the rate of what
# bounds it. `matmul`: the weight matmuls at their FLOPs over the measured large-matmul rate (782
# of 989 TFLOP/s, benchmarks/results/gpu_h200.json) plus their operands and results through HBM,
# so that a small per-device GEMM (a thin microbatch, a wide tensor-parallel split) runs further
# from the peak; `flash`: cuDNN's attention kernel, its FLOPs over the dense peak (fitted: the
# seconds per FLOP at peak); `scores`: XLA's attention, its float32 [seq, seq] scores through HBM
# (fitted: passes); `elementwise`: norms, residuals and activation functions, HBM passes over each
# layer's [tokens, d_model + d_ff/t] values (fitted); `layer_pass`: seconds per layer pass (kernel
# launches, the scan's bookkeeping; fitted); `head`: the float32 logits, 4 passes; `optimizer`:
# Adam's update reading and writing the stored state once; `newton_schulz`: Muon's iterations on
# the rank's own matrices (not calibrated: no Muon step has run on a GPU yet).
MATMUL_EFFICIENCY = 782.2 / 989.0
CALIBRATION = {"flash": 2.85, "scores": 6.6, "elementwise": 13.2, "layer_pass": 7.34e-5}


def compute_terms(cfg: Config, shape: tuple[int, int, int], hw: Hardware) -> dict[str, float]:
    """The parts of one device's compute in a step, each in seconds at coefficient 1 (`CALIBRATION`
    weighs the fitted ones): the device's layers (n_layers / p, or the busiest stage's:
    `busiest_stage_layers`) for every microbatch at its
    per-device shapes (rows = global_batch / (data x microbatches) sequences, tensor-parallel
    dims divided by t), the head and loss (a 1/p share with a pipeline) and the optimizer update."""
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    peak = hw.peak_flops if m.dtype in ("bfloat16", "float16") else hw.peak_flops_fp32
    act = _BYTES[m.dtype]
    rows = cfg.train.global_batch // (d * par.microbatches)
    if par.context > 1:  # B·c/(d·m) sequences of T/c tokens: the same tokens, the same attention pairs
        rows = cfg.train.global_batch / (d * par.microbatches)
    M, S, D, F, hd = rows * m.seq_len, m.seq_len, m.d_model, m.d_ff, m.head_size
    H, K = m.n_heads // t, (m.kv_heads // t if m.kv_heads % t == 0 else m.kv_heads)
    gemm_units = 3 + (par.remat == "full")  # forward, the two backward matmuls, a recomputed forward
    again = par.remat != "none"  # every policy recomputes attention's core and the elementwise work
    if m.arch == "llama":
        shapes = [(D, (H + 2 * K) * hd), (H * hd, D), (D, 2 * F // t), (F // t, D)]
    else:
        shapes = [(D, 3 * H * hd), (H * hd, D), (D, F // t), (F // t, D)]

    def gemm_rows(rows, k, n, units, peak=peak, act=act):  # a matmul in the compute dtype
        return _plain_gemm(rows, k, n, units, peak, act, hw)

    # The blocks' weight matmuls: FP8 products with `model.fp8` (docs/fp8.md; not calibrated).
    block_rows = functools.partial(fp8_gemm_seconds, hw=hw, plain=gemm_rows, act=act) if m.fp8 else gemm_rows

    def gemm(k, n, units):
        return block_rows(M, k, n, units)

    width = F // t
    if m.moe:  # the MoE layers' matmuls instead of the dense MLP's (`jaxpar.plan.moe`; the router in float32)
        f = moe_costs.moe_fraction(m)  # a mixed model (`model.moe_layers`): per layer, the mean of both kinds
        dense_mlp = sum(gemm(k, n, gemm_units) for k, n in shapes[2:])
        shapes = shapes[:2]
        moe = f * moe_costs.gemm_terms(cfg, shape, M, block_rows, gemm_units, lambda r, k, n, u: gemm_rows(
            r, k, n, u, peak=hw.peak_flops_fp32, act=4)) + (1 - f) * dense_mlp
        width = f * moe_costs.mlp_width(m, t, moe_costs.routes_sequence_shard(cfg, t)) + (1 - f) * width
    else:
        moe = 0.0

    V = m.padded_vocab // t
    layers, micro = busiest_stage_layers(cfg, p), par.microbatches
    head = gemm_rows(M, D, V, 3)  # the output head: never FP8
    core = 4 * rows * S * S * H * hd * (3 + again)
    flash = uses_flash_attention(cfg, "gpu")
    st = model_state(cfg, shape)
    return {
        "matmul": micro * (layers * (sum(gemm(k, n, gemm_units) for k, n in shapes) + moe) + head / p),
        "flash": micro * layers * core / peak if flash else 0.0,
        "scores": 0.0 if flash else micro * layers * (3 + again) * rows * H * S * S * 4 / hw.hbm_bw,
        "elementwise": micro * layers * (3 + again) * M * (D + width) * act / hw.hbm_bw,
        "layer_pass": micro * layers * (3 + again),
        "head": micro * 4 * M * V * 4 / hw.hbm_bw / p,
        "optimizer": (2 * st["params"] + st["grads"] + 2 * st["optimizer"]) / hw.hbm_bw,
        "newton_schulz": newton_schulz_seconds(cfg, shape, hw),
    }


def _plain_gemm(rows, k, n, units, peak, act, hw: Hardware) -> float:
    """`compute_terms`' matmul model: FLOPs at the measured large-matmul rate, operands and result
    through HBM once."""
    return units * (2 * rows * k * n / (MATMUL_EFFICIENCY * peak) + (rows * k + k * n + rows * n) * act / hw.hbm_bw)


def fp8_gemm_seconds(rows, k, n, units, *, hw: Hardware, plain, act: int) -> float:
    """One FP8 weight matmul (`model.fp8`) as `compute_terms` models it, not calibrated (no FP8
    step has run on a GPU): its FLOPs at `MATMUL_EFFICIENCY` of the FP8 peak, its operands read
    as one byte each and its result written in the compute dtype, plus the quantization of both
    operands (an amax pass and a cast pass over each: read twice in the compute dtype, written
    once in FP8). Without FP8 tensor cores (`Hardware.peak_flops_fp8` None): `plain`, the
    matmul in the compute dtype."""
    if hw.peak_flops_fp8 is None:
        return plain(rows, k, n, units)
    flops = 2 * rows * k * n / (MATMUL_EFFICIENCY * hw.peak_flops_fp8)
    io = (rows * k + k * n) * 1 + rows * n * act + (rows * k + k * n) * (2 * act + 1)
    return units * (flops + io / hw.hbm_bw)


def newton_schulz_seconds(cfg: Config, shape: tuple[int, int, int], hw: Hardware) -> float:
    """Muon's Newton-Schulz on one rank: the busiest rank's matrices of the deal
    (`jaxpar.plan.memory.muon_deal`) at the matmul rate in `train.muon_ns_dtype` (each iteration
    three matmuls; at these sizes, thousands of rows, compute-bound); 0 with AdamW."""
    if cfg.train.optimizer != "muon":
        return 0.0
    peak = hw.peak_flops if cfg.train.muon_ns_dtype == "bfloat16" else hw.peak_flops_fp32
    return muon_deal(cfg, shape).flops / (MATMUL_EFFICIENCY * peak)


def busiest_stage_layers(cfg: Config, p: int) -> float:
    """The layers the busiest of p pipeline stages runs: n_layers / p for an even split, the most
    any stage's chunks hold otherwise (`parallel.stage_layers`, dense first layers; a skipped slot
    costs nothing)."""
    if p == 1:
        return float(cfg.model.n_layers)
    slots = valid_stage_layout(cfg.model, p, cfg.parallel.virtual_stages, cfg.parallel.stage_layers,
                               placement_of(cfg.parallel.schedule))
    return cfg.model.n_layers / p if slots is None else float(slots.layers_per_chunk().sum(-1).max())


def compute_seconds(cfg: Config, shape: tuple[int, int, int], hw: Hardware) -> float:
    """One device's compute time in a step, no bubble: `compute_terms` weighed by `CALIBRATION`."""
    return sum(v * CALIBRATION.get(k, 1.0) for k, v in compute_terms(cfg, shape, hw).items())


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The stated assumptions of the step-time model."""

    hardware: Hardware
    compute_efficiency: float | None = None
    """Fraction of the dense peak all FLOPs are charged at; None: the compute model
    (`compute_seconds`) decides it for each layout."""
    devices: int = 8
    collective_matmul: bool = False
    """Whether XLA's windowed einsum overlaps each forward tensor-parallel collective with the
    matmul it feeds (`--xla_gpu_threshold_for_windowed_einsum_mib`, with
    `--xla_gpu_multi_streamed_windowed_einsum`: registered by jaxlib 0.10.2; jaxpar's GPU flags do
    not set them, so off by default)."""

    def bandwidth(self, axis: str, shape: tuple[int, int, int]) -> float:
        """Per-direction bytes/s of one device on `axis`: devices are laid out with `model`
        innermost, then `stage`, then `data` (jaxpar.mesh), so an axis stays on NVLink while the
        group it spans fits in one node."""
        d, p, t = shape
        span = {"model": t, "stage": t * p, "data": d * p * t}[axis]
        return self.hardware.intra_node_bw if span <= self.hardware.node_size else self.hardware.inter_node_bw

    def efficiency(self, cfg: Config, shape: tuple[int, int, int]) -> float:
        """The fraction of the dense peak this layout's FLOPs run at: the override, or the compute
        model's hardware FLOPs over its time."""
        if self.compute_efficiency is not None:
            return self.compute_efficiency
        d, p, t = shape
        m, hw = cfg.model, self.hardware
        peak = hw.peak_flops if m.dtype in ("bfloat16", "float16") else hw.peak_flops_fp32
        flops = hardware_flops_per_token(cfg, p) * cfg.train.global_batch * m.seq_len / (d * p * t)
        return flops / (peak * compute_seconds(cfg, shape, hw))


def compute_floor(cfg: Config, shape: tuple[int, int, int], roof: Roofline) -> float:
    """A floor under `step_time`: the compute of one device with no bubble and no exposed traffic
    (what the planner visits candidates by, and prunes with)."""
    d, p, t = shape
    m, hw = cfg.model, roof.hardware
    if roof.compute_efficiency is None:  # (less the optimizer's update, which the ZeRO stage changes)
        terms = compute_terms(cfg, shape, hw)
        return sum(v * CALIBRATION.get(k, 1.0) for k, v in terms.items() if k != "optimizer")
    peak = (hw.peak_flops if m.dtype in ("bfloat16", "float16") else hw.peak_flops_fp32) * roof.compute_efficiency
    return hardware_flops_per_token(cfg, p) * cfg.train.global_batch * m.seq_len / (d * p * t) / peak


def step_time(cfg: Config, shape: tuple[int, int, int], roof: Roofline, platform: str = "gpu") -> dict[str, float]:
    """Predicted seconds per step, by part:

    - compute: the hardware FLOPs of each device at `Roofline.efficiency` of the dense peak (the
      compute model's, or the stated override; bf16 peak for bf16/fp16 compute, TF32 for float32);
      with a pipeline, the schedule's simulated time (each tick takes its slowest stage; F and B
      of a microbatch at their FLOPs), bubble included.
    - model traffic, per layer as the compiled program can overlap it (XLA's latency-hiding
      scheduler, which jaxpar enables on GPU): a forward collective sits between the matmuls that
      need it, exposed; a backward one (the activation gradient's) runs beside the same
      sub-layer's weight-gradient matmul, which does not need it, exposed only past that matmul's
      time; with `Roofline.collective_matmul` (XLA's windowed einsum) the forward ones hide behind
      the matmuls they feed likewise. The last layer's has nothing after it to hide behind.
    - stage traffic: exposed (the lock-step pipeline sends after each tick's compute).
    - DualPipeV's F&B ticks (`Collective.paired`): what runs there beside the other action's
      computation is hidden behind those ticks' share of the compute: the expert all-to-alls of
      F's and B's one loop (`pipeline.actions.pair`); their hops wait for the loop (exposed).
    - data traffic: collectives inside the layer scan (ZeRO-0/1's per-layer gradient all-reduce,
      ZeRO-3's gathers and reduce-scatters) run beside the next layer's compute, exposed past it
      and for the last layer; reductions after a microbatch or tick loop and the all-gather of
      updated parameters are exposed. Context parallelism's (`collectives.context_collectives`, on
      the link of its group of c data ranks): the K/V all-gathers exposed, their backward
      reduce-scatters and the ring's hops counted as overlappable like the layer scan's (the ring's
      hop runs beside the tiles of the block in hand; the model does not check that a block's
      tiles outlast its hop, only that the layer's compute outlasts the layer's hops).
    """
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    hw = roof.hardware
    efficiency = roof.efficiency(cfg, shape)
    peak = (hw.peak_flops if m.dtype in ("bfloat16", "float16") else hw.peak_flops_fp32) * efficiency
    tokens = cfg.train.global_batch * m.seq_len
    flops = hardware_flops_per_token(cfg, p) * tokens / (d * p * t)
    bubble = 0.0
    if p > 1:
        # One microbatch through one stage's layers: F its forward FLOPs, B the rest (the backward
        # and what remat recomputes; a split table's I and W share it evenly), at the stated
        # fraction of peak; the simulator adds the bubble.
        per_microbatch = flops / par.microbatches
        fwd = per_microbatch * (model_flops_per_token(cfg) / 3 + (2 * m.d_model * m.padded_vocab if m.tied
                                                                  else 0)) / hardware_flops_per_token(cfg, p)
        # The simulated time is linear in the costs at a fixed B/F ratio: simulate once per ratio.
        total, bubble = _simulated(schedule_key(cfg, p),
                                   round((per_microbatch - fwd) / fwd, 6))
        compute = total * fwd / peak
    else:
        compute = flops / peak
    exposed = {"data": 0.0, "stage": 0.0, "model": 0.0}
    hidden, hidden_paired = 0.0, {}
    for c in collectives(cfg, shape, platform):
        n = math.prod(dict(zip(AXES, shape))[a] for a in c.axes) if c.group is None else c.group
        if c.group is None:
            bw = roof.bandwidth(max(c.axes, key=lambda a: {"model": 0, "stage": 1, "data": 2}[a]), shape)
        else:  # a context group: c consecutive data ranks, c·p·t devices (NVLink while in one node)
            bw = hw.intra_node_bw if c.group * p * t <= hw.node_size else hw.inter_node_bw
        seconds = c.wire(n) / bw
        axis = c.axes[0] if len(c.axes) == 1 else "data"
        if c.paired:  # DualPipeV's F&B ticks' share
            hidden_paired[axis] = hidden_paired.get(axis, 0.0) + seconds * c.paired
            seconds *= 1 - c.paired
        if c.overlap:
            hidden += seconds
        else:
            exposed[axis] += seconds
    busy = flops / peak  # the compute without the bubble: what a collective can run beside
    layers = max(1.0, m.n_layers / p)
    exposed["data"] += max(hidden / layers, hidden - busy)
    if hidden_paired:  # behind the compute of the F&B ticks (their share of the tick loop's); what
        # does not fit is exposed, on each axis in proportion
        key = schedule_key(cfg, p)
        total = sum(hidden_paired.values())
        left = max(0.0, total - compute * _paired_ticks(*key) / _cached_schedule(*key)[0].num_ticks())
        for axis, seconds in hidden_paired.items():
            exposed[axis] += left * seconds / total
    if t > 1:
        # Of the weight matmuls (2N FLOPs per token each way), what a collective can overlap: the
        # forward's (one per forward pass) and the weight gradient's.
        share = 2 * count_active_params(m, False) / hardware_flops_per_token(cfg, p)
        forwards = 1 + (par.remat == "full")
        backward = exposed["model"] / (1 + forwards)
        forward = exposed["model"] - backward
        if roof.collective_matmul:
            forward = max(forward / layers, forward - busy * share * forwards)
        exposed["model"] = forward + max(backward / layers, backward - busy * share)
    total = compute + sum(exposed.values())
    return {"compute": compute, "bubble_fraction": bubble, **{f"{k}_comm": v for k, v in exposed.items()},
            "total": total}
