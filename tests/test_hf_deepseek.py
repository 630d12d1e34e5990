"""Hugging Face import / export of the DeepSeek-V3 family (`deepseek_v3`, and `kimi_k2` read the
same way), against transformers' DeepseekV3ForCausalLM itself.

Two tiny random models, saved with save_pretrained, both with `rope_interleave: true` (DeepSeek's
and Kimi's layout, transformers' default), 3 layers of which the first is dense, 8 experts:
- "v3", DeepSeek-V3-shaped: q_lora_rank 24, kv_lora_rank 16, head widths 12 (no RoPE), 8 (RoPE)
  and 10 (values: three different widths, so that a mixed-up width cannot hide); 4 groups of 2
  experts of which 2 per token, top-2, routed_scaling_factor 2.5, one shared expert, YaRN with
  factor 40 on 4096 original positions and mscale = mscale_all_dim = 1 (DeepSeek-V3's: the softmax
  scale grows by (0.1 ln 40 + 1)^2 = 1.87).
- "kimi", Kimi-K2-shaped: one group (n_group = topk_group = 1), top-3, routed_scaling_factor 2.827,
  rope_theta 5e4, YaRN factor 32 with beta_fast = beta_slow = 1, and q_lora_rank null (a direct
  query projection, DeepSeek-V2-Lite's; Kimi K2 itself has 1536) to cover both query paths. Also
  read under model_type kimi_k2 ("kimi_k2").

Every weight is drawn (N(0, 0.05²)), every norm scale is 1 + N(0, 0.1²) and every routing bias
(e_score_correction_bias) N(0, 0.1²), so a swapped projection, a missing permutation, a dropped
bias or scale fails. PyTorch and transformers are test-only dependencies.
"""

import dataclasses
import json
import logging
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("transformers without DeepSeek-V3 (added in 4.51)", allow_module_level=True)

from helpers import (copy_folder as _copy, folder_tensors as _tensors, record_reads,  # noqa: E402
                     write_hf_config as _write_config)
from jaxpar import hf, model  # noqa: E402
from jaxpar.config import Config, ModelConfig  # noqa: E402
from jaxpar.generate import generate  # noqa: E402
from jaxpar.mesh import make_mesh  # noqa: E402
from jaxpar.train.step import build  # noqa: E402

VOCAB, SEQ, BATCH = 100, 16, 4
KINDS = ("v3", "kimi")
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
              kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1,
              rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True)
SHAPES = {
    "v3": dict(q_lora_rank=24, n_group=4, topk_group=2, num_experts_per_tok=2, routed_scaling_factor=2.5,
               max_position_embeddings=163840,
               rope={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}),
    "kimi": dict(q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=3, routed_scaling_factor=2.827,
                 max_position_embeddings=131072,
                 rope={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                       "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0, "rope_theta": 50000.0}),
}


def _hf_model(kind: str, **changes):
    kw = {**COMMON, **SHAPES[kind], **changes}
    rope = kw.pop("rope")
    c = transformers.DeepseekV3Config(**kw, rope_parameters=rope)
    m = transformers.DeepseekV3ForCausalLM(c)
    g = torch.Generator().manual_seed(11 if kind == "v3" else 12)
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return m.eval()


def _torch_model(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _one_device(cfg) -> dict:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: one, model.param_shapes(getattr(cfg, "model", cfg)))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """kind -> a save_pretrained folder; "kimi_k2": the kimi folder under model_type kimi_k2."""
    root = tmp_path_factory.mktemp("hf_deepseek")
    out = {}
    for kind in KINDS:
        out[kind] = str(root / kind)
        _hf_model(kind).save_pretrained(out[kind])
    out["kimi_k2"] = _copy(out["kimi"], root / "kimi_k2")
    _write_config(out["kimi_k2"], model_type="kimi_k2")
    return out


@pytest.fixture(scope="module")
def batch():
    return np.random.default_rng(7).integers(0, VOCAB, (BATCH, SEQ + 1))


@pytest.fixture(scope="module")
def reference(folders, batch):
    """kind -> transformers' float32 logits on batch[:, :-1]."""
    out = {}
    for kind in KINDS:
        with torch.no_grad():
            out[kind] = _torch_model(folders[kind])(torch.tensor(batch[:, :-1])).logits.numpy()
    return out


@pytest.fixture(scope="module")
def loaded(folders):
    """kind -> (ModelConfig, params on one device)."""
    out = {}
    for kind, folder in folders.items():
        cfg = hf.config_from_hf(folder, seq_len=SEQ)
        out[kind] = cfg, hf.load_params(folder, cfg, _one_device(cfg))
    return out


_apply = jax.jit(model.apply, static_argnums=0)  # compiled once per model section (kimi_k2's is kimi's)


def _logits(cfg, params, ids) -> np.ndarray:
    return np.asarray(_apply(cfg, params, ids))


# --------------------------------------------------------------------------------------------
# Import


@pytest.mark.parametrize("kind", ["v3", "kimi", "kimi_k2"])
def test_config_from_hf(kind, loaded):
    cfg, params = loaded[kind]
    shape = SHAPES["v3" if kind == "v3" else "kimi"]
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == \
        ("llama", 3, 32, 4, None, None)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (16, shape["q_lora_rank"], 12, 8, 10)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.expert_d_ff, cfg.d_ff, cfg.n_shared_experts) == \
        (8, shape["num_experts_per_tok"], 16, 48, 1)
    assert (cfg.router, cfg.router_groups, cfg.router_topk_groups, cfg.router_scaling, cfg.router_norm_topk) == \
        ("sigmoid_bias", shape["n_group"], shape["topk_group"], shape["routed_scaling_factor"], True)
    assert cfg.moe_layers == "first_dense:1" and cfg.router_aux_loss == 0.0 and cfg.router_z_loss == 0.0
    rope = shape["rope"]
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_context, cfg.rope_theta) == \
        ("yarn", rope["factor"], 4096, rope["rope_theta"])
    assert (cfg.rope_beta_fast, cfg.rope_beta_slow) == (rope["beta_fast"], rope["beta_slow"])
    assert cfg.rope_attention_factor == 1.0 and cfg.rope_mscale_all_dim == 1.0  # mscale / mscale_all_dim
    assert cfg.norm_eps == 1e-6 and not cfg.tied and cfg.vocab_size == VOCAB
    mlp = params["blocks"]["moe"]["mlp"]
    assert mlp["router_bias"].dtype == np.float32 and np.asarray(mlp["router_bias"]).std() > 0.01
    assert not np.asarray(mlp["router_stats"]).any(), "the routers' report is a zeros buffer, not a weight"


