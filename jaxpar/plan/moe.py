"""The mixture-of-experts part of jaxpar's cost model (`jaxpar.plan.memory`, `.collectives` and
`.steptime` call it; `model.n_experts` > 0: every layer's MLP is an MoE layer, `jaxpar.model.moe`,
or those `model.moe_layers` names; a mixed model's per-layer terms are each kind's, weighted by its
share of the layers, `moe_fraction`).

What it counts, per device, with expert parallelism (`parallel.expert_parallel` and data d > 1):

- state: each data rank stores E/d experts of every MoE layer with their gradients and optimizer
  state; ZeRO does not shard them further, and they are never reduced over `data` (the dense
  leaves, router and shared experts included, follow ZeRO as before). Without expert parallelism
  the experts are dense leaves like any other.
- traffic: per MoE layer and microbatch, tokens go to their experts and come back by all-to-alls
  over `data`, two in the forward and two in the backward pass, each of (tokens on the device) x k
  x d_model elements of the compute dtype (the ideal dropless volume, as GPUs' ragged all-to-all
  moves it; x capacity_factor in capacity mode), and two more for every forward the remat policy
  recomputes: `full`, and `dots_except_mlp`, which saves attention's projections only (`dots` and
  `offload` save the grouped matmuls' outputs, named `DOT_TAG` in `jaxpar.model.moe.grouped`).
- replicated experts (data d a multiple r of E, `jaxpar.model.moe.own_expert`): each rank stores
  a 1/d slice of every expert (counted by the layout like E/d experts), and per MoE layer each of
  the three expert weights of the rank's own expert is assembled by an all-to-all over `data` of
  one expert's weight in the compute dtype, with its transpose in the backward pass, once more
  in the backward under any remat policy but `none` (which saves the assembled weights from the
  forward pass to the backward: the stage's MoE layers' experts held, as `gathered_params`;
  otherwise one layer's, or two on GPU, in flight). The tokens' all-to-alls run within groups
  of E ranks with the same volume per device as above.
- experts whole on every model rank (`parallel.expert_tensor_parallel: false`, sequence
  parallelism): each model rank routes its own sequence shard, so the all-to-alls carry 1/t of
  the tokens, the grouped matmuls run 1/t of the rows at the whole expert width, an MoE layer
  without shared experts has no activation collective over `model` for its MLP (`jaxpar.plan.
  collectives._tp_sublayers`), and the expert weights' gradients (this rank's, whole) are all-reduced over
  `model` per layer and microbatch where they are used. Not counted: the per-layer all-gather of
  the shards' [sequences, E] expert counts (and [sequences, k, E] in capacity mode), a few bytes.
- compute: only the k active experts of each token: the grouped matmuls at their per-expert
  shapes (tokens per expert = tokens x k / E, over all the data ranks' tokens under expert
  parallelism), the router in float32, the shared experts as a dense MLP.
- activations are not modelled here: `jaxpar.plan.activations` reads them from JAX's own
  residuals of the MoE layer, traced with every expert on the device. Under expert parallelism a
  device's experts receive, on a balanced load, as many assignments (tokens x k) as the device
  sends, so that trace stands for the expert-parallel layer too.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxpar import model
from jaxpar.model.moe_exchange import resolve as exchange_of, routed_rows
from jaxpar.parallel.pipeline.placement import placement_of
from jaxpar.parallel.stages import valid_stage_layout
from jaxpar.sharding import expert_replicas


def expert_parallel(cfg, d: int) -> bool:
    """Whether the experts are split over a `data` axis of size d."""
    return cfg.model.moe and cfg.parallel.expert_parallel and d > 1


def is_expert_leaf(names: tuple[str, ...]) -> bool:
    """Whether a parameter with these logical dim names is an expert weight (w_gate, w_up, w_down)."""
    return "experts" in names


def param_counts(mcfg) -> tuple[int, int]:
    """(total, active) parameters: active are those one token uses (its k routed experts of each
    MoE layer, not the routers' bias and report; equal to total for a dense model)."""
    return model.count_params(mcfg), model.count_params(mcfg, active=True)


def describe_params(mcfg) -> str:
    """'N parameters', or for an MoE model 'N total, M active parameters'."""
    total, active = param_counts(mcfg)
    return f"{total:,} parameters" if not mcfg.moe else f"{total:,} total, {active:,} active parameters"


def moe_fraction(mcfg) -> float:
    """The share of the layers that are MoE layers (1 unless `model.moe_layers` mixes in dense ones)."""
    return mcfg.n_moe_layers / mcfg.n_layers if mcfg.moe else 0.0


def capacity_scale(mcfg) -> float:
    """The all-to-all's volume relative to dropless: capacity_factor in capacity mode, else 1."""
    return 1.0 if mcfg.capacity_factor is None else float(mcfg.capacity_factor)


def recomputes_experts(remat: str) -> bool:
    """Whether the backward pass runs the experts' forward again under this remat policy: `full`
    recomputes every block, `dots_except_mlp` keeps attention's projections only; `dots` and
    `offload` keep the grouped matmuls' outputs (named `DOT_TAG`)."""
    return remat in ("full", "dots_except_mlp")


def exchange(cfg, platform: str) -> str:
    """The token exchange the step runs on `platform` (`model.moe_exchange`, resolved as the
    executor resolves it: `jaxpar.model.moe_exchange.resolve`): fixed or ragged."""
    return exchange_of(cfg.model.moe_exchange, platform)


def all_to_all(cfg, shape, rows: int, act_size: int, platform: str = "gpu") -> tuple[float, int]:
    """(result bytes per device of one all-to-all of tokens, how many per step) of expert
    parallelism on `data`, of the exchange that runs on `platform` (`exchange`), by the executor's
    rule (`moe_exchange.routed_rows`): fixed, the step's worst-case buffers (`buffer_rows` rows of
    d_model per destination rank of the exchange: every rank, or with replicas the E ranks of its
    group), d·min(k, E/d)/k times dropless's; ragged, the routed rows, (tokens on the device) x k
    x d_model (x capacity_factor below 1); 4 per MoE layer of this device (MoE layers / stage)
    per microbatch, 2 more per recomputed forward.
    `rows`: the device's B/(d·m) sequences; under context parallelism (c > 1) it routes B·c/(d·m)
    rows of T/c tokens, each one of c·(model shards) shards of its sequence, as the step's
    `buffer_rows` counts them. (0, 0) without expert parallelism."""
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    if not expert_parallel(cfg, d):
        return 0.0, 0
    c = par.context
    seq, shards = (m.seq_len // t, t) if routes_sequence_shard(cfg, t) else (m.seq_len, 1)
    rows, seq, shards = rows * c, seq // c, shards * c
    local = max(1, m.n_experts // d)
    ranks = m.n_experts // local  # of the exchange: d, or E with replicas
    volume = routed_rows(m, rows, seq, shards, local, exchange(cfg, platform)) * m.d_model * act_size
    layers = moe_layers_on_stage(cfg, p)
    return volume, layers * par.microbatches * (4 + 2 * recomputes_experts(par.remat))


def expert_ids(cfg, shape, rows: int, platform: str = "gpu") -> tuple[float, int]:
    """(result bytes per device, how many per step) of the all-to-all of each buffer row's local
    expert (int32) that precedes every forward's fixed token exchange; (0, 0) without expert
    parallelism or under the ragged exchange (`expert_counts`)."""
    if exchange(cfg, platform) == "ragged":
        return 0.0, 0
    volume, count = all_to_all(cfg, shape, rows, 4, platform)  # (the buffers' bytes at 4 per element: / d_model, 4 per row)
    if not count:
        return 0.0, 0
    forwards = 1 + recomputes_experts(cfg.parallel.remat)
    return volume / cfg.model.d_model, moe_layers_on_stage(cfg, shape[1]) * cfg.parallel.microbatches * forwards


def expert_counts(cfg, shape, platform: str = "gpu") -> tuple[float, int]:
    """(result bytes per device, how many per step) of the all-gather of every rank's per-expert
    counts (E int32 from each of the exchange's ranks) that precedes every forward's ragged token
    exchange (`moe_exchange.ragged_plan`); (0, 0) without expert parallelism or under the fixed one."""
    d, p, _ = shape
    m = cfg.model
    if not expert_parallel(cfg, d) or exchange(cfg, platform) != "ragged":
        return 0.0, 0
    ranks = m.n_experts // max(1, m.n_experts // d)
    forwards = 1 + recomputes_experts(cfg.parallel.remat)
    return float(ranks * m.n_experts * 4), moe_layers_on_stage(cfg, p) * cfg.parallel.microbatches * forwards


def moe_layers_on_stage(cfg, p: int) -> int:
    """MoE layers the busiest of p pipeline stages runs (`jaxpar.parallel.stages`: a skipped slot
    runs nothing)."""
    m, par = cfg.model, cfg.parallel
    if p == 1:
        return m.n_moe_layers
    slots = valid_stage_layout(m, p, par.virtual_stages, par.stage_layers, placement_of(par.schedule))
    return m.n_moe_layers // p if slots is None else int(slots.active["moe" if m.mixed else ""].sum((1, 2)).max())


def routes_sequence_shard(cfg, t: int) -> bool:
    """Do the MoE layers route each model rank's own sequence shard (experts whole on every model
    rank: `parallel.expert_tensor_parallel: false`, a `model` axis of size t > 1)?"""
    return cfg.model.moe and not cfg.parallel.expert_tensor_parallel and t > 1


def whole_experts_bytes(cfg, d: int, t: int) -> float:
    """Per MoE layer, the bytes of the expert weights a device stores whole on every model rank
    (`routes_sequence_shard`): its E/d experts, its 1/d slice of every expert with replicas, or
    all E without expert parallelism; 0 otherwise. Their gradients are summed over `model`."""
    if not routes_sequence_shard(cfg, t):
        return 0.0
    m = cfg.model
    split = d if expert_parallel(cfg, d) else 1
    return 3 * m.d_model * m.expert_width * m.n_experts * jnp.dtype(m.param_dtype).itemsize / split


def assembled_experts(cfg, shape, act_size: int) -> tuple[float, int, int]:
    """Replicated experts (`expert_replicas` > 1): (result bytes per device of one weight's
    all-to-all, how many per step, the bytes of one MoE layer's assembled expert); zeros
    otherwise."""
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    if expert_replicas(cfg, d) <= 1:
        return 0.0, 0, 0
    F = m.expert_width // t if par.expert_tensor_parallel else m.expert_width
    volume = m.d_model * F * act_size
    layers = moe_layers_on_stage(cfg, p)
    return float(volume), 3 * layers * par.microbatches * (2 + (par.remat != "none")), 3 * volume


def recomputed_flops_per_token(m, remat: str) -> float:
    """FLOPs per token the backward pass spends recomputing the MoE layers' forward beyond what
    `jaxpar.plan.steptime.hardware_flops_per_token` counts for the dense model's attention core: under
    `dots_except_mlp` the k experts' three matmuls and the shared experts' gate and up matmuls
    (`full` recomputes every forward already; `dots` and `offload` keep the experts' outputs)."""
    if remat != "dots_except_mlp":
        return 0.0
    experts = 2 * 3 * m.d_model * m.experts_per_token * m.expert_width
    shared = 2 * 2 * m.d_model * m.n_shared_experts * m.expert_width
    return m.n_moe_layers * (experts + shared)


def mlp_width(m, t: int, local: bool = False) -> float:
    """Per token, the elements of an MoE layer's values the elementwise work passes over beyond
    d_model (the dense MLP's d_ff / t): the k routed copies (k x d_model), the experts' hidden
    values (k x F_e / t), the shared experts' (n_shared x F_e / t) and the router's logits (E).
    With `local` (`routes_sequence_shard`) a rank routes 1/t of the tokens at the whole width."""
    F, k = m.expert_width, m.experts_per_token
    if local:
        return (k * m.d_model + k * F + m.n_experts) / t + m.n_shared_experts * F // t
    return k * m.d_model + (k * F + m.n_shared_experts * F) // t + m.n_experts


def tap_width(m, t: int, local: bool = False) -> float:
    """Per token, the elements of the MoE layer's weight matmuls' inputs and output cotangents (what
    a split pipeline's I keeps for W): per assignment the gate and up (input d_model, output F_e/t)
    and down (input F_e/t, output d_model) matmuls, the shared experts likewise, and the router.
    With `local` (`routes_sequence_shard`) the routed part is 1/t of the tokens at the whole width."""
    D, k = m.d_model, m.experts_per_token
    F = m.expert_width if local else m.expert_width // t
    expert = 2 * (D + F) + F + D
    S = m.n_shared_experts * m.expert_width // t
    shared = 2 * (D + S) + S + D if S else 0
    routed = k * expert + D + m.n_experts
    return (routed / t if local else routed) + shared


def gemm_terms(cfg, shape, M: int, gemm, gemm_units: int, router_gemm) -> float:
    """Seconds (at coefficient 1) of one MoE layer's matmuls for one microbatch of M tokens per
    device: the shared experts as a dense MLP, the router ([M, D] x [D, E] in float32), and the
    experts as grouped matmuls at their per-expert shapes: E/d local experts under expert
    parallelism, each with M x d x k / E rows (all data ranks' tokens reach it), else E experts
    with M x k / E rows (x capacity_factor under expert parallelism, whose buffers are padded to
    the capacity; capacity mode without it runs every assignment and zeroes the dropped ones'
    gates). `gemm(rows, k, n, units)` and `router_gemm(rows, k, n, units)` are `compute_terms`'."""
    d, _, t = shape
    m, par = cfg.model, cfg.parallel
    D, F, E, k = m.d_model, m.expert_width // t, m.n_experts, m.experts_per_token
    ep = expert_parallel(cfg, d)
    local = max(1, E // d) if ep else E  # (one expert per rank when there are more ranks than experts)
    rows = M * k * (capacity_scale(m) if ep else 1.0) / local  # per local expert
    if routes_sequence_shard(cfg, t):  # whole experts over this rank's sequence shard: 1/t of the rows
        F, rows = m.expert_width, rows / t
    units = 3 + recomputes_experts(par.remat)  # forward, the two backward matmuls, a recomputed forward
    experts = local * (gemm(rows, D, 2 * F, units) + gemm(rows, F, D, units))
    S = m.n_shared_experts * m.expert_width // t
    shared = gemm(M, D, 2 * S, gemm_units) + gemm(M, S, D, gemm_units) if S else 0.0
    router_rows = M / t if routes_sequence_shard(cfg, t) else M
    return experts + shared + router_gemm(router_rows, D, E, gemm_units)
