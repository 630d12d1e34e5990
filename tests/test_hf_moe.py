"""Hugging Face import / export of the mixture-of-experts families, against transformers itself.

Tiny MixtralForCausalLM and Qwen3MoeForCausalLM (2 layers, d_model 32, 4 experts, top-2, expert
width 16; Qwen3-MoE without top-k renormalisation, its default, and head_dim 16 != 32 / 4) are
written with save_pretrained from random weights (every weight and norm scale drawn, so a
misplaced expert, a gate swapped with an up projection or a transposed router cannot hide).
Each is also rewritten with its experts fused (transformers 5's in-memory layout, which it loads
too). PyTorch and transformers are test-only dependencies.
"""

import dataclasses
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3MoeForCausalLM"):
    pytest.skip("transformers without Qwen3-MoE (added in 4.51)", allow_module_level=True)

from helpers import (copy_folder as _copy, folder_tensors as _tensors, record_reads,  # noqa: E402
                     write_hf_config as _write_config)
from jaxpar import hf, model  # noqa: E402
from jaxpar.config import Config  # noqa: E402

VOCAB, SEQ, E, F = 100, 16, 4, 16
ARCHS = ("mixtral", "qwen3_moe")
EXPERT_LEAVES = ("w_gate", "w_up", "w_down")


def _hf_model(arch: str):
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if arch == "mixtral":
        m = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw, num_local_experts=E, intermediate_size=F))
    else:
        m = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **kw, num_experts=E, moe_intermediate_size=F, intermediate_size=48, head_dim=16, norm_topk_prob=False))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # weights ~ N(0, 0.05²) (routers too: distinct top-k), norm scales ~ 1 + N(0, 0.1²)
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return m.eval()


def _torch_model(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _fuse(src: str, dst: str) -> str:
    """The folder `src` with each layer's experts fused as transformers 5 holds them:
    mlp.experts.gate_up_proj [E, 2F, D] (gate rows, then up rows), mlp.experts.down_proj [E, D, F]."""
    from safetensors.numpy import save_file

    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "model.safetensors"))
    per_expert, out = {}, {}
    for name, x in _tensors(src).items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight", name)
        if m:
            per_expert[(int(m[1]), m[3], int(m[2]))] = x
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = x
    for i in range(2):
        stack = {w: np.stack([per_expert[(i, w, e)] for e in range(E)]) for w in {k[1] for k in per_expert}}
        gate, up, down = (stack["w1"], stack["w3"], stack["w2"]) if "w1" in stack else \
            (stack["gate_proj"], stack["up_proj"], stack["down_proj"])
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = down
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(arch, layout) -> folder; layout "experts" as save_pretrained writes it, "fused"."""
    root = tmp_path_factory.mktemp("hf_moe")
    out = {}
    for arch in ARCHS:
        out[arch, "experts"] = str(root / arch)
        _hf_model(arch).save_pretrained(out[arch, "experts"])
        out[arch, "fused"] = _fuse(out[arch, "experts"], str(root / f"{arch}-fused"))
    return out


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(3).integers(0, VOCAB, (2, SEQ))


@pytest.fixture(scope="module")
def reference(folders, ids):
    """arch -> transformers' float32 logits of its save_pretrained folder."""
    out = {}
    for arch in ARCHS:
        with torch.no_grad():
            out[arch] = _torch_model(folders[arch, "experts"])(torch.tensor(ids)).logits.numpy()
    return out


def _one_device(cfg) -> dict:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: one, model.param_shapes(cfg))


@pytest.fixture(scope="module")
def loaded(folders):
    """(arch, layout) -> (ModelConfig, params on one device)."""
    out = {}
    for key, folder in folders.items():
        cfg = hf.config_from_hf(folder, seq_len=SEQ)
        out[key] = cfg, hf.load_params(folder, cfg, _one_device(cfg))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_config_from_hf(arch, loaded):
    cfg, params = loaded[arch, "experts"]
    assert (cfg.n_experts, cfg.experts_per_token, cfg.expert_width, cfg.n_shared_experts) == (E, 2, F, 0)
    assert cfg.router == "softmax" and cfg.router_z_loss == 0.0 and cfg.router_aux_loss == 0.001
    assert cfg.router_norm_topk == (arch == "mixtral") and cfg.qk_norm == (arch == "qwen3_moe")
    assert cfg.head_size == (8 if arch == "mixtral" else 16)
    mlp = params["blocks"]["mlp"]
    assert {k: v.shape for k, v in mlp.items()} == {
        "router": (2, 32, E), "w_gate": (2, E, 32, F), "w_up": (2, E, 32, F), "w_down": (2, E, F, 32),
        "router_stats": (2, E + 3)}
    assert not np.asarray(mlp["router_stats"]).any(), "the routers' report is a zeros buffer, not a weight"


