"""Hugging Face weights in and out: the map of every jaxpar parameter to its HF tensor
(`entries`), reading a folder's safetensors (`load_params`) and writing a folder (`save_params`).

Import places every parameter directly on its target sharding: `jax.make_array_from_callback`
asks, per local device, for the slice that device holds, and only that slice is read from the
safetensors files (`safe_open(...).get_slice`), so no process holds more of the model than its
devices do. Export writes the canonical parameters back as a folder that `transformers` loads.

Layouts: HF linear weights are [out, in] (llama `nn.Linear`) or [in, out] (GPT-2 `Conv1D`);
jaxpar's are [in, out] with heads split out (`wq` [D, N, H], `wo` [N, H, D]). The llama families
use the rotate-half RoPE convention, as jaxpar does, so no permutation of q/k rows is needed;
deepseek_v3's interleaved rotary rows are permuted (`jaxpar.hf.deepseek`). Padded vocabulary rows
(`model.vocab_multiple`) are zero on import and dropped on export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Callable

import jax
import ml_dtypes  # noqa: F401  (registers numpy's `bfloat16`, which safetensors' numpy reader needs)
import numpy as np

from jaxpar import model
from jaxpar.config import ModelConfig
from jaxpar.hf import deepseek, moe
from jaxpar.hf.common import Entry, HFError, publish
from jaxpar.hf.config import check_matches, hf_config, read_hf_config
from jaxpar.model import fp8
from jaxpar.model.transformer import dense_config, layer_order

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Larger exports are split into shards of at most this many bytes (as transformers does).
MAX_SHARD_BYTES = 5 * 2**30
log = logging.getLogger("jaxpar")


# --------------------------------------------------------------------------------------------
# Which HF tensor each jaxpar parameter comes from, and how

def entries(cfg: ModelConfig, prefix: str = "", *, fused: bool = False, interleave: bool = True) -> list[Entry]:
    """The mapping of every jaxpar parameter to its HF tensor (`prefix`: "transformer." for
    GPT-2 checkpoints saved from GPT2LMHeadModel, "" for ones saved from GPT2Model; `fused`: an
    MoE checkpoint whose experts are stored fused, see `jaxpar.hf.moe`; `interleave`: a
    deepseek_v3 checkpoint's rope_interleave, see `jaxpar.hf.deepseek`)."""
    if cfg.block != "pre_norm":
        raise HFError(f"model.block = {cfg.block!r} has no Hugging Face counterpart (transformers' llama and gpt2 "
                      "are pre_norm blocks); convert only models with model.block=pre_norm.")
    if cfg.mtp_depth:  # the main model's entries; an MLA model's MTP modules as DeepSeek-V3's layers after them
        main = dataclasses.replace(cfg, mtp_depth=0)
        if not cfg.mla:  # no Hugging Face family of the llama architecture stores them
            return entries(main, prefix, fused=fused, interleave=interleave)
        block = entries(dataclasses.replace(main, moe_layers="all"), prefix, fused=fused, interleave=interleave)
        return entries(main, prefix, fused=fused, interleave=interleave) + deepseek.mtp_entries(cfg, block)
    if cfg.mixed:  # dense and MoE layers (`model.moe_layers`): each stack's entries, at its layers
        order, out = layer_order(cfg), []
        kinds = (("dense", dense_config(cfg)), ("moe", dataclasses.replace(cfg, moe_layers="all")))
        for kind, kind_cfg in kinds:
            for e in entries(kind_cfg, prefix, fused=fused, interleave=interleave):
                if e.path[0] == "blocks":
                    out.append(e._replace(path=("blocks", kind, *e.path[1:]), layers=tuple(map(int, order[kind]))))
                elif kind == "moe":
                    out.append(e)
        return out
    D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff, cfg.vocab_size
    if cfg.mla:
        return deepseek.entries(cfg, fused, interleave)
    if cfg.arch == "llama":
        a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
        mlp = moe.entries(cfg, fused) if cfg.moe else [
            Entry(("blocks", "mlp", "w_gate"), m + "gate_proj.weight", "t", (F, D)),
            Entry(("blocks", "mlp", "w_up"), m + "up_proj.weight", "t", (F, D)),
            Entry(("blocks", "mlp", "w_down"), m + "down_proj.weight", "t", (D, F))]
        return [
            Entry(("embed",), "model.embed_tokens.weight", "same", (V, D)),
            Entry(("blocks", "attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight", "same", (D,)),
            Entry(("blocks", "attn", "wq"), a + "q_proj.weight", "heads_in", (N * H, D)),
            Entry(("blocks", "attn", "wk"), a + "k_proj.weight", "heads_in", (K * H, D)),
            Entry(("blocks", "attn", "wv"), a + "v_proj.weight", "heads_in", (K * H, D)),
            Entry(("blocks", "attn", "wo"), a + "o_proj.weight", "heads_out", (D, N * H)),
            *([Entry(("blocks", "attn", "b" + x), a + f"{x}_proj.bias", "c_bias_in", (n * H,))
               for x, n in (("q", N), ("k", K), ("v", K))] if cfg.qkv_bias else []),
            *([Entry(("blocks", "attn", x + "_norm"), a + f"{x}_norm.weight", "same", (H,)) for x in "qk"]
              if cfg.qk_norm else []),
            Entry(("blocks", "mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", "same", (D,)),
            *mlp,
            Entry(("final_norm", "scale"), "model.norm.weight", "same", (D,)),
        ] + ([] if cfg.tied else [Entry(("lm_head",), "lm_head.weight", "t", (V, D))])
    h = prefix + "h.{i}."
    return [
        Entry(("embed",), prefix + "wte.weight", "same", (V, D)),
        Entry(("pos_embed",), prefix + "wpe.weight", "same", (cfg.seq_len, D)),
        Entry(("blocks", "attn_norm", "scale"), h + "ln_1.weight", "same", (D,)),
        Entry(("blocks", "attn_norm", "bias"), h + "ln_1.bias", "same", (D,)),
        *[Entry(("blocks", "attn", "w" + x), h + "attn.c_attn.weight", "c_heads_in", (D, 3 * D), j * D)
          for j, x in enumerate("qkv")],
        *[Entry(("blocks", "attn", "b" + x), h + "attn.c_attn.bias", "c_bias_in", (3 * D,), j * D)
          for j, x in enumerate("qkv")],
        Entry(("blocks", "attn", "wo"), h + "attn.c_proj.weight", "c_heads_out", (D, D)),
        Entry(("blocks", "attn", "bo"), h + "attn.c_proj.bias", "same", (D,)),
        Entry(("blocks", "mlp_norm", "scale"), h + "ln_2.weight", "same", (D,)),
        Entry(("blocks", "mlp_norm", "bias"), h + "ln_2.bias", "same", (D,)),
        Entry(("blocks", "mlp", "w_up"), h + "mlp.c_fc.weight", "same", (D, F)),
        Entry(("blocks", "mlp", "b_up"), h + "mlp.c_fc.bias", "same", (F,)),
        Entry(("blocks", "mlp", "w_down"), h + "mlp.c_proj.weight", "same", (F, D)),
        Entry(("blocks", "mlp", "b_down"), h + "mlp.c_proj.bias", "same", (D,)),
        Entry(("final_norm", "scale"), prefix + "ln_f.weight", "same", (D,)),
        Entry(("final_norm", "bias"), prefix + "ln_f.bias", "same", (D,)),
    ]


# Tensors a checkpoint may hold that carry no parameter: GPT-2's causal-mask buffers, old
# llama checkpoints' RoPE frequencies, and the tied output projection of GPT-2 (equal to wte).
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _ignored(cfg: ModelConfig, name: str) -> bool:
    return (name.endswith(_IGNORED_SUFFIXES) or (cfg.tied and name == "lm_head.weight")
            or (cfg.mla and deepseek.is_copy(cfg, name)))


def _layer_names(cfg: ModelConfig, e: Entry) -> list[str]:
    """The entry's name in each layer (one name for a leaf outside `blocks`); "{e}" is kept."""
    layers = range(cfg.n_layers) if e.layers is None else e.layers
    return [e.hf.replace("{i}", str(i)) for i in layers] if "{i}" in e.hf else [e.hf]


def _hf_names(cfg: ModelConfig, e: Entry) -> list[str]:
    return [n for name in _layer_names(cfg, e) for n in moe.expert_names(cfg, name)]


Getter = Callable[[str, tuple[slice, ...]], np.ndarray]


def _rows(get: Getter, name: str, rows: slice, n: int, rest: tuple[slice, ...]) -> np.ndarray:
    """hf[rows, *rest] where rows may run past the tensor's n rows (padded vocabulary): zeros there."""
    stop = min(rows.stop, n)
    part = get(name, (slice(rows.start, stop), *rest)) if stop > rows.start else None
    if stop == rows.stop:
        return part
    widths = [s.stop - s.start for s in rest]
    pad = np.zeros((rows.stop - max(stop, rows.start), *widths), np.float32)
    return pad if part is None else np.concatenate([part.astype(np.float32), pad])


def _heads(get: Getter, name: str, where: tuple[slice | None, ...], offset: int, n: slice, h: slice, H: int
           ) -> np.ndarray:
    """The (head, head_dim) block n x h of a dim that stores heads as (N H) from `offset`, at the
    None of `where`: one contiguous read, or one per head when only part of head_dim is wanted."""
    if h.stop - h.start == H:
        spans = [slice(offset + n.start * H, offset + n.stop * H)]
    else:
        spans = [slice(offset + k * H + h.start, offset + k * H + h.stop) for k in range(n.start, n.stop)]
    axis = where.index(None)
    parts = [get(name, tuple(span if w is None else w for w in where)) for span in spans]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


def _read(cfg: ModelConfig, e: Entry, name: str, get: Getter, idx: tuple[slice, ...]) -> np.ndarray:
    """The slice `idx` of one layer's jaxpar leaf `e`, reading only the HF rows and columns it needs."""
    H = e.head or cfg.head_size
    if e.kind in moe.KINDS:
        return moe.read(e, name, get, idx)
    if e.kind in deepseek.KINDS:
        return deepseek.read(e, name, get, idx, cfg.qk_rope_head_dim)
    if e.kind == "same":  # rows may be padded (vocabulary) or fewer than the tensor's (positions)
        return _rows(get, name, idx[0], e.hf_shape[0], idx[1:])
    if e.kind == "t":     # jaxpar [in, out] from HF [out, in]; out may be padded (lm_head)
        return _rows(get, name, idx[1], e.hf_shape[0], (idx[0],)).T
    if e.kind == "c_bias_in":    # [N, H] from [(3 N H)]
        n, h = idx
        return _heads(get, name, (None,), e.offset, n, h, H).reshape(n.stop - n.start, h.stop - h.start)
    d, n, h = (idx[2], idx[0], idx[1]) if e.kind in ("heads_out", "c_heads_out") else idx
    nn, nh = n.stop - n.start, h.stop - h.start
    if e.kind == "heads_in":     # [D, N, H] from [(N H), D]
        return _heads(get, name, (None, d), e.offset, n, h, H).reshape(nn, nh, -1).transpose(2, 0, 1)
    if e.kind == "heads_out":    # [N, H, D] from [D, (N H)]
        return _heads(get, name, (d, None), e.offset, n, h, H).reshape(-1, nn, nh).transpose(1, 2, 0)
    if e.kind == "c_heads_in":   # [D, N, H] from Conv1D [D, (3 N H)]
        return _heads(get, name, (d, None), e.offset, n, h, H).reshape(-1, nn, nh)
    if e.kind == "c_heads_out":  # [N, H, D] from Conv1D [(N H), D]
        return _heads(get, name, (None, d), e.offset, n, h, H).reshape(nn, nh, -1)
    raise AssertionError(e.kind)


def _write(cfg: ModelConfig, e: Entry, x: np.ndarray) -> np.ndarray:
    """One layer's HF tensor (or, for a fused tensor, this leaf's columns) from the jaxpar leaf."""
    if e.kind in deepseek.KINDS:
        return deepseek.write(e, x, cfg.qk_rope_head_dim)
    if e.kind == "same":
        return x[:e.hf_shape[0]]
    if e.kind == "t":
        return x.T[:e.hf_shape[0]]
    if e.kind == "heads_in":
        return x.reshape(x.shape[0], -1).T
    if e.kind == "heads_out":
        return x.reshape(-1, x.shape[-1]).T
    if e.kind in ("c_heads_in", "c_bias_in"):
        return x.reshape(*x.shape[:-2], -1)
    if e.kind == "c_heads_out":
        return x.reshape(-1, x.shape[-1])
    raise AssertionError(e.kind)


def _normalize(idx: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(idx, shape))


def _leaf(params: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        params = params[k]
    return params


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def read_leaf(cfg: ModelConfig, e: Entry, get: Getter, idx: tuple, shape: tuple[int, ...]) -> np.ndarray:
    """The slice `idx` (of the global jaxpar shape `shape`) of parameter `e`, as float32."""
    idx = _normalize(idx, shape)
    if "{i}" not in e.hf:  # not a stack of layers (blocks, MTP modules)
        return _read(cfg, e, e.hf, get, idx).astype(np.float32)
    layers = [i if e.layers is None else e.layers[i] for i in range(idx[0].start, idx[0].stop)]
    return np.stack([_read(cfg, e, e.hf.replace("{i}", str(i)), get, idx[1:]).astype(np.float32)
                     for i in layers])


def from_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], *, interleave: bool = True) -> dict:
    """jaxpar parameters (numpy, float32, canonical layout) from HF tensors held in memory
    (`interleave`: a deepseek_v3 model's rope_interleave)."""
    shapes, prefix = model.param_shapes(cfg), _gpt2_prefix(cfg, tensors)
    out: dict = {}
    for e in entries(cfg, prefix, fused=moe.is_fused(cfg, tensors), interleave=interleave):
        shape = _leaf(shapes, e.path).shape
        _set(out, e.path, read_leaf(cfg, e, lambda n, s: np.asarray(tensors[n][s]), (slice(None),) * len(shape), shape))
    for path in _buffers(cfg):
        leaf = _leaf(shapes, path)
        _set(out, path, np.zeros(leaf.shape, leaf.dtype))
    return out


def _buffers(cfg: ModelConfig) -> tuple[tuple[str, ...], ...]:
    """The leaves no HF tensor holds (zeros on import, never exported): the MoE routers' report, the
    MTP modules' (`jaxpar.model.mtp`), and the blocks' FP8 amax histories (delayed scaling)."""
    mtp = (("mtp", "report"),) + ((("mtp", "blocks", "mlp", "router_stats"),) if cfg.moe else ()) \
        if cfg.mtp_depth and cfg.mla else ()
    history = ()
    if cfg.fp8 and cfg.fp8_scaling == "delayed":
        stacks = (("blocks", "dense"), ("blocks", "moe")) if cfg.mixed else (("blocks",),)
        history = tuple((*s, fp8.HISTORY) for s in stacks) + ((("mtp", "blocks", fp8.HISTORY),)
                                                              if cfg.mtp_depth and cfg.mla else ())
    if not cfg.moe:
        return mtp + history
    return (tuple(("blocks", "moe", *p[1:]) for p in moe.BUFFERS) if cfg.mixed else moe.BUFFERS) + mtp + history


def to_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """HF tensors (in HF order: embeddings, layers, final norm, head) from jaxpar parameters."""
    params = jax.device_get(params)
    parts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for e in entries(cfg, "transformer." if cfg.arch == "gpt2" else ""):
        x = np.asarray(_leaf(params, e.path))
        for i, name in enumerate(_layer_names(cfg, e)):
            xi = x[i] if "{i}" in e.hf else x
            for n, t in moe.write(e, name, xi) if e.kind in moe.KINDS else [(name, _write(cfg, e, xi))]:
                parts.setdefault(n, []).append((e.offset, t))
    if cfg.mtp_depth and cfg.mla:  # each MTP layer's copies of the embedding and the head, as DeepSeek-V3's
        head = "model.embed_tokens.weight" if cfg.tied else "lm_head.weight"
        for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth):
            for copy, src in zip(deepseek.COPIES, ("model.embed_tokens.weight", head)):
                parts[f"model.layers.{i}.{copy}"] = parts[src]
    order = sorted(parts, key=_hf_order)
    return {n: np.ascontiguousarray(np.concatenate([p for _, p in sorted(parts[n], key=lambda q: q[0])], axis=-1))
            for n in order}


def _hf_order(name: str) -> tuple:
    parts = name.split(".")
    layer = next((int(p) for p in parts if p.isdigit()), None)
    return (0 if layer is None and ("embed" in name or "wte" in name or "wpe" in name) else 1 if layer is not None
            else 2, -1 if layer is None else layer, name)


def _gpt2_prefix(cfg: ModelConfig, names) -> str:
    return "transformer." if cfg.arch == "gpt2" and "transformer.wte.weight" in names else ""


# --------------------------------------------------------------------------------------------
# Reading a folder


@dataclasses.dataclass
class _Folder:
    """The tensors of a folder: name -> (file, shape), from the safetensors headers only."""

    folder: str
    where: dict[str, str]
    shapes: dict[str, tuple[int, ...]]


def _index(folder: str) -> _Folder:
    from safetensors import safe_open

    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFError(f"{index!r} cannot be read as a safetensors index ({e}); pass a valid "
                          "model.safetensors.index.json with a `weight_map`.") from None
        for f in files:
            if not os.path.isfile(os.path.join(folder, f)):
                raise HFError(f"shard {f!r} named by {index!r} does not exist; download the missing file into "
                              f"{folder!r}.")
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            other = [p for p in ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "tf_model.h5",
                                 "flax_model.msgpack") if os.path.exists(os.path.join(folder, p))]
            hint = (f" ({other[0]} is not read: jaxpar reads only safetensors, without PyTorch)" if other else "")
            raise HFError(f"{folder!r} holds no *.safetensors weights{hint}; save the model with "
                          "save_pretrained(..., safe_serialization=True).")
        weight_map = None
    where, shapes = {}, {}
    for f in files:
        path = os.path.join(folder, f)
        try:
            with safe_open(path, framework="numpy") as st:
                for name in st.keys():
                    if name in where:
                        raise HFError(f"tensor {name!r} is stored twice, in {where[name]!r} and {f!r} of {folder!r}; "
                                      "remove the stray file.")
                    where[name], shapes[name] = f, tuple(st.get_slice(name).get_shape())
        except HFError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError) on a bad file
            raise HFError(f"{path!r} is not a readable safetensors file ({e}); download it again.") from None
    if weight_map is not None:
        for name, f in sorted(weight_map.items()):
            if where.get(name) != f:
                raise HFError(f"{index!r} puts tensor {name!r} in {f!r}, which does not hold it; download that "
                              "shard again.")
    return _Folder(folder, where, shapes)


