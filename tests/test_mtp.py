"""Multi-token prediction (`model.mtp_depth`, `jaxpar.model.mtp`): the objective against a direct
computation of DeepSeek-V3's formula (with document masking), the logged losses, parity with one
device on every kind of mesh (a DeepSeek-V3-shaped model: latent attention, grouped sigmoid
routing, dense first layer, shared expert, MTP), and bad settings refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import LOSS_RTOL, assert_parity, run_reference, run_steps
from jaxpar import model
from jaxpar.config import ConfigError, from_dict, validate
from jaxpar.model.mtp import pad
from jaxpar.train.step import loss_fn, main_loss

MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
V3 = dict(n_experts=8, experts_per_token=2, expert_d_ff=16, n_shared_experts=1, moe_layers="first_dense:1",
          router="sigmoid_bias", router_groups=4, router_topk_groups=2, router_scaling=2.5, router_aux_loss=0.0)


def _cfg(d=1, p=1, t=1, *, depth=2, model_extra=None, **parallel):
    return from_dict({
        "model": {"n_layers": 4, "d_model": 32, "n_heads": 4, "d_ff": 64, "vocab_size": 64, "seq_len": 16,
                  "mtp_depth": depth, "mtp_loss_weight": 0.3, **(model_extra or {})},
        "mesh": {"data": d, "stage": p, "model": t},
        "parallel": {"microbatches": 1 if p == 1 else 2, "sequence_parallel": t > 1, "zero_min_elements": 0,
                     **parallel},
        "train": {"steps": 3, "global_batch": 16, "lr": 1e-2, "warmup_steps": 1},
    })


def _rms(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale


def _direct(cfg, params, rows, eos=None):
    """DeepSeek-V3's objective written out: h^0 the model's final-normed output; depth k's input at
    position i the embedding of token i + k and h^{k-1}_i, its target token i + k + 1; each depth's
    cross-entropy summed over its valid targets and divided by the batch's B·T, as the main loss."""
    m = cfg.model
    B, T, D, E = rows.shape[0], m.seq_len, m.mtp_depth, params["embed"]
    mod = model.bind(m, params)
    tokens = np.asarray(rows)
    segment = np.cumsum(np.concatenate([np.zeros((B, 1), int), tokens[:, :-1] == eos], 1), 1) if eos is not None \
        else np.zeros_like(tokens)

    def ce(h, targets, valid):
        logits = (h @ params["lm_head"]).astype(jnp.float32)[..., :m.vocab_size]
        lp = jax.nn.log_softmax(logits, -1)
        picked = jnp.take_along_axis(lp, jnp.asarray(np.maximum(targets, 0))[..., None], -1)[..., 0]
        return -jnp.sum(jnp.where(valid, picked, 0.0)) / (B * T)

    from jaxpar.model.layers import document_segments, packed, sequence_layout
    layout = None if eos is None else packed(document_segments(jnp.asarray(tokens[:, :T]), eos))
    with sequence_layout(layout):
        h = _rms(mod.backbone(E[tokens[:, :T]]), params["final_norm"]["scale"], m.norm_eps)
        losses = [ce(h, tokens[:, 1:T + 1], np.ones((B, T), bool))]
        mp = params["mtp"]
        for k in range(1, D + 1):
            ahead = np.concatenate([tokens, np.zeros((B, D), int)], 1)[:, k:k + T]
            x = jnp.concatenate([_rms(E[ahead], mp["enorm"][k - 1], m.norm_eps),
                                 _rms(h, mp["hnorm"][k - 1], m.norm_eps)], -1) @ mp["eh_proj"][k - 1]
            block = jax.tree.map(lambda a: a[k - 1], mp["blocks"])
            from flax import nnx
            graphdef, state = nnx.split(mod.mtp.blocks)
            state = jax.tree.map(lambda a: a[k - 1], state)
            nnx.replace_by_pure_dict(state, block)
            h = _rms(nnx.merge(graphdef, state)(x), mp["norm"][k - 1], m.norm_eps)
            pos = np.arange(T)
            valid = (pos + k + 1 <= T)[None].repeat(B, 0)
            if eos is not None:
                later = np.minimum(pos + k, T)
                valid &= segment[:, pos] == segment[:, later]
            targets = np.concatenate([tokens, np.zeros((B, D), int)], 1)[:, k + 1:k + 1 + T]
            losses.append(ce(h, targets, valid))
    losses = jnp.stack(losses)
    return losses[0] + m.mtp_loss_weight / D * jnp.sum(losses[1:]), losses