@pytest.mark.parametrize("layout", ["experts", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(arch, layout, folders, loaded, reference, ids):
    """jaxpar's logits from the imported folder (either expert layout) are transformers'."""
    cfg, params = loaded[arch, layout]
    logits = np.asarray(jax.jit(lambda p, t: model.apply(cfg, p, t))(params, ids))
    # float32 sums of 32-64 products in another order than PyTorch's (~1e-7 observed): rounding
    # only, while one misrouted token or swapped weight moves logits by ~1e-2.
    diff = float(np.abs(logits[..., :VOCAB] - reference[arch]).max())
    assert diff < 1e-5, f"logits differ from transformers by {diff}"
    assert not logits[..., VOCAB:].any(), "padded vocabulary rows must be zero"
    if layout == "fused":  # the same weights whatever the layout, bit for bit
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded[arch, "experts"][1]), strict=True):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reads_the_fused_layout(arch, folders, reference, ids):
    """The fused folder of the tests is a layout transformers itself loads, to the same logits
    (so the layout jaxpar reads is transformers', not one made up for the test)."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 holds experts one module per expert and does not read the fused layout")
    with torch.no_grad():
        fused = _torch_model(folders[arch, "fused"])(torch.tensor(ids)).logits.numpy()
    assert np.array_equal(fused, reference[arch])


@pytest.mark.parametrize("layout", ["experts", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip(arch, layout, folders, loaded, reference, ids, tmp_path):
    """Export writes the save_pretrained tensors bit for bit (one per expert, router_stats left
    out), a config.json of the same family that transformers loads to the same logits, and the
    export reads back to the same parameters."""
    cfg, params = loaded[arch, layout]
    out = tmp_path / "out"
    hf.save_params(params, cfg, str(out))
    original, exported = _tensors(folders[arch, "experts"]), _tensors(out)
    assert set(exported) == set(original)
    for name, x in exported.items():
        assert np.array_equal(x, original[name]), f"{name} changed in the round trip"
    with open(out / "config.json") as f:
        c = json.load(f)
    assert c["model_type"] == arch and c["num_experts_per_tok"] == 2
    with torch.no_grad():
        back = _torch_model(str(out))(torch.tensor(ids)).logits.numpy()
    assert np.array_equal(back, reference[arch]), "transformers must compute the same logits from the export"
    again = hf.load_params(str(out), cfg, _one_device(cfg))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        assert np.array_equal(a, b)




@pytest.mark.parametrize("layout", ["experts", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_each_device_reads_only_its_experts(arch, layout, folders, loaded, monkeypatch):
    """Experts split over 2 devices: each device's callback reads its 2 experts of each layer and
    nothing of the other 2 (per-expert files: only its experts' tensors, each once; fused: only
    its rows of the expert dim). Experts x expert width split over 2 x 2 devices: each device reads
    no more elements than it holds. The arrays equal the single-device import."""
    folder = folders[arch, layout]
    cfg, want = loaded[arch, layout]
    devices = np.asarray(jax.devices()[:4])
    experts = {"w_gate": P(None, "x"), "w_up": P(None, "x"), "w_down": P(None, "x")}
    experts_and_width = {"w_gate": P(None, "x", None, "y"), "w_up": P(None, "x", None, "y"), "w_down": P(None, "x", "y")}
    for mesh, spec in ((Mesh(devices[:2], ("x",)), experts), (Mesh(devices.reshape(2, 2), ("x", "y")), experts_and_width)):
        shardings = jax.tree_util.tree_map_with_path(
            lambda path, _: NamedSharding(mesh, spec.get(path[-1].key, P())), model.param_shapes(cfg))
        reads = record_reads(monkeypatch)
        params = hf.load_params(folder, cfg, shardings)
        monkeypatch.undo()
        for got, ref, s in zip(jax.tree.leaves(params), jax.tree.leaves(want), jax.tree.leaves(shardings), strict=True):
            assert got.sharding == s and np.array_equal(got, ref)
        expert_reads = [r for r in reads if ".experts." in r[0]]
        assert sum(size for _, _, size in expert_reads) == 3 * 2 * E * 32 * F, \
            "each expert weight must be read once in all (by the one device that holds it), and nothing more"
        if len(mesh.devices.shape) == 1:  # experts only split: each device's read names its own experts
            for name, sl, _ in expert_reads:
                if layout == "fused":
                    assert sl[0] in ((0, 2), (2, 4)), (name, sl)
                else:
                    assert all(a == 0 and b == n for (a, b), n in zip(sl, (F, 32) if "down" not in name and
                                                                    ".w2." not in name else (32, F))), (name, sl)
            names = [n for n, _, _ in expert_reads]
            assert len(names) == len(set(names)) or layout == "fused", "each expert tensor is read once"
        # Per device: what read_leaf asks for one device's index is exactly that index's elements.
        for leaf in EXPERT_LEAVES:
            e = next(x for x in hf.entries(cfg, fused=layout == "fused") if x.path[-1] == leaf)
            shape = want["blocks"]["mlp"][leaf].shape
            tensors = _tensors(folder)
            for idx in shardings["blocks"]["mlp"][leaf].devices_indices_map(shape).values():
                got_reads = []
                out = hf.read_leaf(cfg, e, lambda n, sl: got_reads.append(n) or tensors[n][sl], idx, shape)
                assert np.array_equal(out, np.asarray(want["blocks"]["mlp"][leaf])[idx])
                if layout == "experts":
                    held = set(range(*hf._normalize(idx, shape)[1].indices(E)[:2]))
                    assert {int(re.search(r"experts\.(\d+)\.", n)[1]) for n in got_reads} == held


@pytest.mark.parametrize("key, value, pattern", [("decoder_sparse_step", 2, "every:2"),
                                                ("mlp_only_layers", [0], "first_dense:1")])
def test_qwen3_moe_with_dense_layers(key, value, pattern, ids, tmp_path):
    """Qwen3-MoE's dense layers (every decoder_sparse_step-th layer MoE, or mlp_only_layers) are
    `model.moe_layers`: imported to transformers' logits, exported bit for bit to a folder
    transformers loads to the same logits, and read back to the same parameters."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
              num_experts=E, moe_intermediate_size=F, intermediate_size=48, head_dim=16, norm_topk_prob=False)
    m = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw, **{key: value}))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
        folder = str(tmp_path / "in")
        m.eval().save_pretrained(folder)
        want = m(torch.tensor(ids)).logits.numpy()
    cfg = hf.config_from_hf(folder, seq_len=SEQ)
    assert cfg.moe_layers == pattern and cfg.d_ff == 48 and cfg.mixed
    params = hf.load_params(folder, cfg, _one_device(cfg))
    n_moe = cfg.n_moe_layers
    assert params["blocks"]["dense"]["mlp"]["w_up"].shape == (4 - n_moe, 32, 48)
    assert params["blocks"]["moe"]["mlp"]["w_up"].shape == (n_moe, E, 32, F)
    logits = np.asarray(jax.jit(lambda p, t: model.apply(cfg, p, t))(params, ids))
    diff = float(np.abs(logits[..., :VOCAB] - want).max())
    assert diff < 1e-5, f"logits differ from transformers by {diff}"  # float32 rounding, as above
    out = tmp_path / "out"
    hf.save_params(params, cfg, str(out))
    original, exported = _tensors(folder), _tensors(out)
    assert set(exported) == set(original)
    for name, x in exported.items():
        assert np.array_equal(x, original[name]), f"{name} changed in the round trip"
    with torch.no_grad():
        back = _torch_model(str(out))(torch.tensor(ids)).logits.numpy()
    assert np.array_equal(back, want), "transformers must compute the same logits from the export"
    again = hf.load_params(str(out), cfg, _one_device(cfg))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        assert np.array_equal(a, b)