@pytest.mark.parametrize("kind", ["v3", "kimi", "kimi_k2"])
def test_logits_match_transformers(kind, loaded, reference, batch):
    """jaxpar's logits from the imported folder are transformers' (interleaved RoPE columns
    permuted into jaxpar's half rotation; YaRN's mscale_all_dim on the softmax scale)."""
    cfg, params = loaded[kind]
    logits = _logits(cfg, params, batch[:, :-1])
    # float32 sums of 8-48 products in another order than PyTorch's (~4e-7 observed): rounding
    # only, while a missing permutation, scale or bias moves logits by ~1e-2 or more.
    diff = float(np.abs(logits[..., :VOCAB] - reference["kimi" if kind == "kimi_k2" else kind]).max())
    assert diff < 1e-5, f"logits differ from transformers by {diff}"
    assert not logits[..., VOCAB:].any(), "padded vocabulary rows must be zero"


@pytest.mark.parametrize("kind", ["v3", pytest.param("kimi", marks=pytest.mark.slow)])
def test_loss_and_gradients_match_transformers(kind, folders, batch):
    """Loaded straight onto the training shardings of data 2 (experts split over it) x model 2,
    the training program gives transformers' loss and every parameter's gradient (PyTorch's
    autograd on the same batch; transformers 5 holds the experts fused, which `from_tensors`
    reads too)."""
    folder = folders[kind]
    cfg = Config(model=hf.config_from_hf(folder, seq_len=SEQ)).replace(
        mesh={"data": 2, "stage": 1, "model": 2}, train={"global_batch": BATCH})
    program = build(cfg, make_mesh(cfg, jax.devices()[:4]))
    params = hf.load_params(folder, cfg, program.state_shardings.params)
    loss, grads = program.loss_and_grads(params, jax.device_put(batch, program.batch_sharding))

    m = _torch_model(folder)
    ids = torch.tensor(batch)
    ref = torch.nn.functional.cross_entropy(m(ids[:, :-1]).logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    ref.backward()
    # float32 rounding of the loss and of backward sums over 64 tokens: relative, as test_hf.py.
    ref = float(ref.detach())
    assert abs(float(loss) - ref) <= 1e-4 * ref, (float(loss), ref)
    torch_grads = {n: p.grad.numpy().copy() for n, p in m.named_parameters()}
    for n, b in m.named_buffers():  # the routing bias is no parameter: no gradient on either side
        if n.endswith("e_score_correction_bias"):
            torch_grads[n] = np.zeros(b.shape, np.float32)
    assert any(".experts.gate_up_proj" in n for n in torch_grads), "transformers 5 holds the experts fused"
    want, got = hf.from_tensors(cfg.model, torch_grads), jax.device_get(grads)
    checked = 0
    for path, g in jax.tree_util.tree_leaves_with_path(want):
        name = jax.tree_util.keystr(path)
        if "router_bias" in name or "router_stats" in name:
            continue
        x = hf._leaf(got, tuple(k.key for k in path))
        rel = float(np.linalg.norm(np.asarray(x) - g) / np.linalg.norm(g))
        assert rel < 1e-4, f"gradient of {name} differs from transformers' by {rel:.2e}"
        checked += 1
    # every weight of the two stacks (dense, MoE), embedding, final norm, head (kimi: wq in each stack
    # for wq_a, q_norm and wq_b)
    assert checked == (31 if kind == "v3" else 27)


def test_rope_interleave_false_is_read_without_permutation(folders, tmp_path, batch):
    """A folder with rope_interleave false (transformers' rotate-half) is read as is, and its export
    writes the interleaved layout with rope_interleave true: transformers computes the same logits
    from both."""
    folder = _copy(folders["v3"], tmp_path / "halves")
    _write_config(folder, rope_interleave=False)
    with torch.no_grad():
        want = _torch_model(folder)(torch.tensor(batch[:, :-1])).logits.numpy()
    cfg = hf.config_from_hf(folder, seq_len=SEQ)
    params = hf.load_params(folder, cfg, _one_device(cfg))
    diff = float(np.abs(_logits(cfg, params, batch[:, :-1])[..., :VOCAB] - want).max())
    assert diff < 1e-5, f"logits differ from transformers by {diff}"  # float32 rounding, as above
    out = tmp_path / "out"
    hf.save_params(params, cfg, str(out))
    with open(out / "config.json") as f:
        assert json.load(f)["rope_interleave"] is True
    q = "model.layers.0.self_attn.q_b_proj.weight"
    assert not np.array_equal(_tensors(out)[q], _tensors(folder)[q]), "the export interleaves the rotary rows"
    with torch.no_grad():
        back = _torch_model(str(out))(torch.tensor(batch[:, :-1])).logits.numpy()
    assert float(np.abs(back - want).max()) < 1e-5


def test_deepseeks_own_config_keys(folders, loaded, reference, batch, tmp_path):
    """The config.json DeepSeek-V3 publishes (transformers 4.x style: `rope_scaling` with `type`, a
    top-level `rope_theta`, and the keys of DeepSeek's own modeling code: scoring_func, topk_method,
    aux_loss_alpha, seq_aux, moe_layer_freq, ep_size) reads as the same model section, and
    transformers computes the same logits from it."""
    folder = _copy(folders["v3"], tmp_path / "own")
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        c = json.load(f)
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in rope.items()}
    c.update(scoring_func="sigmoid", topk_method="noaux_tc", aux_loss_alpha=0.001, seq_aux=True, moe_layer_freq=1,
             ep_size=1, num_nextn_predict_layers=1, pretraining_tp=1)
    with open(path, "w") as f:
        json.dump(c, f)
    assert hf.config_from_hf(folder, seq_len=SEQ) == loaded["v3"][0]
    with torch.no_grad():
        assert np.array_equal(_torch_model(folder)(torch.tensor(batch[:, :-1])).logits.numpy(), reference["v3"])