@pytest.mark.parametrize("eos", [None, 3])
def test_the_objective_is_deepseek_v3s(eos):
    """The objective and each depth's reported loss equal the formula written out, on one device;
    with document masking no depth predicts across a document's end."""
    cfg = _cfg(depth=2)
    params = model.init_params(cfg.model, jax.random.key(0))
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(1), a.shape, a.dtype)
                          if a.ndim == 1 and a.dtype == jnp.float32 else a, params)  # norms not all ones
    params["mtp"]["report"] = jnp.zeros_like(params["mtp"]["report"])
    rows = jax.random.randint(jax.random.key(2), (4, 17), 0, 64)
    if eos is not None:
        rows = rows.at[:, 5].set(eos).at[1, 11].set(eos)
    want, want_losses = jax.jit(lambda p: _direct(cfg, p, rows, eos))(params)
    got, g = jax.jit(jax.value_and_grad(lambda p: loss_fn(cfg, p, pad(rows, 2), eos=eos)))(params)
    # float32: the same sums in another order (the direct path's log_softmax and slicing).
    np.testing.assert_allclose(float(got), float(want), rtol=LOSS_RTOL)
    np.testing.assert_allclose(np.asarray(g["mtp"]["report"]), np.asarray(want_losses), rtol=LOSS_RTOL)
    assert float(main_loss(cfg, got, g)) == pytest.approx(float(want_losses[0]), rel=LOSS_RTOL)
    # Every part of the modules is trained (a zero gradient would mean a part left out).
    for path, leaf in jax.tree_util.tree_leaves_with_path(g["mtp"]):
        if jax.tree_util.keystr(path) not in ("['report']", "['blocks']['mlp']['router_stats']"):
            assert float(jnp.max(jnp.abs(leaf))) > 0, jax.tree_util.keystr(path)


_REF = {}


@pytest.mark.parametrize("mesh,parallel", [
    ((8, 1, 1), {"zero": 1}),
    ((4, 1, 2), {"zero": 3}),
    ((2, 2, 2), {"schedule": "1f1b"}),
    pytest.param((2, 1, 4), {}, marks=pytest.mark.slow),
    pytest.param((1, 4, 2), {"schedule": "zb_h1", "zero": 2}, marks=pytest.mark.slow),
    pytest.param((4, 1, 1), {"context": 2, "context_attention": "ring"}, marks=pytest.mark.slow),
])
def test_mtp_matches_single_device(mesh, parallel):
    """Main and MTP losses each step, gradients leaf by leaf and final parameters equal one
    device's (MTP on the pipeline's last stage)."""
    if "dense" not in _REF:
        _REF["dense"] = run_reference(_cfg())
    out = run_steps(_cfg(*mesh, **parallel))
    assert out["mtp"].shape == (3, 3)  # mtp_loss and mtp_loss_1, mtp_loss_2 at every step
    assert_parity(out, _REF["dense"])


@pytest.mark.parametrize("mesh,parallel", [
    ((8, 1, 1), {"zero": 1}),  # experts split over data (expert parallelism), the MTP block's too
    pytest.param((4, 1, 2), {"zero": 3}, marks=pytest.mark.slow),
    pytest.param((2, 2, 2), {"schedule": "1f1b"}, marks=pytest.mark.slow),
])
def test_a_deepseek_v3_shaped_model_matches_single_device(mesh, parallel):
    """Latent attention, grouped sigmoid routing with its bias update, a dense first layer, a shared
    expert and one MTP module (an MoE block), as DeepSeek-V3 in small."""
    extra = {**MLA, **V3}
    if "v3" not in _REF:
        _REF["v3"] = run_reference(_cfg(depth=1, model_extra=extra))
    assert_parity(run_steps(_cfg(*mesh, depth=1, model_extra=extra, **parallel)), _REF["v3"])