def _check_tensors(cfg: ModelConfig, tf: _Folder, hf_cfg: ModelConfig) -> list[Entry]:
    """Every tensor the model needs is there with the shape config.json implies; nothing else is
    (but the layers past num_hidden_layers of an MLA folder: multi-token prediction, skipped)."""
    fused = moe.is_fused(hf_cfg, tf.where)
    interleave = deepseek.interleaved(read_hf_config(tf.folder)) if hf_cfg.mla else True
    # (The MTP modules `cfg` asks for are layers after the model's: config.json does not say whether
    # the folder holds them, its tensors do.)
    hf_cfg = dataclasses.replace(hf_cfg, mtp_depth=cfg.mtp_depth) if hf_cfg.mla else hf_cfg
    es = entries(hf_cfg, _gpt2_prefix(cfg, tf.where), fused=fused, interleave=interleave)
    expected = {}
    for e in es:
        for name in _hf_names(hf_cfg, e):
            expected[name] = e.hf_shape
    config = os.path.join(tf.folder, "config.json")
    for name, shape in expected.items():
        if name not in tf.where and hf_cfg.mla and deepseek.beyond(dataclasses.replace(hf_cfg, mtp_depth=0), name):
            raise HFError(f"model.mtp_depth = {cfg.mtp_depth} reads multi-token prediction module "
                          f"{int(name.split('.')[2]) - hf_cfg.n_layers + 1} from layer {name.split('.')[2]} of "
                          f"{tf.folder!r}, which has no tensor {name!r} (a folder saved by transformers holds no "
                          "MTP layers); set model.mtp_depth=0 to load the main model, or start from a checkpoint "
                          "with its MTP layers.")
        if name not in tf.where:
            raise HFError(f"tensor {name!r} that config.json of a {cfg.arch} model implies is in none of the "
                          f"safetensors files of {tf.folder!r}; the folder is incomplete or its config.json is "
                          "for another model.")
        if tf.shapes[name] != shape:
            raise HFError(f"tensor {name!r} in {os.path.join(tf.folder, tf.where[name])!r} has shape "
                          f"{list(tf.shapes[name])}, but {config!r} implies {list(shape)}; the config does not "
                          "match the weights: fix config.json or use the matching weights.")
    beyond = sorted(n for n in tf.where if n not in expected and hf_cfg.mla and deepseek.beyond(hf_cfg, n))
    if beyond:
        layers = sorted({int(n.split(".")[2]) for n in beyond})
        log.warning(f"{tf.folder}: {len(beyond)} tensors of layers {', '.join(map(str, layers))} (past "
                    f"num_hidden_layers = {hf_cfg.n_layers}: multi-token prediction) are not read, as "
                    f"model.mtp_depth = {cfg.mtp_depth} asks; set it to {max(layers) - hf_cfg.n_layers + 1} to train "
                    "them.")
    extra = sorted(n for n in tf.where if n not in expected and n not in beyond and not _ignored(cfg, n))
    if extra:
        raise HFError(f"tensor {extra[0]!r} in {os.path.join(tf.folder, tf.where[extra[0]])!r} has no place in "
                      f"jaxpar's {cfg.arch} ({len(extra)} such tensors); the checkpoint is a variant jaxpar "
                      "does not implement.")
    # The jaxpar model may hold fewer positions than the folder (a smaller model.seq_len).
    return entries(cfg, _gpt2_prefix(cfg, tf.where), fused=fused, interleave=interleave)