def test_rope_permutation_is_transformers_interleave():
    """HF's column ROPE_ORDER[j] is jaxpar's column j: rotating the permuted columns by halves is
    transformers' apply_rotary_pos_emb_interleave, to the bit."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (apply_rotary_pos_emb,
                                                                      apply_rotary_pos_emb_interleave)

    from jaxpar.hf.deepseek import rope_order

    dr, g = 8, torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, dr, generator=g), torch.randn(2, 1, 5, dr, generator=g)
    freqs = torch.arange(5.0)[:, None] * torch.rand(dr // 2, generator=g)
    emb = torch.cat([freqs, freqs], -1)[None]
    order = torch.tensor(rope_order(dr))
    assert order.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    a = apply_rotary_pos_emb_interleave(q, k, emb.cos(), emb.sin())
    b = apply_rotary_pos_emb(q[..., order], k[..., order], emb.cos(), emb.sin())
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------
# Export


@pytest.mark.parametrize("kind", ["v3", "kimi_k2"])
def test_round_trip(kind, folders, loaded, reference, batch, tmp_path):
    """Export writes the save_pretrained tensors bit for bit (rotary rows interleaved back, the
    float32 routing bias, router_stats left out) and a deepseek_v3 config.json (kimi_k2 too) that
    transformers loads to identical logits; it reads back as the same model section and weights."""
    cfg, params = loaded[kind]
    out = tmp_path / "out"
    hf.save_params(params, cfg, str(out))
    original, exported = _tensors(folders[kind]), _tensors(out)
    assert set(exported) == set(original)
    for name, x in exported.items():
        assert x.dtype == original[name].dtype and np.array_equal(x, original[name]), f"{name} changed"
    with open(out / "config.json") as f:
        c = json.load(f)
    assert (c["model_type"], c["architectures"], c["rope_interleave"]) == \
        ("deepseek_v3", ["DeepseekV3ForCausalLM"], True)
    assert c["rope_scaling"]["mscale_all_dim"] == 1.0 and c["num_nextn_predict_layers"] == 0
    with torch.no_grad():
        back = _torch_model(str(out))(torch.tensor(batch[:, :-1])).logits.numpy()
    assert np.array_equal(back, reference["kimi" if kind == "kimi_k2" else kind]), \
        "transformers must compute the same logits from the export"
    assert hf.config_from_hf(str(out), seq_len=SEQ) == cfg
    again = hf.load_params(str(out), cfg, _one_device(cfg))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        assert np.array_equal(a, b)


def test_export_of_a_new_model_loads_in_transformers(tmp_path):
    """A jaxpar MLA model initialised at random (no folder), all layers MoE and one all dense,
    exports as deepseek_v3 folders in which transformers computes jaxpar's logits."""
    base = dict(n_layers=2, d_model=32, n_heads=4, d_ff=48, vocab_size=VOCAB, seq_len=SEQ, norm_eps=1e-6,
                tie_embeddings=False,
                kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    moe = dict(n_experts=4, experts_per_token=2, expert_d_ff=16, n_shared_experts=2, router="sigmoid_bias",
               router_groups=2, router_topk_groups=1, router_scaling=1.5)
    ids = np.random.default_rng(2).integers(0, VOCAB, (2, SEQ))
    for name, fields in (("moe", {**base, **moe}), ("dense", base)):
        cfg = ModelConfig(**fields)
        rng = np.random.default_rng(3)  # random weights, norm scales near 1 (no init to compile)
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: (("norm" in jax.tree_util.keystr(p) or "scale" in jax.tree_util.keystr(p))
                          + rng.normal(0, 0.05 if "router_stats" not in jax.tree_util.keystr(p) else 0, x.shape)
                          ).astype(x.dtype), model.param_shapes(cfg))
        out = tmp_path / name
        hf.save_params(params, cfg, str(out))
        with torch.no_grad():
            want = _torch_model(str(out))(torch.tensor(ids)).logits.numpy()
        diff = float(np.abs(_logits(cfg, params, ids)[..., :VOCAB] - want).max())
        assert diff < 1e-5, f"{name}: logits differ from transformers by {diff}"  # float32 rounding
        assert hf.config_from_hf(str(out), seq_len=SEQ) == dataclasses.replace(
            cfg, router_aux_loss=0.0 if cfg.moe else cfg.router_aux_loss)