def test_dense_layers_no_pattern_can_say_are_refused(folders, tmp_path):
    """MoE layers that are not K dense layers then every N-th (here layer 0 MoE, layer 1 dense) are
    refused in one sentence naming the keys, their values, the rule and a fix."""
    folder = _copy(folders["qwen3_moe", "experts"], tmp_path / "q")
    _write_config(folder, mlp_only_layers=[1])
    with pytest.raises(hf.HFError, match=r"sets decoder_sparse_step = 1 with mlp_only_layers = \[1\], but jaxpar's "
                                         r"model.moe_layers .*; use a checkpoint whose MoE layers follow such a "
                                         r"pattern\.$"):
        hf.config_from_hf(folder)


def test_mixtral_sliding_window_shorter_than_the_sequence_is_refused(folders, tmp_path):
    folder = _copy(folders["mixtral", "experts"], tmp_path / "m")
    _write_config(folder, sliding_window=8)
    assert hf.config_from_hf(folder).seq_len == 8
    with pytest.raises(hf.HFError, match=r"sets sliding_window = 8, but .* choose seq_len <= 8\.$"):
        hf.config_from_hf(folder, seq_len=SEQ)


def test_load_refuses_another_moe(folders):
    """A training config whose experts differ from the folder's is refused by key."""
    folder = folders["qwen3_moe", "experts"]
    cfg = Config(model=hf.config_from_hf(folder, seq_len=SEQ))
    for change, message in (({"n_experts": 8}, r"model.n_experts = 8 \(folder: 4\)"),
                            ({"experts_per_token": 1}, r"model.experts_per_token = 1 \(folder: 2\)"),
                            ({"expert_d_ff": 32}, r"model.expert_d_ff = 32 \(folder: 16\)"),
                            ({"router_norm_topk": True}, r"model.router_norm_topk = True \(folder: False\)"),
                            ({"n_experts": 0}, r"model.n_experts = 0 \(folder: 4\)")):
        with pytest.raises(hf.HFError, match=message):
            hf.load_params(folder, cfg.replace(model=change), None)
    # d_ff is unused when every MLP is MoE: another value loads the same function.
    assert hf.check_matches(cfg.replace(model={"d_ff": 64}).model, folder).n_experts == E