def load_params(folder: str, cfg, shardings: Any) -> dict:
    """The parameters of a Hugging Face folder in jaxpar's canonical layout, each array built on
    its sharding in `shardings` (a tree of `jax.sharding.Sharding` like the parameters, e.g.
    `jaxpar.train.step.build(cfg, mesh).state_shardings.params`). `cfg` is a Config or ModelConfig,
    checked against config.json (`check_matches`). Each process reads from the safetensors files
    only the slices its own devices hold; arrays have `cfg.model.param_dtype` (the sigmoid
    router's bias float32, as the model holds it)."""
    from safetensors import safe_open

    mcfg = getattr(cfg, "model", cfg)
    if mcfg.mtp_depth and not mcfg.mla:
        raise HFError(f"model.mtp_depth = {mcfg.mtp_depth} asks for multi-token-prediction modules, which only "
                      "deepseek_v3 folders hold (a model with model.kv_lora_rank); set model.mtp_depth=0 to load "
                      f"{folder!r}.")
    hf_cfg = check_matches(mcfg, folder)
    tf = _index(folder)
    es = _check_tensors(mcfg, tf, hf_cfg)
    shapes = model.param_shapes(mcfg)
    out: dict = {}
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def get(name: str, sl: tuple[slice, ...]) -> np.ndarray:
            f = tf.where[name]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(os.path.join(folder, f), framework="numpy"))
            return handles[f].get_slice(name)[sl]

        for e in es:
            shape, sharding = _leaf(shapes, e.path).shape, _leaf(shardings, e.path)
            # param_dtype, or the leaf's own (the sigmoid router's bias is always float32)
            dtype = np.dtype(_leaf(shapes, e.path).dtype)
            done: dict[tuple, np.ndarray] = {}  # replicas of one shard are read once

            def callback(idx, e=e, shape=shape, done=done, dtype=dtype):
                key = tuple((s.start, s.stop) for s in _normalize(idx, shape))
                if key not in done:
                    done[key] = read_leaf(mcfg, e, get, idx, shape).astype(dtype)
                return done[key]

            _set(out, e.path, jax.make_array_from_callback(shape, sharding, callback))
        for path in _buffers(mcfg):
            leaf = _leaf(shapes, path)

            def zeros(idx, leaf=leaf):
                return np.zeros([s.stop - s.start for s in _normalize(idx, leaf.shape)], leaf.dtype)

            _set(out, path, jax.make_array_from_callback(leaf.shape, _leaf(shardings, path), zeros))
    return out