# --------------------------------------------------------------------------------------------
# Each device reads its slices only


def test_each_device_reads_only_its_slices(folders, loaded, monkeypatch):
    """On data 2 (experts split over it) x model 2 (heads split), and under ZeRO-3 on data 4 x
    model 2: every array equals the single-device import; `load_params` reads every tensor's
    elements exactly once in all (each device its own slice, replicas once); and each device's
    slice of every leaf is read from the checkpoint alone, no more elements than it holds."""
    folder = folders["v3"]
    mcfg, want = loaded["v3"]
    tensors = _tensors(folder)
    for sizes, parallel in (((2, 1, 2), {}), ((4, 1, 2), {"zero": 3, "zero_min_elements": 0})):
        cfg = Config(model=mcfg).replace(mesh=dict(zip(("data", "stage", "model"), sizes)), parallel=parallel,
                                         train={"global_batch": 4})
        shardings = build(cfg, make_mesh(cfg, jax.devices()[:int(np.prod(sizes))])).state_shardings.params
        reads = record_reads(monkeypatch)
        params = hf.load_params(folder, cfg, shardings)
        monkeypatch.undo()
        for got, ref, s in zip(jax.tree.leaves(params), jax.tree.leaves(want), jax.tree.leaves(shardings), strict=True):
            assert got.sharding == s and np.array_equal(got, ref)
        total: dict[str, int] = {}
        for name, _, size in reads:
            total[name] = total.get(name, 0) + size
        assert total == {n: x.size for n, x in tensors.items()}, "every element read once in all, nothing more"
        split = set()
        for e in hf.entries(mcfg):
            leaf = hf._leaf(want, e.path)
            for idx in {tuple((x.start, x.stop) for x in hf._normalize(i, leaf.shape))
                        for i in hf._leaf(shardings, e.path).devices_indices_map(leaf.shape).values()}:
                idx = tuple(slice(*x) for x in idx)
                read = []
                out = hf.read_leaf(mcfg, e, lambda n, sl: read.append(tensors[n][sl].size) or tensors[n][sl], idx,
                                   leaf.shape)
                assert np.array_equal(out, np.asarray(leaf)[idx]), e.path
                assert sum(read) <= out.size, f"{e.path}: read {sum(read)} elements for a slice of {out.size}"
                if out.size < leaf.size:
                    split.add(e.path[-1])
        assert {"w_gate", "w_up", "w_down", "wq_b", "wkv_b", "wo"} <= split, split
        if parallel:  # ZeRO-3 also splits the latent projections
            assert {"wkv_a", "wq_a"} <= split, split


