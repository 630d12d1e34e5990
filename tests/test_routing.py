"""DeepSeek-V3's routing (`jaxpar.model.moe.route`): experts in groups, each token's top-k inside
its best groups, the routed scaling factor; against transformers' DeepseekV3TopkRouter, parity
with one device with expert parallelism, TP + SP and pipelines, and bad settings refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_parity, run_reference, run_steps
from jaxpar.config import ConfigError, ModelConfig, from_dict, validate
from jaxpar.model import moe as moe_lib

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # CPU thread-count warnings

# DeepSeek-V3's shape in small: 16 experts in 4 groups, each token in its 2 best groups, top 4,
# renormalised and scaled by 2.5 (V3: 256 experts, 8 groups, 4 of them, top 8, 2.5).
GROUPED = dict(n_experts=16, experts_per_token=4, router="sigmoid_bias", router_groups=4, router_topk_groups=2,
               router_scaling=2.5, router_norm_topk=True)


def _route(cfg: ModelConfig, logits, bias):
    gates, experts = moe_lib.route(cfg, jnp.asarray(logits)[None], jnp.asarray(bias))
    return np.asarray(gates[0]), np.asarray(experts[0])


def _by_expert(gates, experts):
    """Each token's (expert, weight) pairs in expert order: top-k's order is not part of routing."""
    order = np.argsort(experts, axis=-1)
    return np.take_along_axis(experts, order, -1), np.take_along_axis(gates, order, -1)


def test_grouped_routing_equals_transformers_deepseek_v3_router():
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, vocab_size=64, **GROUPED)
    hf = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(hf)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype(np.float32)
    w = rng.normal(size=(16, 32)).astype(np.float32) * 0.3
    bias = rng.normal(size=(16,)).astype(np.float32) * 0.1
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, want_gates, want_experts = router(torch.from_numpy(x))
    gates, experts = _route(cfg, x @ w.T, bias)
    got, want = _by_expert(gates, experts), _by_expert(want_gates.numpy(), want_experts.numpy())
    np.testing.assert_array_equal(got[0], want[0])
    # float32 sigmoids of the same logits (XLA's and torch's), renormalised: a few ulps.
    np.testing.assert_allclose(got[1], want[1], rtol=2e-6, atol=1e-7)


def test_each_token_routes_within_its_best_groups():
    """A token's k experts lie in its router_topk_groups best groups (scored by the sum of their two
    best choice scores), although its plain top-k would leave them for most tokens here; one group
    is plain top-k; the weights are the chosen experts' scores, renormalised and scaled."""
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, vocab_size=64, **GROUPED)
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(256, 16)).astype(np.float32)
    bias = np.zeros(16, np.float32)
    gates, experts = _route(cfg, logits, bias)
    choice = 1 / (1 + np.exp(-logits)) + bias
    group_scores = np.sort(choice.reshape(256, 4, 4), axis=-1)[..., -2:].sum(-1)
    best = np.argsort(-group_scores, axis=-1)[:, :2]
    assert all(set(experts[i] // 4) <= set(best[i]) for i in range(256))
    plain_gates, plain = _route(dataclasses.replace(cfg, router_groups=1, router_topk_groups=1), logits, bias)
    np.testing.assert_array_equal(_by_expert(plain_gates, plain)[0],
                                  np.sort(np.argsort(-choice, axis=-1)[:, :4], axis=-1))
    left = sum(not set(plain[i] // 4) <= set(best[i]) for i in range(256))
    assert left > 64, left  # the groups decide for many tokens
    picked = np.take_along_axis(choice, experts, -1)
    np.testing.assert_allclose(gates, 2.5 * picked / picked.sum(-1, keepdims=True), rtol=1e-6)


def _cfg(d, p, t, *, schedule="1f1b", zero=0, **model):
    return from_dict({
        "model": {"n_layers": 4, "d_model": 32, "n_heads": 4, "d_ff": 64, "vocab_size": 64, "seq_len": 16,
                  "expert_d_ff": 16, "router_aux_loss": 0.05, "router_z_loss": 0.01, **GROUPED, **model},
        "mesh": {"data": d, "stage": p, "model": t},
        "parallel": {"schedule": schedule, "microbatches": max(p, 2), "zero": zero, "zero_min_elements": 0,
                     "sequence_parallel": t > 1},
        "train": {"steps": 3, "global_batch": 16, "lr": 1e-2, "warmup_steps": 1},
    })


_REF = {}


@pytest.mark.parametrize("mesh,schedule,zero,model", [
    ((8, 1, 1), "1f1b", 1, {}),  # 2 of the 16 experts on each data rank
    ((2, 2, 2), "1f1b", 3, {"n_shared_experts": 1, "moe_layers": "first_dense:1"}),
    pytest.param((1, 4, 2), "zb_h1", 2, {"capacity_factor": 1.0}, marks=pytest.mark.slow),
    pytest.param((4, 1, 2), "1f1b", 0, {"router": "softmax"}, marks=pytest.mark.slow),
])
def test_grouped_routing_matches_single_device(mesh, schedule, zero, model):
    """Losses, gradients, the routers' report and the bias after each update equal one device's."""
    cfg = _cfg(*mesh, schedule=schedule, zero=zero, **model)
    key = repr(cfg.model)
    ref = _REF.get(key) or _REF.setdefault(key, run_reference(cfg))
    out = run_steps(cfg)
    assert_parity(out, ref)
    assert out["moe"].shape[1] >= 4


@pytest.mark.parametrize("model,match", [
    ({"router_groups": 3}, r"model.router_groups = 3 must divide model.n_experts = 16"),
    ({"router_groups": 16}, r"model.router_groups = 16 must divide model.n_experts = 16 into groups of at least 2"),
    ({"router_topk_groups": 5}, r"model.router_topk_groups = 5 must lie in 1 .. model.router_groups = 4"),
    ({"router_topk_groups": 1, "experts_per_token": 5}, r"model.experts_per_token = 5 exceeds the 4 experts"),
    ({"router_scaling": 0.0}, r"model.router_scaling = 0.0 must be positive"),
])
def test_bad_grouped_routing_is_refused_before_compiling(model, match):
    with pytest.raises(ConfigError, match=match):
        validate(_cfg(8, 1, 1, **model))


def test_grouped_routing_is_not_exported_as_mixtral_or_qwen3_moe():
    from jaxpar.hf import HFError
    from jaxpar.hf.moe import family

    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, vocab_size=64, **{**GROUPED, "router": "softmax"})
    with pytest.raises(HFError, match=r"model.router_groups = 4 has no Hugging Face MoE family"):
        family(cfg)
    with pytest.raises(HFError, match=r"model.router_scaling = 2.5 has no Hugging Face MoE family"):
        family(dataclasses.replace(cfg, router_groups=1, router_topk_groups=1))