# --------------------------------------------------------------------------------------------
# Writing a folder


def save_params(params: dict, cfg, folder: str, *, max_shard_bytes: int = MAX_SHARD_BYTES,
                extra_files: dict[str, str] | None = None) -> None:
    """Write `params` (canonical layout; `cfg` a Config or ModelConfig) as a Hugging Face folder:
    config.json and model.safetensors, or shards of at most `max_shard_bytes` with
    model.safetensors.index.json. Written under a temporary name and renamed, so `folder` appears
    whole or not at all; it must not exist yet. The same weights give the same bytes.
    `extra_files` maps a file name to a path to copy in (tokenizer files)."""
    from safetensors.numpy import save_file

    mcfg = getattr(cfg, "model", cfg)
    folder = os.path.abspath(folder)
    if os.path.exists(folder):
        raise HFError(f"{folder!r} already exists; choose a new folder (nothing is overwritten).")
    parent = os.path.dirname(folder)
    config = hf_config(mcfg)  # first: it refuses what the family cannot say
    if mcfg.mtp_depth and not mcfg.mla:
        log.warning(f"{folder}: the model's {mcfg.mtp_depth} multi-token-prediction module(s) are not exported (only "
                    "deepseek_v3 folders hold them); the folder holds the main model.")
    elif mcfg.mtp_depth:
        log.info(f"{folder}: the {mcfg.mtp_depth} multi-token-prediction module(s) are written as layers "
                 f"{mcfg.n_layers}..{mcfg.n_layers + mcfg.mtp_depth - 1}, as DeepSeek-V3's; transformers does not "
                 "load them (it builds no MTP module).")
    tensors = to_tensors(mcfg, params)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, x in tensors.items():
        if shards[-1] and size + x.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    try:
        os.makedirs(parent, exist_ok=True)  # only now: every check and read has passed
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.tmp-", dir=parent)
    except OSError as e:
        raise _unwritable(folder, e) from None
    try:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, SINGLE), metadata={"format": "pt"})
        else:
            names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
            for name, shard in zip(names, shards):
                save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
            index = {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
                     "weight_map": {t: n for n, shard in zip(names, shards) for t in shard}}
            with open(os.path.join(tmp, INDEX), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2, sort_keys=True)
                f.write("\n")
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, os.path.join(tmp, name))
        publish(tmp, folder)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _unwritable(folder, e) from None
        raise


def _unwritable(folder: str, e: OSError) -> HFError:
    return HFError(f"{folder!r} cannot be written ({e.strerror or e}); choose a folder you can write to, with room "
                   "for the weights.")