@pytest.mark.parametrize("leaf", ["wq_b", "wkv_a"])
def test_rotary_rows_are_read_in_pieces(leaf, folders, loaded):
    """Any block of a leaf with permuted rotary rows (a slice of the head width or of the latent
    columns that cuts through the rotary part, as a sharding over those dims would ask) reads
    exactly its own elements, in a few contiguous spans, and equals the whole import's block."""
    folder = folders["v3"]
    mcfg, want = loaded["v3"]
    tensors = _tensors(folder)
    e = next(x for x in hf.entries(mcfg) if x.path[-1] == leaf and x.layers == (0,))
    full = np.asarray(hf._leaf(want, ("blocks", "dense", "attn", leaf)))
    blocks = ([(slice(0, 1), slice(3, 20), slice(1, 3), slice(10, 17)), (slice(0, 1), slice(0, 24), slice(0, 4),
              slice(12, 20))] if leaf == "wq_b" else
              [(slice(0, 1), slice(5, 30), slice(14, 21)), (slice(0, 1), slice(0, 32), slice(16, 24))])
    for idx in blocks:
        reads = []
        out = hf.read_leaf(mcfg, e, lambda n, sl: reads.append(tensors[n][sl].size) or tensors[n][sl], idx,
                           full.shape)
        assert np.array_equal(out, full[idx]), idx
        assert sum(reads) == out.size, f"read {sum(reads)} elements for a block of {out.size}"


# --------------------------------------------------------------------------------------------
# Generation, multi-token-prediction layers, CLIs


def test_greedy_generation_equals_transformers(folders, loaded):
    """jaxpar's latent KV-cache greedy decoding gives transformers' greedy tokens (its own
    `generate`, not stopping at an end-of-sequence id), on the DeepSeek-V3-shaped model (the
    decoding path is the same code for the Kimi-shaped one)."""
    kind = "v3"
    cfg, params = loaded[kind]
    prompt = [5, 17, 42, 8, 99, 3]
    m = _torch_model(folders[kind])
    m.generation_config.eos_token_id = None
    with torch.no_grad():
        want = m.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert generate(cfg, params, prompt, 8) == want[0, len(prompt):].tolist()