@pytest.mark.parametrize("changes,parallel,match", [
    ({"mtp_depth": -1}, {}, r"model.mtp_depth = -1 must not be negative"),
    ({"mtp_depth": 16}, {}, r"model.mtp_depth = 16 leaves no target in a sequence of model.seq_len = 16"),
    ({"mtp_loss_weight": -0.1}, {}, r"model.mtp_loss_weight = -0.1 must not be negative"),
    ({"arch": "gpt2"}, {}, r"model.mtp_depth = 2 \(multi-token prediction\) needs the llama architecture"),
    ({}, {"data_mode": "naive"}, r"model.mtp_depth = 2 cannot be combined with parallel.data_mode = naive"),
])
def test_bad_mtp_is_refused_before_compiling(changes, parallel, match):
    cfg = _cfg(8, **parallel)
    with pytest.raises(ConfigError, match=match):
        validate(cfg.replace(model=changes))


def test_model_flops_count_the_mtp_modules():
    """MFU's numerator with D modules: their parameters (three norms, the projection [2d, d], one
    block each; not the report leaf), their blocks' attention as D more layers', and the output
    head D more times, written out."""
    from jaxpar.model.flops import model_flops_per_token
    from jaxpar.model.transformer import count_params

    base, two = _cfg(depth=0), _cfg(depth=2)
    d, F, S, V = 32, 64, 16, 64
    module = 3 * d + 2 * d * d + (4 * d * d + 3 * d * F + 2 * d)
    active = lambda c: count_params(c.model, embeddings=False, active=True)  # noqa: E731
    assert active(two) - active(base) == 2 * module
    assert model_flops_per_token(two) - model_flops_per_token(base) == 6 * 2 * module + 6 * 2 * (d + d) * S \
        + 6 * 2 * d * V


def test_a_batch_log_line_shows_the_mtp_loss():
    """The logged line carries the MTP loss beside the main one (and each depth's with several)."""
    from jaxpar.train.progress import line

    rec = {"step": 3, "loss": 4.1, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0, "model_tflops_per_device": 0.1,
           "step_time_s": 1.0, "device_wait_s": 0.9, "skipped_steps": 0, "mtp_loss": 4.5}
    assert " mtp 4.5000" in line(rec, 10, 1.0)
    two = {**rec, "mtp_loss_1": 4.4, "mtp_loss_2": 4.6}
    assert " mtp 4.5000 (4.4000 4.6000)" in line(two, 10, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,parallel", [((8, 1, 1), {}), ((4, 1, 2), {"zero": 3})])
def test_the_planner_counts_the_mtp_activations(mesh, parallel):
    """The planner traces the step's objective (`mtp.objective`), so the D depths' activations and
    logits are in its memory: within tests/test_plan.py's MEMORY_RTOL of the compiled step's
    (measured +9% and +12% at two depths; without them it fell 15% and 30% short)."""
    from test_plan import MEMORY_RTOL

    from jaxpar.inspect import analyze
    from jaxpar.mesh import make_mesh
    from jaxpar.plan.memory import memory
    from jaxpar.train.step import lower_step

    cfg = from_dict({
        "model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "d_ff": 512, "vocab_size": 256, "seq_len": 128,
                  "mtp_depth": 2},
        "mesh": dict(zip(("data", "stage", "model"), mesh)),
        "parallel": {"sequence_parallel": mesh[2] > 1, **parallel}, "train": {"global_batch": 16}})
    devices = make_mesh(cfg, jax.devices()[:8])
    report = analyze(lower_step(cfg, devices)[0], devices)
    measured = report.memory.argument_bytes + report.memory.temp_bytes
    assert abs(memory(cfg, mesh, platform="cpu")["total"] - measured) <= MEMORY_RTOL * measured
