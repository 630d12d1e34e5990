"""The planner's mixture-of-experts model (jaxpar.costs_moe): parameter counts, expert-parallel
memory, the all-to-alls on `data`, no data reduction of expert weights, and active-only FLOPs.
Every figure is computed from the config's shapes; nothing is compiled."""

import dataclasses
import math

import pytest

from jaxpar import costs, costs_moe, model
from jaxpar.config import from_dict
from jaxpar.costs_activations import saved_activation_bytes
from jaxpar.plan import memory_wall
from jaxpar.plan_presets import HARDWARE, MODELS

L, D, F, S, B = 4, 128, 256, 128, 16


def moe(mesh=(4, 1, 1), E=8, k=2, shared=0, capacity=None, **par):
    return from_dict({
        "model": {"arch": "llama", "n_layers": L, "d_model": D, "n_heads": 4, "n_kv_heads": 2, "d_ff": 384,
                  "vocab_size": 256, "seq_len": S, "n_experts": E, "experts_per_token": k, "expert_d_ff": F,
                  "n_shared_experts": shared, "capacity_factor": capacity},
        "mesh": dict(zip(("data", "stage", "model"), mesh)), "parallel": par, "train": {"global_batch": B}})


def expert_bytes(cfg, t=1):
    """Bytes of every layer's expert weights (float32 parameters), their width split over t."""
    m = cfg.model
    return m.n_layers * 3 * m.n_experts * m.d_model * m.expert_width * 4 // t