def test_multi_token_prediction_layers_are_skipped(folders, loaded, tmp_path, caplog):
    """DeepSeek-V3's checkpoints hold their multi-token-prediction module as one more layer
    (`model.layers.61.*`): the import skips such layers with one warning and reads the rest."""
    from safetensors.numpy import save_file

    folder = _copy(folders["v3"], tmp_path / "mtp")
    tensors = _tensors(folder)
    extra = {n.replace("model.layers.2.", "model.layers.3."): x for n, x in tensors.items() if ".layers.2." in n}
    extra["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file({**tensors, **extra}, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    _write_config(folder, num_nextn_predict_layers=1)
    cfg, want = loaded["v3"]
    with caplog.at_level(logging.WARNING, logger="jaxpar"):
        params = hf.load_params(folder, cfg, _one_device(cfg))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        assert np.array_equal(a, b)
    notes = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
    assert len(notes) == 1 and f"{len(extra)} tensors of layers 3 " in notes[0], notes


def test_convert_cli(folders, tmp_path):
    """`convert --from-hf --to RUN`, then `--run-dir --to-hf`: the folder's tensors bit for bit,
    the same bytes as `--from-hf --to-hf`."""
    from jaxpar import convert

    run = tmp_path / "run"
    assert convert.main(["--from-hf", folders["kimi_k2"], "--to", str(run), "--seq-len", str(SEQ)]) == 0
    assert convert.main(["--run-dir", str(run), "--to-hf", str(tmp_path / "a")]) == 0
    assert convert.main(["--from-hf", folders["kimi_k2"], "--to-hf", str(tmp_path / "b"), ]) == 0
    a, b = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    original = _tensors(folders["kimi_k2"])
    assert set(a) == set(b) == set(original)
    assert all(np.array_equal(a[n], original[n]) and np.array_equal(b[n], original[n]) for n in original)


@pytest.mark.slow
def test_finetune_with_init_from(folders, tmp_path):
    """`model.init_from` a deepseek_v3 folder on data 4 (experts over it) x model 2: the run
    loads, trains 3 steps, and `convert --run-dir --to-hf` exports a folder in which transformers
    computes the trained model's logits (not the folder's)."""
    import jaxpar
    from jaxpar import convert
    from jaxpar.train.checkpoint import restore_params

    folder, run = folders["v3"], tmp_path / "run"
    mcfg = hf.config_from_hf(folder, seq_len=SEQ)
    cfg = jaxpar.load_config(None, [
        *(f"model.{k}={v}" for k, v in dataclasses.asdict(mcfg).items() if v is not None),
        f"model.init_from={folder}", "mesh.data=4", "mesh.stage=1", "mesh.model=2", "train.steps=3",
        "train.global_batch=4", "train.lr=1e-2", "train.warmup_steps=1", "train.log_every=1",
        "train.checkpoint_every=3", f"train.run_dir={run}"])
    jaxpar.train(cfg)
    out = tmp_path / "out"
    assert convert.main(["--run-dir", str(run), "--to-hf", str(out)]) == 0
    trained = restore_params(str(run), _one_device(cfg))[1]
    ids = np.random.default_rng(4).integers(0, VOCAB, (2, SEQ))
    ours = _logits(mcfg, trained, ids)[..., :VOCAB]
    with torch.no_grad():
        theirs = _torch_model(str(out))(torch.tensor(ids)).logits.numpy()
        start = _torch_model(folder)(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-4  # float32 rounding
    assert np.abs(theirs - start).max() > 1e-3, "the export should hold the trained weights"


# --------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("changes, message", [
    ({"scoring_func": "softmax"}, r"sets scoring_func = 'softmax', but jaxpar's sigmoid_bias router .*; use a "
                                  r"checkpoint with scoring_func sigmoid\.$"),
    ({"topk_method": "greedy"}, r"sets topk_method = 'greedy', but jaxpar routes as DeepSeek-V3's noaux_tc .*"),
    ({"moe_layer_freq": 2}, r"sets moe_layer_freq = 2, but jaxpar reads first_k_dense_replace dense layers "),
    ({"attention_bias": True}, r"sets attention_bias = true, but jaxpar's multi-head latent attention has no "
                               r"biases"),
    ({"num_key_value_heads": 2}, r"sets num_key_value_heads = 2 with num_attention_heads = 4, but .*; set "
                                 r"num_key_value_heads to 4\.$"),
    ({"v_head_dim": 24}, r"sets v_head_dim = 24, but jaxpar pads the value heads .* v_head_dim <= 20\.$"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}},
     r"sets quantization_config = .*fp8.*, but jaxpar reads unquantized weights .*fp8_cast_bf16\.py"),
    ({"n_shared_experts": 0}, r"sets n_shared_experts = 0, but .*n_shared_experts >= 1\.$"),
    ({"rope_interleave": "yes"}, r"sets rope_interleave = 'yes', but rope_interleave must be true or false\.$"),
    ({"hidden_act": "gelu"}, r"sets hidden_act = 'gelu', but jaxpar's llama MLP is SwiGLU with silu\.$"),
], ids=["scoring", "topk_method", "moe_layer_freq", "attention_bias", "kv_heads", "v_head_dim", "fp8",
        "no_shared", "interleave", "act"])
def test_refused_settings(changes, message, folders, tmp_path):
    """Each setting jaxpar computes otherwise is refused in one sentence naming the value, the rule
    and a fix."""
    folder = _copy(folders["v3"], tmp_path / "x")
    _write_config(folder, **changes)
    with pytest.raises(hf.HFError, match=message):
        hf.config_from_hf(folder)


