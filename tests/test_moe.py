"""Mixture of experts (`jaxpar.model.moe`): the layer against a dense per-expert reference (values
and gradients, the router losses included), parity with one device on every axis and schedule,
the routers' report, DeepSeek-V3's bias update, and bad configs refused before compiling."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import COMPILER_OPTIONS, assert_parity, run_reference, run_steps
from jaxpar.config import ConfigError, ModelConfig, from_dict, validate
from jaxpar.mesh import check_sizes, make_mesh
from jaxpar import model
from jaxpar.model import moe as moe_lib
from jaxpar.model.moe import MoE
from jaxpar.inspect import analyze
from jaxpar.train.step import build

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # CPU thread-count warnings


def layer_cfg(**kw) -> ModelConfig:
    base = dict(n_layers=2, d_model=16, n_heads=2, d_ff=32, vocab_size=64, seq_len=12, n_experts=4,
                experts_per_token=2, expert_d_ff=8, router_aux_loss=0.1, router_z_loss=0.01)
    return ModelConfig(**{**base, **kw})


def reference(cfg: ModelConfig, p: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(output [B, T, D], the router losses' term of the objective) written the slow way: every
    expert on every token, each token's output the gate-weighted sum of its experts' outputs,
    capacity by a plain loop over the queue; the losses as their definitions say."""
    E, k = cfg.n_experts, cfg.experts_per_token
    B, T, _ = x.shape
    logits = x @ p["router"]
    if cfg.router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        choice, weights = probs, probs
    else:
        scores = jax.nn.sigmoid(logits)
        choice, weights = scores + p["router_bias"], scores
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    experts = np.asarray(jax.lax.top_k(jax.lax.stop_gradient(choice), k)[1])  # [B, T, k]
    gates = jnp.take_along_axis(weights, jnp.asarray(experts), axis=-1)
    if cfg.router_norm_topk:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    keep = np.ones((B, T, k), np.float32)
    if cfg.capacity_factor is not None:
        cap = math.ceil(cfg.capacity_factor * T * k / E)
        for b in range(B):
            taken = [0] * E
            for j in range(k):  # every first choice, in sequence order, then every second choice
                for t in range(T):
                    e = experts[b, t, j]
                    keep[b, t, j] = float(taken[e] < cap)
                    taken[e] += 1
    combine = jnp.einsum("btk,btke->bte", gates * keep, jax.nn.one_hot(experts, E))
    h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, p["w_gate"])) * jnp.einsum("btd,edf->btef", x, p["w_up"])
    out = jnp.einsum("btef,efd,bte->btd", h, p["w_down"], combine)
    if cfg.n_shared_experts:
        out = out + (jax.nn.silu(x @ p["shared_gate"]) * (x @ p["shared_up"])) @ p["shared_down"]
    load = jnp.mean(jax.nn.one_hot(experts, E).sum(2), axis=1) / k  # [B, E]
    aux = E * jnp.sum(load * jnp.mean(probs, axis=1), axis=-1)
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2, axis=1)
    return out, jnp.mean(cfg.router_aux_loss * aux + cfg.router_z_loss * z)


LAYER_CASES = {
    "top2": {},
    "top1": {"experts_per_token": 1, "router_norm_topk": False},
    "shared": {"n_shared_experts": 2},
    "sigmoid_bias": {"router": "sigmoid_bias"},
    "capacity": {"capacity_factor": 1.0},
    "capacity_top1": {"capacity_factor": 0.75, "experts_per_token": 1},
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_matches_a_dense_per_expert_reference(case):
    """Value, and gradients of every parameter and of the input, of  sum(out * r) + the router
    losses: the grouped matmuls, the sort and its inverse, the capacity queue, and the losses'
    gradient entering through the custom VJP all agree with the slow definition."""
    cfg = layer_cfg(**LAYER_CASES[case])
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    if cfg.router == "sigmoid_bias":  # a bias that changes the choice of experts
        params["router_bias"] = 0.3 * jax.random.normal(jax.random.key(3), params["router_bias"].shape)
    x = jax.random.normal(jax.random.key(1), (3, cfg.seq_len, cfg.d_model))
    r = jax.random.normal(jax.random.key(2), x.shape)

    def ours(params, x):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, params)
        return jnp.sum(nnx.merge(graphdef, st)(x) * r)

    def slow(params, x):
        out, losses = reference(cfg, params, x)
        return jnp.sum(out * r) + losses

    want_value, want = jax.value_and_grad(slow, argnums=(0, 1))(params, x)
    value, got = jax.value_and_grad(ours, argnums=(0, 1))(params, x)
    out_ref, _ = reference(cfg, params, x)
    np.testing.assert_allclose(value, float(jnp.sum(out_ref * r)), rtol=1e-5)  # (the losses add no value)
    got_params, got_x = got
    want_params, want_x = want
    np.testing.assert_allclose(got_x, want_x, atol=1e-5)
    for key in want_params:
        if key in ("router_stats", "router_bias"):
            continue
        np.testing.assert_allclose(got_params[key], want_params[key], atol=1e-5, err_msg=key)
    if cfg.capacity_factor is not None:  # the case must drop something, or it tests nothing
        assert float(got_params["router_stats"][-1]) > 0