@pytest.mark.parametrize("change, message", [
    ({"n_shared_experts": 1}, r"model.n_shared_experts = 1 has no Hugging Face MoE family .*n_shared_experts=0\.$"),
    ({"router": "sigmoid_bias"}, r"model.router = sigmoid_bias has no Hugging Face MoE family .*router=softmax\.$"),
    ({"router_norm_topk": False, "qk_norm": False}, r"model.router_norm_topk = false without model.qk_norm .*Mixtral "
                                                    r"always renormalises"),
])
def test_export_refuses_what_no_family_has(change, message, loaded, tmp_path):
    cfg = dataclasses.replace(loaded["mixtral", "experts"][0], **change)
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), model.param_shapes(cfg))
    with pytest.raises(hf.HFError, match=message):
        hf.save_params(params, cfg, str(tmp_path / "out"))
    assert not os.listdir(tmp_path), "nothing may be written"




@pytest.mark.parametrize("layout", ["experts", "fused"])
def test_each_device_reads_its_slice_of_every_expert(layout, folders, loaded, monkeypatch):
    """More data ranks than experts (`jaxpar.model.moe.own_expert`): each device stores a slice of
    every expert's d_model dim, and reads that slice only: every expert element is read once in
    all, and the arrays equal the single-device import."""
    arch = ARCHS[0]
    folder = folders[arch, layout]
    cfg, want = loaded[arch, layout]
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("x",))
    embed = {"w_gate": P(None, None, "x"), "w_up": P(None, None, "x"), "w_down": P(None, None, None, "x")}
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, embed.get(path[-1].key, P())), model.param_shapes(cfg))
    reads = record_reads(monkeypatch)
    params = hf.load_params(folder, cfg, shardings)
    monkeypatch.undo()
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        assert np.array_equal(got, ref)
    assert sum(size for name, _, size in reads if ".experts." in name) == 3 * 2 * E * 32 * F