@pytest.mark.parametrize("change, message", [
    ({"router": "softmax", "router_groups": 1, "router_topk_groups": 1}, r"model.router = softmax has no place in a "
     r"deepseek_v3 folder.*router=sigmoid_bias\.$"),
    ({"moe_layers": "first_dense:1,every:2", "n_layers": 5}, r"model.moe_layers = first_dense:1,every:2 has no "
     r"place .*moe_layers=all or first_dense:K\.$"),
    ({"n_shared_experts": 0}, r"model.n_shared_experts = 0 has no place .*n_shared_experts >= 1\.$"),
    ({"qk_norm": True}, r"model.qk_norm with model.kv_lora_rank has no place .*qk_norm=false\.$"),
])
def test_export_refuses_what_deepseek_v3_lacks(change, message, loaded, tmp_path):
    cfg = dataclasses.replace(loaded["v3"][0], **change)
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), model.param_shapes(
        dataclasses.replace(cfg, qk_norm=False)))
    with pytest.raises(hf.HFError, match=message):
        hf.save_params(params, cfg, str(tmp_path / "out"))
    assert not os.listdir(tmp_path), "nothing may be written"


def _with_mtp_layer(folder: str, dst, seed: int = 5) -> str:
    """A copy of `folder` with DeepSeek-V3's MTP module as layer 3 (num_hidden_layers): a decoder
    layer drawn like the others (the last layer's tensors, perturbed), enorm, hnorm, eh_proj,
    shared_head.norm and the copies of the embedding and the head; num_nextn_predict_layers 1."""
    from safetensors.numpy import save_file

    out = _copy(folder, dst)
    tensors = _tensors(out)
    rng = np.random.default_rng(seed)
    layer = {n.replace("model.layers.2.", "model.layers.3."): (x + 0.02 * rng.normal(size=x.shape)).astype(x.dtype)
             for n, x in tensors.items() if ".layers.2." in n}
    d = tensors["model.norm.weight"].shape[0]
    layer |= {f"model.layers.3.{k}.weight": (1 + 0.1 * rng.normal(size=d)).astype(np.float32)
              for k in ("enorm", "hnorm", "shared_head.norm")}
    layer["model.layers.3.eh_proj.weight"] = (0.05 * rng.normal(size=(d, 2 * d))).astype(np.float32)
    layer["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    layer["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file({**tensors, **layer}, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    _write_config(out, num_nextn_predict_layers=1)
    return out


def test_multi_token_prediction_module_is_deepseek_v3s(folders, loaded, batch, tmp_path):
    """A model with `mtp_depth: 1` reads DeepSeek-V3's MTP layer (layer num_hidden_layers), and its
    depth-1 loss equals DeepSeek-V3's MTP module written in PyTorch over transformers' layer class
    (vLLM's and Megatron-Core's reading of those tensors): the layer on eh_proj([enorm(embedding of
    the token 1 ahead); hnorm(the model's final-normed output)]), then shared_head.norm and the head.
    Export writes the same tensors back, bit for bit, with num_nextn_predict_layers 1; transformers
    still loads the folder (it builds no MTP module). Without `mtp_depth` the layer is skipped."""
    from jaxpar.model.mtp import pad
    from jaxpar.train.step import loss_fn
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    folder = _with_mtp_layer(folders["v3"], tmp_path / "mtp")
    cfg = dataclasses.replace(loaded["v3"][0], mtp_depth=1)
    params = hf.load_params(folder, cfg, _one_device(cfg))
    config = Config(model=cfg).replace(train={"global_batch": BATCH})
    _, g = jax.jit(jax.value_and_grad(lambda p: loss_fn(config, p, pad(jax.numpy.asarray(batch), 1))))(params)
    got = np.asarray(g["mtp"]["report"])  # [main, depth 1]

    m = _torch_model(folder)
    t = {n: torch.tensor(x) for n, x in _tensors(folder).items()}
    layer = DeepseekV3DecoderLayer(m.config, 3).eval()
    layer.load_state_dict({n[len("model.layers.3."):]: x for n, x in t.items()
                           if n.startswith("model.layers.3.") and n.split(".")[3] in ("self_attn", "mlp",
                           "input_layernorm", "post_attention_layernorm")}, strict=False)
    if hasattr(layer.mlp, "experts") and hasattr(layer.mlp.experts, "gate_up_proj"):  # transformers 5: fused
        E = m.config.n_routed_experts
        with torch.no_grad():
            layer.mlp.experts.gate_up_proj.copy_(torch.stack([torch.cat(
                [t[f"model.layers.3.mlp.experts.{e}.{w}_proj.weight"] for w in ("gate", "up")]) for e in range(E)]))
            layer.mlp.experts.down_proj.copy_(torch.stack([t[f"model.layers.3.mlp.experts.{e}.down_proj.weight"]
                                                           for e in range(E)]))
            layer.mlp.gate.e_score_correction_bias.copy_(t["model.layers.3.mlp.gate.e_score_correction_bias"])

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.config.rms_norm_eps)

    ids = torch.tensor(batch)
    T = SEQ - 1  # positions with a target 2 ahead
    with torch.no_grad():
        h0 = m.model(ids[:, :SEQ]).last_hidden_state  # the final-normed output
        e = m.model.embed_tokens(ids[:, 1:SEQ + 1])
        x = torch.cat([rms(e, t["model.layers.3.enorm.weight"]), rms(h0, t["model.layers.3.hnorm.weight"])], -1)
        x = x @ t["model.layers.3.eh_proj.weight"].T
        positions = torch.arange(SEQ)[None]
        cos_sin = m.model.rotary_emb(x, positions)
        mask = torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1)[None, None]
        x = layer(x, attention_mask=mask, position_embeddings=cos_sin, position_ids=positions)
        x = x[0] if isinstance(x, tuple) else x
        logits = m.lm_head(rms(x, t["model.layers.3.shared_head.norm.weight"]))
        want = torch.nn.functional.cross_entropy(logits[:, :T].reshape(-1, VOCAB), ids[:, 2:].reshape(-1),
                                                 reduction="sum") / (BATCH * SEQ)
    # float32 sums in another order (as the logits' tolerance); 1e-4 relative, as the loss above.
    assert abs(got[1] - float(want)) <= 1e-4 * float(want), (got, float(want))

    out = str(tmp_path / "out")
    hf.save_params(jax.device_get(params), cfg, out)
    assert json.load(open(os.path.join(out, "config.json")))["num_nextn_predict_layers"] == 1
    written, source = _tensors(out), _tensors(folder)
    assert set(written) == set(source)
    assert all(np.array_equal(written[n], source[n]) for n in source)
    _torch_model(out)  # loads, the MTP layer unused
    main = hf.load_params(folder, loaded["v3"][0], _one_device(loaded["v3"][0]))  # mtp_depth 0: skipped
    assert "mtp" not in main