def test_total_and_active_counts():
    cfg = moe(E=8, k=2, shared=1)
    total, active = costs_moe.param_counts(cfg.model)
    assert total == model.count_params(cfg.model)
    idle = L * 3 * (8 - 2) * D * F  # the 6 routed experts a token skips, in every layer
    stats = L * (8 + 3)  # the routers' report (no bias with the softmax router)
    assert active == total - idle - stats
    assert costs_moe.describe_params(cfg.model) == f"{total:,} total, {active:,} active parameters"
    dense = from_dict({"model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "d_ff": 128, "vocab_size": 64}}).model
    assert costs_moe.describe_params(dense) == f"{model.count_params(dense):,} parameters"
    # The published shape: Mixtral-8x7B has 46.7 B parameters, 12.9 B active.
    total, active = costs_moe.param_counts(from_dict(MODELS["mixtral-8x7b"][1]).model)
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9


@pytest.mark.parametrize("mesh", [(4, 1, 1), (2, 1, 2), (2, 2, 1)])
def test_expert_parallel_memory_falls_by_the_experts_share(mesh):
    """With ZeRO-0, params, gradients and both Adam moments of the experts are stored whole on
    every rank without expert parallelism, and 1/d of them with it: the difference is exact."""
    d, p, t = mesh
    ep, rep = (costs.memory(moe(mesh, microbatches=2 * p, expert_parallel=on), mesh) for on in (True, False))
    share = expert_bytes(moe(mesh), t) // p * (d - 1) // d
    assert rep["params"] - ep["params"] == share
    assert rep["optimizer"] - ep["optimizer"] == 2 * share
    # Gradients: float32 accumulators (microbatches) beside one microbatch's gradients: twice.
    assert rep["gradients"] - ep["gradients"] == 2 * share
    assert costs.model_state(moe(mesh), mesh)["experts"] == expert_bytes(moe(mesh), t) // (p * d)


def test_zero_does_not_shard_expert_parallel_experts():
    """Under ZeRO-3 the dense leaves are sharded over data and the experts, already split by
    expert parallelism, are not sharded again nor gathered."""
    cfg = moe((4, 1, 1), zero=3)
    st = costs.model_state(cfg, (4, 1, 1))
    assert st["experts"] == expert_bytes(cfg) // 4
    assert st["sharded"] + st["experts"] <= st["local"]
    mem = costs.memory(cfg, (4, 1, 1))
    assert mem["gathered_params"] < st["local"] - st["experts"]


def all_to_alls(cfg, shape, ids=False, platform="gpu"):
    """The planner's all-to-alls on `platform`; the one of each buffer row's expert id (int32,
    before each forward's fixed token exchange) only with `ids`."""
    out = [c for c in costs.collectives(cfg, shape, platform) if c.kind == "all-to-all"]
    rows = cfg.train.global_batch // (shape[0] * cfg.parallel.microbatches)
    id_bytes, id_count = costs_moe.expert_ids(cfg, shape, rows, platform)
    return out if ids else [c for c in out if not (c.bytes == id_bytes and c.count == id_count)]


@pytest.mark.parametrize("k,capacity,remat,micro", [(2, None, "none", 1), (4, None, "none", 2),
                                                    (2, 1.25, "none", 1), (2, None, "full", 1)])
def test_all_to_all_bytes(k, capacity, remat, micro):
    """The fixed exchange's bytes (what runs on CPU, and anywhere with model.moe_exchange=fixed)."""
    d = 4
    cfg = moe((d, 1, 1), k=k, capacity=capacity, remat=remat, microbatches=micro)
    a2a, ids = sorted(all_to_alls(cfg, (d, 1, 1), ids=True, platform="cpu"), key=lambda c: -c.bytes)
    assert costs_moe.exchange(cfg, "cpu") == "fixed"
    rows = B // (d * micro)
    assert a2a.axes == ids.axes == ("data",) and not a2a.overlap
    # The step's fixed buffers: to each of the d ranks, every token's choices on its E/d = 2
    # experts (min(k, 2) rows per token), or in capacity mode each of its experts full in every
    # sequence, of d_model x 4 bytes (float32 compute); dropless that is d·min(k, 2)/k times
    # the tokens x k x d_model of a ragged all-to-all.
    per_rank = rows * S * min(k, 2) if capacity is None else min(rows * S * min(k, 2),
                                                                 2 * math.ceil(capacity * S * k / 8) * rows)
    assert a2a.bytes == d * per_rank * D * 4
    assert ids.bytes == d * per_rank * 4  # each row's local expert, int32
    # Two each way per layer and microbatch, two more for the forward remat `full` recomputes;
    # the ids once per forward.
    assert a2a.count == L * micro * (4 + 2 * (remat == "full"))
    assert ids.count == L * micro * (1 + (remat == "full"))
    assert costs.bytes_per_axis(cfg, (d, 1, 1), "cpu")["data"] >= a2a.bytes * a2a.count
    # The same bytes on a GPU told to run the fixed exchange.
    fixed = cfg.replace(model={"moe_exchange": "fixed"})
    assert [(c.bytes, c.count) for c in all_to_alls(fixed, (d, 1, 1), ids=True)] == \
        [(c.bytes, c.count) for c in all_to_alls(cfg, (d, 1, 1), ids=True, platform="cpu")]


@pytest.mark.parametrize("k,capacity,remat", [(2, None, "none"), (4, None, "full"), (2, 0.75, "none"),
                                              (2, 1.25, "none")])
def test_the_ragged_exchange_moves_the_routed_rows(k, capacity, remat):
    """On GPUs (`model.moe_exchange: auto`, or ragged anywhere) the planner charges what the ragged
    exchange moves, by the executor's rule (`moe_exchange.routed_rows`): each device's tokens x k
    rows of d_model (x capacity_factor where it drops assignments), not the worst-case buffers;
    no expert-id all-to-all, and one all-gather of the ranks' per-expert counts per forward."""
    d, micro = 4, 2
    cfg = moe((d, 1, 1), k=k, capacity=capacity, remat=remat, microbatches=micro)
    assert costs_moe.exchange(cfg, "gpu") == "ragged" == costs_moe.exchange(
        cfg.replace(model={"moe_exchange": "ragged"}), "cpu")
    rows = B // (d * micro)
    [a2a] = all_to_alls(cfg, (d, 1, 1), ids=True)
    assert a2a.bytes == rows * S * k * min(1.0, capacity or 1.0) * D * 4
    assert a2a.count == L * micro * (4 + 2 * (remat == "full"))
    [fixed] = [c for c in all_to_alls(cfg, (d, 1, 1), platform="cpu") if c.bytes > D]
    # (In capacity mode the fixed buffers hold each expert's capacity: at c = 0.75 what the ragged one moves.)
    assert fixed.bytes == d * rows * S * min(k, 2) * D * 4 if capacity is None else fixed.bytes >= a2a.bytes
    counts = [c for c in costs.collectives(cfg, (d, 1, 1)) if c.kind == "all-gather" and c.bytes == d * 8 * 4]
    assert [(c.axes, c.count) for c in counts] == [(("data",), L * micro * (1 + (remat == "full")))]
    assert not [c for c in costs.collectives(cfg, (d, 1, 1), "cpu") if c.kind == "all-gather" and c.bytes == d * 8 * 4]
    # The step time sees the smaller bytes.
    roof = costs.Roofline(HARDWARE["h100-80gb"], devices=d)
    assert costs.step_time(cfg, (d, 1, 1), roof)["total"] < costs.step_time(cfg, (d, 1, 1), roof, "cpu")["total"]


def test_no_all_to_all_without_expert_parallelism():
    assert not all_to_alls(moe((4, 1, 1), expert_parallel=False), (4, 1, 1))
    assert not all_to_alls(moe((1, 1, 4)), (1, 1, 4))


def reduced_over_data(cfg, shape):
    """Gradient bytes the step's data-axis reductions cover: an all-reduce its result, a
    reduce-scatter d times its (1/d-sized) result."""
    d = shape[0]
    return sum(c.bytes * (d if c.kind == "reduce-scatter" else 1) for c in costs.collectives(cfg, shape)
               if c.axes[0] == "data" and c.kind in ("all-reduce", "reduce-scatter") and c.count)


@pytest.mark.parametrize("zero,mesh", [(0, (4, 1, 1)), (1, (4, 1, 1)), (2, (4, 1, 2)), (3, (4, 1, 1)),
                                       (0, (2, 2, 1)), (1, (2, 2, 1))])
def test_expert_weights_are_never_reduced_over_data(zero, mesh):
    """Without expert parallelism every expert's gradient is reduced over data like a dense
    leaf's; with it, what is reduced is exactly that less every expert weight."""
    d, p, t = mesh
    par = dict(zero=zero, microbatches=2 * p)
    ep, rep = (reduced_over_data(moe(mesh, expert_parallel=on, **par), mesh) for on in (True, False))
    assert rep - ep == pytest.approx(expert_bytes(moe(mesh), t) / p, rel=1e-9)


def test_flops_count_k_of_the_experts():
    """Quadrupling the experts at the same k adds only the router's FLOPs (6 D per expert per
    layer per token); counting every expert as active would add 6 x 3 D F x 24 per layer."""
    small, big = moe(E=8), moe(E=32)
    router = 6 * L * D * (32 - 8)
    assert costs.model_flops_per_token(big) - costs.model_flops_per_token(small) == router
    assert costs.hardware_flops_per_token(big, 1) - costs.hardware_flops_per_token(small, 1) == router
    # k is what the expert FLOPs follow: 6 x 3 D F per extra expert per token per layer.
    assert costs.model_flops_per_token(moe(k=4)) - costs.model_flops_per_token(moe(k=2)) == 6 * L * 3 * D * F * 2


def test_remat_dots_keeps_the_experts_and_dots_except_mlp_recomputes_them():
    """`dots` saves the grouped matmuls' outputs (named DOT_TAG, as dense matmuls' are) but not
    their elementwise products, so its backward pass does not run the experts again: its FLOPs
    are the dense model's `dots` ones. `dots_except_mlp` keeps attention's projections only, so
    the experts' three matmuls are recomputed, which the FLOPs count."""
    m = dataclasses.replace(moe().model, n_layers=1)
    rows = 2
    hidden = rows * S * 2 * F * 4  # one [tokens x k, F_e] float32 value
    none, dots = (saved_activation_bytes(m, rows, 1, False, r, False)[0] for r in ("none", "dots"))
    assert none - dots >= hidden  # the product silu(gate) x up: saved only by `none`
    assert dots >= 2 * hidden  # (at least) gate's and up's outputs: saved by `dots`
    attn = 4 * L * 4 * 32 * S
    extra = costs.hardware_flops_per_token(moe(remat="dots"), 1) - costs.hardware_flops_per_token(moe(), 1)
    assert extra == attn
    extra = costs.hardware_flops_per_token(moe(remat="dots_except_mlp"), 1) - costs.hardware_flops_per_token(moe(), 1)
    assert extra == attn + 2 * 3 * L * D * 2 * F


def test_expert_gemms_are_the_active_ones():
    """The compute model's matmul time follows k, not E: with 4x the experts at the same k the
    expert FLOPs are unchanged (each expert takes tokens x k / E rows) and what is added is the
    extra experts' weights read through HBM and the router's wider float32 matmul, exactly."""
    hw, shape = HARDWARE["h100-80gb"], (1, 1, 1)
    t8, t32 = (costs.compute_terms(moe(shape, E=E), shape, hw)["matmul"] for E in (8, 32))
    M, units, extra = B * S, 3, 32 - 8  # tokens per microbatch; forward and two backward matmuls
    weights = units * extra * 3 * D * F * 4 / hw.hbm_bw
    router = units * (2 * M * D * extra / (costs.MATMUL_EFFICIENCY * hw.peak_flops_fp32) + (D + M) * extra * 4 / hw.hbm_bw)
    assert t32 - t8 == pytest.approx(L * (weights + router), rel=1e-9)
    # Counting all 32 experts as active would add their FLOPs: far more than that.
    all_active = units * 2 * M * 3 * D * F * (32 - 2) / (costs.MATMUL_EFFICIENCY * hw.peak_flops_fp32)
    assert L * all_active > 10 * (t32 - t8)


def test_memory_wall_splits_the_experts():
    rows = {label: mem for label, _, mem in memory_wall(moe((1, 1, 1)).replace(mesh={"data": 1}), 8, node_size=2)}
    ep = next(v for k, v in rows.items() if k.startswith("tensor parallel"))
    rep = rows["  the same, experts replicated"]
    assert rep["params"] - ep["params"] == expert_bytes(moe(), 2) * 3 // 4


def test_the_plan_replicates_experts_where_data_does_not_divide_them():
    """On 16 devices with 6 experts, layouts with data 4, 8 or 16 are candidates with every expert
    on every data rank (`expert_parallel: false`, which validation requires there), not refused or
    costed with a fraction of an expert per rank; data 2 splits them. With 8 experts, data 16 has
    each expert on 2 ranks (expert parallelism with replicas)."""
    from jaxpar.costs import Roofline
    from jaxpar.plan import plan
    from jaxpar.plan_presets import HARDWARE
    for E, want in ((6, {2: {True}, 4: {False}, 8: {False}, 16: {False}}), (8, {8: {True}, 16: {True}})):
        # (seq_len 18: no context-parallel candidates, whose expert layout is the same as c = 1's,
        # which would triple the plan's estimates)
        cfg = moe((1, 1, 1), E=E).replace(mesh={"data": 1}, model={"seq_len": 18}, train={"global_batch": 32})
        result = plan(cfg, 16, Roofline(HARDWARE["h100-80gb"], 0.5, 16), "cpu")
        by_data = {}
        for est in result.ranked + result.too_big:
            by_data.setdefault(est.shape[0], set()).add(est.cfg.parallel.expert_parallel)
        assert all(by_data[d] == v for d, v in want.items()), (E, by_data)
        assert not any("n_experts" in reason for reason in result.refused)


def test_replicated_experts_are_assembled_per_layer():
    """8 experts on 16 data ranks (2 replicas each): the state stores 1/16 of every expert, as
    the layout says; per MoE layer and microbatch three all-to-alls of one expert's weight each
    way (once more under a remat policy that does not save them), and the gemms of one expert per
    rank taking a group's tokens (as many rows as 8 ranks' experts take on 8 ranks)."""
    shape, shape8 = (16, 1, 1), (8, 1, 1)
    cfg = moe(shape, E=8, microbatches=2)
    assert costs.model_state(cfg, shape)["experts"] == expert_bytes(cfg) // 16
    weights = [c for c in all_to_alls(cfg, shape) if c.bytes == D * F * 4]
    assert len(weights) == 1 and weights[0].count == 3 * L * 2 * 2
    [again] = [c for c in all_to_alls(cfg.replace(parallel={"remat": "full"}), shape) if c.bytes == D * F * 4]
    assert again.count == 3 * L * 2 * 3
    assert not [c for c in all_to_alls(moe(shape8, E=8), shape8) if c.bytes == D * F * 4]
    hw = HARDWARE["h100-80gb"]
    # (the same tokens per device on both meshes: the expert gemms are equal)
    t16 = costs.compute_terms(moe(shape, E=8).replace(train={"global_batch": 32}), shape, hw)["matmul"]
    t8 = costs.compute_terms(moe(shape8, E=8), shape8, hw)["matmul"]
    assert t16 == pytest.approx(t8, rel=1e-9)
    mem = costs.memory(cfg, shape)
    assert mem["gathered_params"] == L * 3 * D * F * 4  # remat none: every layer's expert held for backward


def test_mixed_layers_are_costed_by_their_kind():
    """`model.moe_layers: every:2`, half the layers MoE: the all-to-alls are the MoE layers' only;
    FLOPs per token (the recomputed ones under each remat policy included: a dense layer's MLP
    inputs, an MoE layer's experts), saved activations and the compute model's matmul time are
    the mean of the dense model's and the all-MoE model's, layer by layer."""
    from jaxpar.costs_activations import _activations

    all_moe = moe()
    mixed, dense = all_moe.replace(model={"moe_layers": "every:2"}), all_moe.replace(model={"n_experts": 0})
    [a], [b] = all_to_alls(mixed, (4, 1, 1)), all_to_alls(all_moe, (4, 1, 1))
    assert a.bytes == b.bytes and 2 * a.count == b.count
    for remat in ("none", "dots", "dots_except_mlp", "full"):
        flops = [costs.hardware_flops_per_token(c.replace(parallel={"remat": remat}), 1) for c in (mixed, dense, all_moe)]
        assert 2 * flops[0] == flops[1] + flops[2], remat
        saved = [_activations(c.model, 2, 1, False, remat, True, False)["layers"] for c in (mixed, dense, all_moe)]
        assert 2 * saved[0] == saved[1] + saved[2], remat
    matmul = [costs.compute_terms(c, (4, 1, 1), HARDWARE["h100-80gb"])["matmul"] for c in (mixed, dense, all_moe)]
    assert 2 * matmul[0] == pytest.approx(matmul[1] + matmul[2], rel=1e-9)


@pytest.mark.parametrize("shared", [0, 1])
def test_experts_whole_on_every_model_rank(shared):
    """`expert_tensor_parallel: false` on (2, 1, 4) with SP: each model rank routes its own
    sequence shard, so the all-to-alls carry 1/t of the tokens; an MoE layer without shared experts
    loses its MLP's all-gather and reduce-scatter over `model` (with shared experts they stay);
    the rank's experts (E/d of them, whole) have their gradients all-reduced over `model` per
    layer and microbatch. (Against the compiled step: `test_plan.py`.)"""
    shape, t = (2, 1, 4), 4
    etp, whole = (moe(shape, shared=shared, sequence_parallel=True, expert_tensor_parallel=on) for on in (True, False))
    [a], [b] = all_to_alls(etp, shape), all_to_alls(whole, shape)
    assert b.bytes * t == pytest.approx(a.bytes, rel=1e-12) and a.count == b.count

    def model_collectives(cfg):
        out = {}
        for c in costs.collectives(cfg, shape):
            if c.axes == ("model",):
                out[c.kind, c.bytes] = out.get((c.kind, c.bytes), 0) + c.count
        return out
    x, y = model_collectives(etp), model_collectives(whole)
    experts = 3 * D * F * 8 // 2 * 4 * L  # E/d = 4 whole experts per layer, float32
    assert y.pop(("all-reduce", experts)) == 1 and ("all-reduce", experts) not in x
    dropped = {k: x[k] - y.get(k, 0) for k in x if x[k] != y.get(k, 0)}
    if shared:
        assert not dropped
    else:  # per MoE layer and microbatch: the MLP's gather in the forward and backward, its scatter in both
        A = B // 2 * S * D * 4
        assert dropped == {("all-gather", A): 2 * L, ("reduce-scatter", A / t): 2 * L}, dropped