def test_router_losses_move_the_router_gradient():
    """The losses' gradient is there at all: with both coefficients 0 the router's gradient differs."""
    cfg = layer_cfg()
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, cfg.seq_len, cfg.d_model))

    def grad_router(c):
        graphdef, state = nnx.split(MoE(c, rngs=nnx.Rngs(0)))
        return jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x)))(state)["router"][...]

    del layer
    diff = np.max(np.abs(grad_router(cfg) - grad_router(layer_cfg(router_aux_loss=0.0, router_z_loss=0.0))))
    assert diff > 1e-4


def test_router_stats_report_the_loads_and_losses():
    """The stats leaf's gradient is the report: loads summing to 1 per layer, the losses' mean values."""
    cfg = layer_cfg()
    graphdef, state = nnx.split(MoE(cfg, rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (4, cfg.seq_len, cfg.d_model))
    stats = jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x)))(state)["router_stats"][...]
    E = cfg.n_experts
    np.testing.assert_allclose(np.sum(stats[:E]), 1.0, rtol=1e-6)
    params = nnx.to_pure_dict(state)
    logits = x @ params["router"]
    aux, z, _, _ = moe_lib.router_losses(cfg, logits, None)
    np.testing.assert_allclose(stats[E:E + 2], [jnp.mean(aux), jnp.mean(z)], rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Parity with one device


def moe_run(d, p, t, *, schedule="1f1b", zero=0, expert_parallel=True, expert_tensor_parallel=True, **model):
    return from_dict({
        "model": {"n_layers": 4, "d_model": 32, "n_heads": 4, "d_ff": 64, "vocab_size": 64, "seq_len": 16,
                  "n_experts": 4, "experts_per_token": 2, "expert_d_ff": 32, "router_aux_loss": 0.05,
                  "router_z_loss": 0.01, **model},
        "mesh": {"data": d, "stage": p, "model": t},
        "parallel": {"schedule": schedule, "microbatches": max(p, 2), "zero": zero, "zero_min_elements": 0,
                     "sequence_parallel": t > 1, "expert_parallel": expert_parallel,
                     "expert_tensor_parallel": expert_tensor_parallel},
        "train": {"steps": 3, "global_batch": 16, "lr": 1e-2, "warmup_steps": 1},
    })


_REF = {}


def reference_run(cfg):
    key = repr(cfg.model)
    if key not in _REF:
        _REF[key] = run_reference(cfg)
    return _REF[key]


# Expert parallelism wherever data > 1 (the default), unless the case turns it off. Every data
# size (2, 4, 8), with tensor parallelism (experts split over `model`, or whole), ZeRO 0-3,
# pipelines, top-1 and top-2, shared experts, the sigmoid-bias router and capacity mode; the two
# lists together cover all 10 factorizations of 8 devices into (data, stage, model).
PARITY = [  # (mesh, schedule, zero, model options)
    ((8, 1, 1), "1f1b", 1, {"n_experts": 8}),
    ((2, 2, 2), "1f1b", 3, {"n_shared_experts": 1}),
    ((4, 1, 2), "1f1b", 0, {"router": "sigmoid_bias", "experts_per_token": 1}),
    ((1, 4, 2), "zb_h1", 2, {"capacity_factor": 1.0}),
    ((4, 2, 1), "1f1b", 2, {"capacity_factor": 1.0, "experts_per_token": 1}),
    ((2, 1, 4), "1f1b", 1, {"expert_tensor_parallel": False, "capacity_factor": 1.0, "n_shared_experts": 1}),
    # Dense and MoE layers mixed, pipelined: both stacks split over `stage`, ZeRO-3's gathers, and
    # ZB-H1's split backward with each stack's taps.
    ((2, 2, 2), "1f1b", 3, {"moe_layers": "every:2", "n_shared_experts": 1}),
    ((1, 2, 4), "zb_h1", 0, {"moe_layers": "every:2", "expert_tensor_parallel": False}),
    # More data ranks than experts: each of 4 experts on 2 of 8 ranks (`own_expert`, `replica_groups`).
    ((8, 1, 1), "1f1b", 1, {}),
    # A dense first layer, pipelined (DeepSeek-V3's pattern): stage 0 runs it and one MoE layer,
    # stage 1 three MoE layers; the dense stack (1 layer) is stored with `stage` on another dim.
    ((2, 2, 2), "zb_h1", 3, {"moe_layers": "first_dense:1", "n_layers": 5, "stage_layers": (2, 3)}),
]
PARITY_SLOW = [
    ((2, 1, 4), "1f1b", 3, {}),
    ((1, 8, 1), "1f1b", 0, {"n_shared_experts": 1}),
    ((2, 4, 1), "interleaved_1f1b", 1, {"experts_per_token": 1}),
    ((4, 2, 1), "gpipe", 3, {"router": "sigmoid_bias"}),
    ((8, 1, 1), "1f1b", 0, {"n_experts": 8, "capacity_factor": 1.0}),
    ((2, 2, 2), "zb_h1", 1, {"router": "sigmoid_bias", "n_shared_experts": 1}),
    ((8, 1, 1), "1f1b", 1, {"expert_parallel": False}),
    ((2, 1, 4), "1f1b", 1, {"capacity_factor": 1.25, "n_shared_experts": 1}),
    ((2, 2, 2), "1f1b", 3, {"expert_tensor_parallel": False, "capacity_factor": 0.75, "router": "sigmoid_bias"}),
    ((1, 4, 2), "zb_h1", 0, {"expert_tensor_parallel": False}),
    ((1, 2, 4), "gpipe", 1, {"experts_per_token": 1}),
    ((1, 1, 8), "1f1b", 0, {"n_heads": 8}),
    # Dense and MoE layers mixed (`model.moe_layers`): the two stacks under data parallelism and
    # a dense first layer with ZeRO-2.
    ((8, 1, 1), "1f1b", 1, {"moe_layers": "every:2", "n_experts": 8}),
    ((4, 1, 2), "1f1b", 2, {"moe_layers": "first_dense:1", "router": "sigmoid_bias"}),
    # Dense first layers on their own stages, interleaved: chunks 0-1 dense, 2-7 MoE (6 MoE layers
    # do not split over 4 stages either), and a dense prefix with groups of two after it.
    ((1, 4, 2), "interleaved_1f1b", 1, {"moe_layers": "first_dense:2", "n_layers": 8}),
    ((4, 2, 1), "1f1b", 2, {"moe_layers": "first_dense:1,every:2", "n_layers": 7, "stage_layers": (3, 4)}),
    # Replicated experts (data a multiple of n_experts) with a pipeline, ZeRO-3 and mixed layers,
    # whole experts on each model rank, and capacity mode on 4 replicas.
    ((4, 2, 1), "zb_h1", 3, {"n_experts": 2, "moe_layers": "every:2"}),
    ((4, 1, 2), "1f1b", 1, {"n_experts": 2, "expert_tensor_parallel": False, "n_shared_experts": 1}),
    ((8, 1, 1), "1f1b", 0, {"n_experts": 2, "capacity_factor": 1.0}),
]


def _parity(mesh, schedule, zero, options):
    v = 2 if schedule == "interleaved_1f1b" else 1
    options = dict(options)
    n_layers, stage_layers = options.pop("n_layers", max(4, mesh[1] * v)), options.pop("stage_layers", None)
    cfg = moe_run(*mesh, schedule=schedule, zero=zero, **options)
    cfg = cfg.replace(model={"n_layers": n_layers}, parallel={"virtual_stages": v, "stage_layers": stage_layers})
    ref = reference_run(cfg)
    out = run_steps(cfg)
    assert_parity(out, ref)
    assert out["moe"].shape[1] >= 4  # the router metrics were compared
    return out, ref


@pytest.mark.parametrize("mesh,schedule,zero,options", PARITY)
def test_moe_matches_single_device(mesh, schedule, zero, options):
    _parity(mesh, schedule, zero, options)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,schedule,zero,options", PARITY_SLOW)
def test_moe_matches_single_device_more(mesh, schedule, zero, options):
    _parity(mesh, schedule, zero, options)


@pytest.mark.parametrize("d", [1, 4])
def test_every_expert_gets_its_gradient_and_the_bias_balances(d):
    """Every expert's weights receive a gradient (none is starved by a routing mistake, on one
    device or split over 4 data ranks, one expert each), and with sigmoid_bias each bias moved
    by exactly the rate, up for experts below the mean load."""
    cfg = moe_run(d, 1, 1, router="sigmoid_bias")
    out = run_steps(cfg.replace(train={"steps": 1}))
    g = out["grads"]["blocks"]["mlp"]
    for key in ("w_gate", "w_up", "w_down"):
        per_expert = np.abs(g[key]).reshape(*g[key].shape[:2], -1).max(-1)  # [layers, experts]
        assert (per_expert > 0).all(), key
    moved = out["params"]["blocks"]["mlp"]["router_bias"] - out["init"]["blocks"]["mlp"]["router_bias"]
    np.testing.assert_allclose(np.abs(moved), cfg.model.router_bias_rate, rtol=1e-6)


def test_the_step_logs_the_routers():
    cfg = moe_run(1, 1, 1, capacity_factor=0.5)
    program = build(cfg, make_mesh(cfg, jax.devices()[:1]))
    state = program.init(jax.random.key(0))
    batch = jnp.zeros((16, 17), jnp.int32) + jnp.arange(17) % 64
    _, metrics = program.step(state, batch)
    assert {"moe_aux_loss", "moe_z_loss", "moe_max_load", "moe_min_load", "moe_dropped"} <= set(metrics)
    assert 0 < float(metrics["moe_dropped"]) < 1
    assert float(metrics["moe_min_load"]) <= 1.0 <= float(metrics["moe_max_load"])


@pytest.mark.parametrize("model,mesh,parallel,message", [
    ({"experts_per_token": 5}, {}, {}, "experts_per_token = 5 must be between 1 and model.n_experts = 4"),
    ({"moe_layers": "every 2"}, {}, {}, "moe_layers = 'every 2' is not a layer pattern"),
    ({"moe_layers": "every:3"}, {}, {}, "moe_layers = every:3 does not fit model.n_layers = 4"),
    ({"moe_layers": "first_dense:4"}, {}, {}, "moe_layers = first_dense:4 does not fit model.n_layers = 4"),
    ({"moe_layers": "every:2", "n_experts": 0}, {}, {}, "moe_layers = every:2 needs model.n_experts > 0"),
    ({"capacity_factor": 0.0}, {}, {}, "capacity_factor = 0.0 must be positive"),
    ({"n_experts": -1}, {}, {}, "n_experts = -1 must not be negative"),
    ({"arch": "gpt2"}, {}, {}, "needs model.arch = llama"),
    ({"router_aux_loss": -0.1}, {}, {}, "router_aux_loss = -0.1 must not be negative"),
    ({}, {"data": 1}, {"data_mode": "naive"}, "cannot be combined with parallel.data_mode = naive"),
])
def test_bad_moe_configs_are_refused(model, mesh, parallel, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(from_dict({"model": {"n_experts": 4, **model}, "mesh": mesh, "parallel": parallel}))


def test_expert_width_must_divide_over_model():
    cfg = moe_run(1, 1, 2, expert_d_ff=30)
    with pytest.raises(ConfigError, match="expert_d_ff = 30 is not divisible by mesh.model = 4"):
        check_sizes(cfg, (1, 1, 4))


def test_active_parameters_count_k_of_the_experts():
    cfg = layer_cfg(n_shared_experts=1)
    shapes = model.param_shapes(cfg)["blocks"]["mlp"]
    expert = sum(shapes[k].size for k in ("w_gate", "w_up", "w_down")) // cfg.n_experts
    stats = shapes["router_stats"].size
    total = model.count_params(cfg)
    assert model.count_params(cfg, active=True) == total - (cfg.n_experts - cfg.experts_per_token) * expert - stats


def test_expert_parallel_step_moves_tokens_not_expert_gradients():
    """The compiled step on (4, 1, 1), one expert per data rank: per MoE layer two all-to-alls of
    the tokens' hidden states forward and their two transposes backward (plus one of int32 expert
    ids), each a fixed buffer of rows x d_model per destination rank; the only data-axis
    reductions are the dense parameters' gradients (and the loss): the experts' never are."""
    cfg = moe_run(4, 1, 1).replace(parallel={"microbatches": 1})
    mesh = make_mesh(cfg, jax.devices()[:4])
    program = build(cfg, mesh)
    spec = program.layout.params["blocks"]["mlp"]["w_gate"]
    assert "data" in jax.tree.leaves(tuple(spec))  # each rank stores its experts only
    r = analyze(program.step.lower(program.abstract_state(), program.abstract_batch()).compile(), mesh)
    m, D, L, d, k = cfg.model, cfg.model.d_model, cfg.model.n_layers, 4, cfg.model.experts_per_token
    tokens = cfg.train.global_batch // d * m.seq_len
    rows = tokens * min(k, m.n_experts // d)  # a destination's worst case (dropless)
    hidden = [c for c in r.select(kind="all-to-all", spans="data") if c.bytes == d * rows * D * 4]
    ids = [c for c in r.select(kind="all-to-all", spans="data") if c.bytes == d * rows * 4]
    assert len(hidden) + len(ids) == len(r.select(kind="all-to-all")), r.table()
    assert sum(c.executions for c in hidden) == 4 * L and sum(c.executions for c in ids) == L, r.table()
    shapes = model.param_shapes(m)
    dense = sum(x.size * 4 for x in jax.tree.leaves(shapes)) - sum(
        shapes["blocks"]["mlp"][key].size * 4 for key in ("w_gate", "w_up", "w_down"))
    reduced = r.traffic(kind=("all-reduce", "reduce-scatter"), spans="data")
    assert dense <= reduced <= dense + 64, r.table()  # (+ the loss and the NaN guard's scalars)


def test_replicated_experts_are_assembled_not_reduced():
    """The compiled step on (8, 1, 1) with 4 experts, each on 2 data ranks: every rank stores a
    1/8 slice of every expert (data on `embed`); per MoE layer each of the three expert weights is
    assembled by one all-to-all of one expert's bytes forward and one back (its transpose); the
    tokens' all-to-alls run within groups of 4 ranks, one expert each (4 per layer, plus the expert
    ids); and the only data-axis reductions are the dense parameters' gradients and the loss."""
    cfg = moe_run(8, 1, 1).replace(parallel={"microbatches": 1})
    mesh = make_mesh(cfg, jax.devices()[:8])
    program = build(cfg, mesh)
    assert tuple(program.layout.params["blocks"]["mlp"]["w_gate"])[1:3] == (None, "data")  # [layers, E, D, F]
    r = analyze(program.step.lower(program.abstract_state(), program.abstract_batch()).compile(), mesh)
    m, D, F, L, E = cfg.model, cfg.model.d_model, cfg.model.expert_width, cfg.model.n_layers, cfg.model.n_experts
    rows = cfg.train.global_batch // 8 * m.seq_len  # a destination's worst case: every token (one expert each)
    a2a = r.select(kind="all-to-all", spans="data")
    weights = [c for c in a2a if c.bytes == D * F * 4]
    hidden = [c for c in a2a if c.bytes == E * rows * D * 4]
    ids = [c for c in a2a if c.bytes == E * rows * 4]
    assert len(weights) + len(hidden) + len(ids) == len(r.select(kind="all-to-all")), r.table()
    assert sum(c.executions for c in weights) == 6 * L, r.table()
    assert sum(c.executions for c in hidden) == 4 * L and sum(c.executions for c in ids) == L, r.table()
    shapes = model.param_shapes(m)
    dense = sum(x.size * 4 for x in jax.tree.leaves(shapes)) - sum(
        shapes["blocks"]["mlp"][key].size * 4 for key in ("w_gate", "w_up", "w_down"))
    reduced = r.traffic(kind=("all-reduce", "reduce-scatter"), spans="data")
    assert dense <= reduced <= dense + 64, r.table()


def test_replica_groups_pair_each_rank_with_every_expert():
    groups = moe_lib.replica_groups(4, 8)
    assert groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert all([q // 2 for q in g] == [0, 1, 2, 3] for g in groups)  # member e runs expert e (own_expert)


def test_experts_and_data_must_divide_one_another():
    cfg = moe_run(1, 1, 1, n_experts=6)
    with pytest.raises(ConfigError, match="n_experts = 6 and mesh.data = 4 must divide one another"):
        check_sizes(cfg, (4, 1, 2))
    check_sizes(cfg.replace(parallel={"expert_parallel": False}), (4, 1, 2))
    check_sizes(moe_run(1, 1, 1), (8, 1, 1))  # 4 experts, each on 2 of 8 data ranks
    with pytest.raises(ConfigError, match="d_model = 36 is not divisible by mesh.data = 8"):
        check_sizes(moe_run(1, 1, 1, d_model=36, n_heads=4), (8, 1, 1))


def test_replicated_experts_route_the_sequence_shard_without_model_collectives():
    """`expert_tensor_parallel: false` under sequence parallelism: the routed experts run on each
    model rank's own sequence shard, so the MLP's all-gather and reduce-scatter of activations
    over `model` (one each way per layer, forward and backward) are gone; only attention's remain,
    and per layer one all-gather of the shards' expert counts (the load-balancing loss's loads are
    the whole sequence's) in the backward pass."""
    base = moe_run(1, 1, 2)
    m, B = base.model, base.train.global_batch
    activation = B * m.seq_len * m.d_model * 4

    def model_collectives(etp):
        cfg = moe_run(1, 1, 2, expert_tensor_parallel=etp).replace(parallel={"microbatches": 1})
        mesh = make_mesh(cfg, jax.devices()[:2])
        program = build(cfg, mesh)
        r = analyze(program.step.lower(program.abstract_state(), program.abstract_batch()).compile(), mesh)
        return r.select(kind=("all-gather", "reduce-scatter"), axes="model", in_loop=True)

    split, whole = model_collectives(True), model_collectives(False)
    # Activations: all-gathered whole, reduce-scattered to a half (t = 2).
    big = lambda cs: sum(c.executions for c in cs if c.bytes in (activation, activation // 2))  # noqa: E731
    assert big(split) == 8 * m.n_layers and big(whole) == 4 * m.n_layers, (big(split), big(whole))
    counts = [c for c in whole if c.bytes not in (activation, activation // 2)]
    assert sum(c.executions for c in counts) == m.n_layers and all(c.bytes == 2 * B * m.n_experts * 4 for c in counts)


def test_replicated_experts_need_sequence_parallelism():
    cfg = moe_run(1, 1, 2, expert_tensor_parallel=False).replace(parallel={"sequence_parallel": False})
    with pytest.raises(ConfigError, match="set parallel.sequence_parallel=true"):
        check_sizes(cfg, (1, 1, 2))


@pytest.mark.parametrize("sizes", [[2, 0, 5], [100, 0, 150, 40], [128, 128], [0, 0, 0]])
def test_blocked_grouped_matmul_is_ragged_dot(sizes):
    """CPU's grouped matmul (blocks of rows, each group padded to whole blocks) computes
    `jax.lax.ragged_dot`'s function and gradients, rows past the groups included (0), for empty
    groups, groups of exactly one block, and a block size below the row count."""
    M, E = max(sum(sizes) + 7, 10), len(sizes)
    x = jax.random.normal(jax.random.key(0), (M, 8))
    w = jax.random.normal(jax.random.key(1), (E, 8, 5))
    s = jnp.array(sizes, jnp.int32)
    want = jax.lax.ragged_dot(x, w, s)
    np.testing.assert_allclose(moe_lib._blocked(x, w, s), want, atol=1e-5)
    grads = [jax.grad(lambda x, w, f=f: jnp.sum(jnp.sin(f(x, w, s))), (0, 1))(x, w)
             for f in (jax.lax.ragged_dot, moe_lib._blocked)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, atol=1e-5)  # float32 sums of 8 to 150 products, in another order


def test_the_parity_cases_cover_every_factorization():
    meshes = {mesh for mesh, *_ in PARITY + PARITY_SLOW}
    assert meshes == {(d, p, 8 // (d * p)) for d in (1, 2, 4, 8) for p in (1, 2, 4, 8) if 8 % (d * p) == 0}


# ---------------------------------------------------------------------------------------------
# Dense and MoE layers in one model (`model.moe_layers`): two stacks, run in the pattern's order.


@pytest.mark.parametrize("pattern,n_layers", [("every:2", 6), ("first_dense:2", 5), ("first_dense:1,every:3", 7)])
def test_mixed_model_runs_its_layers_in_the_pattern_order(pattern, n_layers):
    """The scanned model equals its layers run one at a time in layer order, each as a one-layer
    model of its kind (dense: d_ff wide; MoE) with its stack's parameters; so does the KV-cache
    decode path. A layer run out of order, or from the wrong stack, changes the logits."""
    from jaxpar.model.decode import extend, init_cache
    from jaxpar.model.transformer import layer_order

    cfg = layer_cfg(n_layers=n_layers, moe_layers=pattern)
    kinds = ["moe" if cfg.is_moe_layer(i) else "dense" for i in range(n_layers)]
    assert "dense" in kinds and "moe" in kinds

    def compiled(fn, *args):  # one compile each, LLVM optimizations off as in the parity runs
        return jax.jit(fn).lower(*args).compile(COMPILER_OPTIONS)(*args)

    key = jax.random.key(0)
    params = compiled(lambda key: model.init_params(cfg, key), key)
    blocks = params["blocks"]
    assert blocks["dense"]["mlp"]["w_up"].shape == (kinds.count("dense"), cfg.d_model, cfg.d_ff)
    assert blocks["moe"]["mlp"]["w_up"].shape == (kinds.count("moe"), cfg.n_experts, cfg.d_model, cfg.expert_width)
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len), 0, cfg.vocab_size)
    order = layer_order(cfg)
    one = dataclasses.replace(cfg, n_layers=1, moe_layers="all")

    def forwards(params, tokens):
        full = model.bind(cfg, params)
        x = full.embed_tokens(tokens)
        for i, kind in enumerate(kinds):
            j = list(order[kind]).index(i)
            layer = jax.tree.map(lambda a: a[j:j + 1], params["blocks"][kind])
            x = model.bind(one if kind == "moe" else model.dense_config(one), {"blocks": layer}).backbone(x)
        cache = init_cache(cfg, 2, cfg.seq_len)
        prefix, cache = extend(cfg, params, tokens[:, :8], cache, jnp.int32(0))
        step, _ = extend(cfg, params, tokens[:, 8:9], cache, jnp.int32(8))
        return full(tokens), full.head(x), prefix, step

    logits, one_by_one, prefix, step = compiled(forwards, params, tokens)
    # float32: the same operations, scanned or one by one (measured differences up to 6e-8 run
    # eagerly, 0 compiled together; the decode path's up to 5e-8). A layer out of order: 6e-3 and more.
    np.testing.assert_allclose(logits, one_by_one, atol=1e-6)
    np.testing.assert_allclose(prefix, logits[:, :8], atol=1e-6)
    np.testing.assert_allclose(step[:, 0], logits[:, 8], atol=1e-6)


def test_mixed_models_count_each_kind_of_layer():
    mixed = layer_cfg(n_layers=4, moe_layers="every:2")
    dense = layer_cfg(n_layers=4, n_experts=0)
    all_moe = layer_cfg(n_layers=4)
    # Half the layers of each: the mixed model's blocks are half the dense model's and half the MoE one's.
    assert 2 * model.count_params(mixed) == model.count_params(dense) + model.count_params(all_moe)
    assert 2 * model.count_params(mixed, active=True) == (model.count_params(dense)
                                                          + model.count_params(all_moe, active=True))


def test_pipelined_mixed_models_need_whole_groups_in_every_chunk():
    for pattern, layers, counts in (("every:2", 2, None), ("first_dense:1,every:2", 5, (2, 3))):
        cfg = moe_run(1, 2, 1, moe_layers=pattern).replace(model={"n_layers": layers},
                                                           parallel={"stage_layers": counts})
        with pytest.raises(ConfigError, match=rf"moe_layers = {pattern} cannot be pipelined with layers \[0, "
                                              r"\d\) in one chunk: after the dense first layers a chunk must hold "
                                              "whole groups of 2 layers"):
            check_sizes(cfg, (1, 2, 1))
    # Dense first layers then whole groups in each chunk: accepted.
    check_sizes(moe_run(1, 2, 1, moe_layers="first_dense:2").replace(model={"n_layers": 4}), (1, 2, 1))


def test_stage_layout_of_dense_first_layers():
    """8 layers, 3 dense first, on 2 stages of 2 chunks (chunk c = k·p + s on stage s): chunk 0
    holds dense 0-1, chunk 1 dense 2 and MoE 0, chunks 2-3 MoE 1-4. Every chunk has 2 dense and
    2 MoE slots; inactive ones repeat an active layer and are never scattered back."""
    from jaxpar.parallel.stages import chunk_model, stage_layout
    m = layer_cfg(n_layers=8, moe_layers="first_dense:3")
    lay = stage_layout(m, p=2, v=2)
    assert lay.width == {"dense": 2, "moe": 2} and lay.gather
    np.testing.assert_array_equal(lay.active["dense"][:, :, :], [[[1, 1], [0, 0]], [[1, 0], [0, 0]]])
    np.testing.assert_array_equal(lay.active["moe"][:, :, :], [[[0, 0], [1, 1]], [[1, 0], [1, 1]]])
    np.testing.assert_array_equal(lay.slots["moe"], [0, 0, 1, 2, 0, 0, 3, 4])
    np.testing.assert_array_equal(lay.layer_slot["dense"], [0, 1, 4])
    np.testing.assert_array_equal(lay.layer_slot["moe"], [4, 2, 3, 6, 7])
    np.testing.assert_array_equal(lay.layers_per_chunk(), [[2, 2], [2, 2]])
    assert chunk_model(m, lay).moe_layers == "first_dense:2" and chunk_model(m, lay).n_layers == 4


@pytest.mark.parametrize("n_experts,expert_parallel,says", [
    (8, True, "experts: 1 of 8 per data rank"), (4, True, "experts: each on 2 data ranks, a 1/8 slice"),
    (4, False, "experts: all on every data rank")])
def test_the_cli_summary_says_where_the_experts_live(n_experts, expert_parallel, says):
    from jaxpar.train.__main__ import summary
    cfg = moe_run(8, 1, 1, n_experts=n_experts, moe_layers="every:2", expert_parallel=expert_parallel)
    text = summary(cfg, make_mesh(cfg, jax.devices()[:8]))
    assert says in text and "MoE in 2 of 4 layers (every:2)" in text, text


def test_replicated_experts_checkpoint_resumes_onto_split_experts(tmp_path):
    """A checkpoint written with each expert on 2 of 8 data ranks (every rank storing a slice of
    every expert) is canonical: resumed on (4, 1, 2), one expert per data rank split over
    `model`, the next steps' losses are the straight run's (to the float32 reduction order)."""
    import shutil

    import jaxpar
    from jaxpar.train.checkpoint import saved_steps

    run = tmp_path / "straight"
    cfg = moe_run(8, 1, 1, zero=1).replace(
        parallel={"microbatches": 1},
        train={"steps": 4, "checkpoint_every": 2, "log_every": 1, "run_dir": str(run)})
    want = {r["step"]: r["loss"] for r in jaxpar.train(cfg)}
    shutil.copytree(run, tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "4")
    assert saved_steps(tmp_path / "r") == [2]
    moved = moe_run(4, 1, 2, zero=1).replace(parallel={"microbatches": 1},
                                            train={"steps": 4, "log_every": 1, "run_dir": str(tmp_path / "r")})
    history = jaxpar.train(moved)
    assert history.resumed_from == 2
    got = {r["step"]: r["loss"] for r in history}
    assert sorted(got) == [3, 4]
    np.testing.assert_allclose([got[3], got[4]], [want[3], want[4]], rtol=0, atol=2e-5)