def test_multi_token_prediction_needs_its_layers(folders, loaded, tmp_path, caplog):
    """A model with `mtp_depth` from a folder without MTP layers (transformers saves none) is
    refused in one sentence; a llama-family model's modules are not exported, with a warning."""
    cfg, params = loaded["v3"]
    mtp = dataclasses.replace(cfg, mtp_depth=1)
    with pytest.raises(hf.HFError, match=r"^model.mtp_depth = 1 reads multi-token prediction module 1 from layer 3 "
                                         r"of '.*', which has no tensor 'model.layers.3.enorm.weight' .*; set "
                                         r"model.mtp_depth=0 to load the main model, or start from a checkpoint "
                                         r"with its MTP layers\.$"):
        hf.load_params(folders["v3"], mtp, _one_device(mtp))
    llama = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, vocab_size=64, seq_len=16, mtp_depth=1)
    with caplog.at_level(logging.WARNING, logger="jaxpar"):
        hf.save_params(jax.device_get(model.init_params(llama, jax.random.key(0))), llama, str(tmp_path / "out"))
    assert any("multi-token-prediction module(s) are not exported" in r.getMessage() for r in caplog.records)
    assert not any(".layers.2." in n for n in _tensors(tmp_path / "out"))


def test_load_refuses_another_latent_attention(folders):
    """A training config whose latent attention or its softmax scale differs from the folder's is
    refused by key."""
    folder = folders["v3"]
    cfg = hf.config_from_hf(folder, seq_len=SEQ)
    for change, message in (({"kv_lora_rank": 32}, r"model.kv_lora_rank = 32 \(folder: 16\)"),
                            ({"q_lora_rank": None}, r"model.q_lora_rank = None \(folder: 24\)"),
                            ({"v_head_dim": 8}, r"model.v_head_dim = 8 \(folder: 10\)"),
                            ({"rope_mscale_all_dim": None}, r"model.rope_mscale_all_dim = None \(folder: 1.0\)"),
                            ({"router_groups": 2}, r"model.router_groups = 2 \(folder: 4\)")):
        with pytest.raises(hf.HFError, match=message):
            hf.check_matches(dataclasses.replace(cfg, **change), folder)
