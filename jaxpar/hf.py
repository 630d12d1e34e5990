"""Hugging Face model folders (config.json + *.safetensors) in and out, for `llama` and `gpt2`
(and the mixture-of-experts families of `jaxpar.hf_moe`).

Import places every parameter directly on its target sharding: `jax.make_array_from_callback`
asks, per local device, for the slice that device holds, and only that slice is read from the
safetensors files (`safe_open(...).get_slice`), so no process holds more of the model than its
devices do. Export writes the canonical parameters back as a folder that `transformers` loads.

Layouts: HF linear weights are [out, in] (llama `nn.Linear`) or [in, out] (GPT-2 `Conv1D`);
jaxpar's are [in, out] with heads split out (`wq` [D, N, H], `wo` [N, H, D]). Both use the
rotate-half RoPE convention, so no permutation of q/k rows is needed. Padded vocabulary rows
(`model.vocab_multiple`) are zero on import and dropped on export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
import tempfile
from typing import Any, Callable, NamedTuple

import jax
import ml_dtypes  # noqa: F401  (registers numpy's `bfloat16`, which safetensors' numpy reader needs)
import numpy as np

from jaxpar import hf_moe
from jaxpar.files import publish as _publish
from jaxpar.config import Config, ConfigError, JaxparError, ModelConfig, validate

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Larger exports are split into shards of at most this many bytes (as transformers does).
MAX_SHARD_BYTES = 5 * 2**30
# Context length given to an imported llama when config.json allows more: a training default the
# user lowers or raises with model.seq_len; RoPE has no parameters, so nothing depends on it.
LLAMA_SEQ_CAP = 4096
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class HFError(JaxparError):
    """A Hugging Face folder that jaxpar cannot read or write."""


# --------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def read_hf_config(folder: str) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face model folder."""
    if not os.path.isdir(folder):
        raise HFError(f"{folder!r} is not a directory; pass a Hugging Face model folder (config.json + *.safetensors).")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        from jaxpar.cli import KINDS, folder_kind

        kind = folder_kind(folder)
        if kind == "run":
            raise HFError(f"{folder!r} is {KINDS['run']}, not a Hugging Face model folder; export it with "
                          f"`python -m jaxpar.convert --run-dir {folder} --to-hf DIR` and pass DIR.")
        what = f"is {KINDS['dataset']}, not a model" if kind == "dataset" else \
            "has no config.json, so it is not a Hugging Face model folder"
        raise HFError(f"{folder!r} {what}; pass a folder written by save_pretrained (config.json + *.safetensors).")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{path!r} cannot be read as JSON ({e}); pass a valid Hugging Face config.json.") from None
    if not isinstance(raw, dict):
        raise HFError(f"{path!r} must hold a JSON object, got {type(raw).__name__}; pass a valid config.json.")
    return raw


def _value(hf: dict, path: str, key: str, default: Any = ...) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise HFError(f"{path!r} lacks `{key}`, which a {hf.get('model_type')} model needs; add it to config.json.")
    return default


def _refuse(ok: bool, path: str, what: str, why: str) -> None:
    if not ok:
        raise HFError(f"{path!r} sets {what}, but {why}.")


# model_types of the llama architecture: Mistral as llama; Qwen 2 / 2.5 with q, k, v biases; Qwen 3
# with q and k norms and its own head_dim.
LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def config_from_hf(folder: str, *, seq_len: int | None = None, vocab_multiple: int = 64) -> ModelConfig:
    """jaxpar's ModelConfig for a Hugging Face `llama` or `gpt2` folder.

    `seq_len` (default: the folder's maximum, capped at 4096 for llama) may not exceed the maximum
    position of config.json. The vocabulary is padded to a multiple of `vocab_multiple` (64: a
    multiple of any power-of-two tensor-parallel size up to 64; 50257 -> 50304).
    """
    hf = read_hf_config(folder)
    path = os.path.join(folder, "config.json")
    arch = hf.get("model_type")
    llamas = LLAMA_FAMILIES + hf_moe.FAMILIES
    if arch not in llamas + ("gpt2",):
        raise HFError(f"{path!r} has model_type = {arch!r}, which jaxpar does not support; jaxpar reads "
                      f"{', '.join(f'`{a}`' for a in llamas)} and `gpt2` models.")
    v = lambda key, default=...: _value(hf, path, key, default)  # noqa: E731

    def i(key: str, default: Any = ...) -> int:
        value = v(key, default)
        _refuse(isinstance(value, int) and not isinstance(value, bool) and value > 0, path, f"{key} = {value!r}",
                f"{key} must be a positive integer")
        return value

    def f(key: str, default: float) -> float:
        value = v(key, default)
        _refuse(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, path,
                f"{key} = {value!r}", f"{key} must be a positive number")
        return float(value)

    def nonneg(key: str, default: float) -> float:
        value = v(key, default)
        _refuse(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, path,
                f"{key} = {value!r}", f"{key} must be a non-negative number")
        return float(value)

    if arch in llamas:  # the llama architecture under their own model_types and options
        d, n = i("hidden_size"), i("num_attention_heads")
        rope = hf.get("rope_parameters") or {}
        if "rope_theta" in rope:  # transformers 5 keeps it there
            hf = {**hf, "rope_theta": rope["rope_theta"]}
        scaling = hf.get("rope_scaling") or {}
        # transformers 5 writes the scaling into rope_parameters, 4.x into rope_scaling.
        scaling = rope if ("rope_type" in rope or "type" in rope) else scaling
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        _refuse(rope_type in ("default", "linear", "llama3"), path, f"RoPE type {rope_type!r}",
                "jaxpar implements the default, linear and llama3 rotary embeddings")
        _refuse(scaling.get("attention_factor") in (None, 1, 1.0), path,
                f"rope attention_factor = {scaling.get('attention_factor')!r}",
                "jaxpar's linear and llama3 RoPE leave the attention scale unchanged (attention_factor 1)")
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        _refuse(v("hidden_act", "silu") == "silu", path, f"hidden_act = {hf.get('hidden_act')!r}",
                "jaxpar's llama MLP is SwiGLU with silu")
        _refuse(not hf.get("attention_bias") and not hf.get("mlp_bias"), path, "attention_bias or mlp_bias",
                "jaxpar's llama architecture has biases only on q, k and v (qwen2), none on the output "
                "projection or the MLP")
        head_dim = i("head_dim", d // n)
        max_pos = i("max_position_embeddings", 2048)
        fields = dict(n_layers=i("num_hidden_layers"), d_model=d, n_heads=n, n_kv_heads=i("num_key_value_heads", n),
                      d_ff=i("intermediate_size"), norm_eps=f("rms_norm_eps", 1e-6),
                      rope_theta=f("rope_theta", 10000.0), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                      head_dim=None if head_dim == d // n and d % n == 0 else head_dim,
                      qkv_bias=arch == "qwen2", qk_norm=arch in ("qwen3", "qwen3_moe"),
                      hf_model_type="mistral" if arch == "mistral" else None)
        if arch in hf_moe.FAMILIES:
            fields.update(hf_moe.config_fields(hf, path, arch, i, nonneg))
        if rope_type != "default":
            sv = lambda key: _value({**scaling, "model_type": f"{arch} with {rope_type} RoPE"}, path, key)  # noqa: E731
            fields.update(rope_scaling=rope_type, rope_factor=float(sv("factor")))
        if rope_type == "llama3":
            fields.update(rope_low_freq_factor=float(sv("low_freq_factor")),
                          rope_high_freq_factor=float(sv("high_freq_factor")),
                          rope_original_context=int(sv("original_max_position_embeddings")))
        # Full causal attention equals a sliding window of W tokens on sequences of at most W.
        default_len = min(max_pos, LLAMA_SEQ_CAP, window or max_pos)
        _refuse(window is None or seq_len is None or window >= seq_len, path, f"sliding_window = {window}",
                f"jaxpar's attention is full causal attention, which equals a sliding window only when the window "
                f"covers the sequence (seq_len = {seq_len}); choose seq_len <= {window}")
    else:
        d = i("n_embd")
        act = v("activation_function", "gelu_new")
        _refuse(act in ("gelu_new", "gelu_pytorch_tanh"), path, f"activation_function = {act!r}",
                "jaxpar's gpt2 MLP uses the tanh approximation of GELU (gelu_new)")
        _refuse(v("scale_attn_weights", True) and not hf.get("scale_attn_by_inverse_layer_idx")
                and not hf.get("add_cross_attention"), path,
                "scale_attn_weights = false, scale_attn_by_inverse_layer_idx or add_cross_attention",
                "jaxpar's gpt2 attention is plain causal self-attention scaled by 1/sqrt(head_dim)")
        _refuse(hf.get("tie_word_embeddings", True), path, "tie_word_embeddings = false",
                "jaxpar's gpt2 ties its output projection to the token embedding")
        max_pos = i("n_positions", i("max_position_embeddings", 1024))
        fields = dict(n_layers=i("n_layer"), d_model=d, n_heads=i("n_head"), n_kv_heads=None,
                      d_ff=i("n_inner", 4 * d), norm_eps=f("layer_norm_epsilon", 1e-5))
        default_len = max_pos
    if seq_len is not None and seq_len > max_pos:
        raise HFError(f"seq_len = {seq_len} exceeds the {max_pos} positions of {path!r}; choose seq_len <= {max_pos}.")
    if "initializer_range" in hf:
        fields["init_std"] = f("initializer_range", 0.02)
    cfg = ModelConfig(arch="gpt2" if arch == "gpt2" else "llama", vocab_size=i("vocab_size"), vocab_multiple=vocab_multiple,
                      seq_len=default_len if seq_len is None else seq_len, **fields)
    try:
        validate(Config(model=cfg))
    except ConfigError as e:
        raise HFError(f"{path!r} describes a model jaxpar cannot build: {e}") from None
    return cfg


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json of a jaxpar model (the keys both transformers 4.45+ and 5 read)."""
    dtype = cfg.param_dtype
    if cfg.arch == "llama":
        if cfg.qkv_bias and cfg.qk_norm:
            raise HFError("model.qkv_bias and model.qk_norm together have no Hugging Face family (qwen2 has the "
                          "biases, qwen3 the norms); export a model with one of them.")
        family, name = ("qwen3", "Qwen3") if cfg.qk_norm else ("qwen2", "Qwen2") if cfg.qkv_bias else \
            ("mistral", "Mistral") if cfg.hf_model_type == "mistral" else ("llama", "Llama")
        out = {
            "architectures": [f"{name}ForCausalLM"], "model_type": family, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
            "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": _rope_scaling(cfg), "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": cfg.tied, "initializer_range": cfg.init_std, "torch_dtype": dtype,
        }
        if family == "qwen2":
            del out["attention_bias"]  # not a Qwen 2 key: its q, k, v always have biases
        if family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
        if family == "mistral":
            out["sliding_window"] = None
        return hf_moe.config_keys(cfg, out) if cfg.moe else out
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model, "n_inner": cfg.d_ff, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
        "n_positions": cfg.seq_len, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
        "scale_attn_weights": True, "tie_word_embeddings": True, "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
    }


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """config.json's rope_scaling of `cfg` (transformers 4.x reads it; 5 reads it into rope_parameters)."""
    if cfg.rope_scaling == "none":
        return None
    out = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                   original_max_position_embeddings=cfg.rope_original_context)
    return out


_MATCHED = ("arch", "n_layers", "d_model", "n_heads", "kv_heads", "head_size", "n_experts", "experts_per_token",
            "expert_width", "n_shared_experts", "router", "router_norm_topk", "moe_pattern", "d_ff", "vocab_size",
            "norm_eps", "tied", "qkv_bias", "qk_norm", "rope_theta", "rope_scaling", "rope_factor",
            "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context")
# Keys compared as the model uses them, set through another field (null there: derived from others).
_SET_BY = {"kv_heads": "n_kv_heads", "head_size": "head_dim", "tied": "tie_embeddings", "expert_width": "expert_d_ff",
           "moe_pattern": "moe_layers"}


def check_matches(cfg: ModelConfig, folder: str) -> ModelConfig:
    """The folder's ModelConfig, after checking that `cfg` describes the same function (shapes,
    norm epsilon, RoPE base and scaling, tie, q/k/v biases and norms; seq_len within the folder's
    positions); raises one HFError listing every setting that differs otherwise.

    A derived value (the head width, KV heads, tie, expert width) is listed only if it still
    differs once the settings it derives from take the folder's values: d_model = 128 against 64
    is one difference, not also a head_dim one."""
    hf_cfg = config_from_hf(folder)
    path = os.path.join(folder, "config.json")
    used = {"none": ("rope_theta", "rope_scaling"), "linear": ("rope_theta", "rope_scaling", "rope_factor")}

    def compared(key: str) -> bool:
        if key.startswith("rope") and (cfg.arch != "llama" or key not in used.get(hf_cfg.rope_scaling, (key,))):
            return False
        if key == "d_ff" and hf_cfg.moe and not hf_cfg.mixed:  # every MLP is MoE: d_ff is unused
            return False
        if key in ("experts_per_token", "expert_width", "n_shared_experts", "router", "router_norm_topk",
                   "moe_pattern") and not hf_cfg.moe:  # both dense (n_experts matched): the MoE keys are unused
            return False
        return True

    diffs: dict[str, tuple[Any, Any]] = {}  # field -> (cfg's value, the folder's)
    for key in (k for k in _MATCHED if k not in _SET_BY and compared(k)):
        if getattr(cfg, key) != getattr(hf_cfg, key):
            diffs[key] = getattr(cfg, key), getattr(hf_cfg, key)
    try:
        fixed = dataclasses.replace(cfg, **{k: want for k, (_, want) in diffs.items()})
    except (TypeError, ValueError):
        fixed = cfg
    for key in (k for k in _MATCHED if k in _SET_BY and compared(k)):
        if getattr(fixed, key) != getattr(hf_cfg, key):
            name = _SET_BY[key]
            if key == "moe_pattern":
                diffs[name] = cfg.moe_layers, hf_cfg.moe_layers
            else:
                diffs[name] = getattr(cfg, key), getattr(hf_cfg, key)
    seq_ok = True
    try:
        config_from_hf(folder, seq_len=cfg.seq_len)  # raises if seq_len exceeds the positions
    except HFError:
        if not diffs or cfg.seq_len <= hf_cfg.seq_len:  # alone, or another problem: its own sentence
            raise
        seq_ok = False
    if diffs or not seq_ok:
        items = [f"model.{k} = {got!r} (folder: {want!r})" for k, (got, want) in diffs.items()]
        if not seq_ok:
            items.append(f"model.seq_len = {cfg.seq_len} (folder: at most {hf_cfg.seq_len})")
        n = len(items)
        sets = " ".join(f"--set model.{k}={want}" for k, (_, want) in diffs.items())
        if not seq_ok:
            sets += f" --set model.seq_len={hf_cfg.seq_len}"
        raise HFError(f"{n} setting{'s' if n > 1 else ''} of the model section differ{'s' if n == 1 else ''} from "
                      f"{path!r}: {', '.join(items)}; set {'them' if n > 1 else 'it'} to the folder's "
                      f"value{'s' if n > 1 else ''} (`{sets.strip()}`) or start from another folder.")
    return hf_cfg


# --------------------------------------------------------------------------------------------
# Which HF tensor each jaxpar parameter comes from, and how


class Entry(NamedTuple):
    path: tuple[str, ...]   # the jaxpar leaf, e.g. ("blocks", "attn", "wq")
    hf: str                 # HF tensor name; "{i}" is the layer index for `blocks` leaves, "{e}" the expert's
    kind: str               # how the leaf is read from the tensor (see `_read`)
    hf_shape: tuple[int, ...]
    offset: int = 0         # first column of this leaf in a fused tensor (GPT-2's c_attn)
    layers: tuple[int, ...] | None = None  # a mixed model's stack: the model layer ("{i}") of each entry


def entries(cfg: ModelConfig, prefix: str = "", *, fused: bool = False) -> list[Entry]:
    """The mapping of every jaxpar parameter to its HF tensor (`prefix`: "transformer." for
    GPT-2 checkpoints saved from GPT2LMHeadModel, "" for ones saved from GPT2Model; `fused`: an
    MoE checkpoint whose experts are stored fused, see `hf_moe`)."""
    if cfg.block != "pre_norm":
        raise HFError(f"model.block = {cfg.block!r} has no Hugging Face counterpart (transformers' llama and gpt2 "
                      "are pre_norm blocks); convert only models with model.block=pre_norm.")
    if cfg.mixed:  # dense and MoE layers (`model.moe_layers`): each stack's entries, at its layers
        from jaxpar.model.transformer import dense_config, layer_order

        order, out = layer_order(cfg), []
        kinds = (("dense", dense_config(cfg)), ("moe", dataclasses.replace(cfg, moe_layers="all")))
        for kind, kind_cfg in kinds:
            for e in entries(kind_cfg, prefix, fused=fused):
                if e.path[0] == "blocks":
                    out.append(e._replace(path=("blocks", kind, *e.path[1:]), layers=tuple(map(int, order[kind]))))
                elif kind == "moe":
                    out.append(e)
        return out
    D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff, cfg.vocab_size
    if cfg.arch == "llama":
        a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
        mlp = hf_moe.entries(cfg, fused) if cfg.moe else [
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
    return name.endswith(_IGNORED_SUFFIXES) or (cfg.tied and name == "lm_head.weight")


def _layer_names(cfg: ModelConfig, e: Entry) -> list[str]:
    """The entry's name in each layer (one name for a leaf outside `blocks`); "{e}" is kept."""
    layers = range(cfg.n_layers) if e.layers is None else e.layers
    return [e.hf.replace("{i}", str(i)) for i in layers] if "{i}" in e.hf else [e.hf]


def _hf_names(cfg: ModelConfig, e: Entry) -> list[str]:
    return [n for name in _layer_names(cfg, e) for n in hf_moe.expert_names(cfg, name)]


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


def _read(e: Entry, name: str, get: Getter, idx: tuple[slice, ...], H: int) -> np.ndarray:
    """The slice `idx` of one layer's jaxpar leaf `e`, reading only the HF rows and columns it needs."""
    if e.kind in hf_moe.KINDS:
        return hf_moe.read(e, name, get, idx)
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


def _write(e: Entry, x: np.ndarray) -> np.ndarray:
    """One layer's HF tensor (or, for a fused tensor, this leaf's columns) from the jaxpar leaf."""
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
    if e.path[0] != "blocks":
        return _read(e, e.hf, get, idx, cfg.head_size).astype(np.float32)
    layers = [i if e.layers is None else e.layers[i] for i in range(idx[0].start, idx[0].stop)]
    return np.stack([_read(e, e.hf.replace("{i}", str(i)), get, idx[1:], cfg.head_size).astype(np.float32)
                     for i in layers])


def from_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict:
    """jaxpar parameters (numpy, float32, canonical layout) from HF tensors held in memory."""
    from jaxpar import model

    shapes, prefix = model.param_shapes(cfg), _gpt2_prefix(cfg, tensors)
    out: dict = {}
    for e in entries(cfg, prefix, fused=hf_moe.is_fused(cfg, tensors)):
        shape = _leaf(shapes, e.path).shape
        _set(out, e.path, read_leaf(cfg, e, lambda n, s: np.asarray(tensors[n][s]), (slice(None),) * len(shape), shape))
    for path in _buffers(cfg):
        leaf = _leaf(shapes, path)
        _set(out, path, np.zeros(leaf.shape, leaf.dtype))
    return out


def _buffers(cfg: ModelConfig) -> tuple[tuple[str, ...], ...]:
    """The leaves no HF tensor holds (zeros on import, never exported): the MoE routers' report."""
    if not cfg.moe:
        return ()
    return tuple(("blocks", "moe", *p[1:]) for p in hf_moe.BUFFERS) if cfg.mixed else hf_moe.BUFFERS


def to_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """HF tensors (in HF order: embeddings, layers, final norm, head) from jaxpar parameters."""
    params = jax.device_get(params)
    parts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for e in entries(cfg, "transformer." if cfg.arch == "gpt2" else ""):
        x = np.asarray(_leaf(params, e.path))
        for i, name in enumerate(_layer_names(cfg, e)):
            xi = x[i] if e.path[0] == "blocks" else x
            for n, t in hf_moe.write(e, name, xi) if e.kind in hf_moe.KINDS else [(name, _write(e, xi))]:
                parts.setdefault(n, []).append((e.offset, t))
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
    """Every tensor the model needs is there with the shape config.json implies; nothing else is."""
    fused = hf_moe.is_fused(hf_cfg, tf.where)
    es = entries(hf_cfg, _gpt2_prefix(cfg, tf.where), fused=fused)
    expected = {}
    for e in es:
        for name in _hf_names(hf_cfg, e):
            expected[name] = e.hf_shape
    config = os.path.join(tf.folder, "config.json")
    for name, shape in expected.items():
        if name not in tf.where:
            raise HFError(f"tensor {name!r} that config.json of a {cfg.arch} model implies is in none of the "
                          f"safetensors files of {tf.folder!r}; the folder is incomplete or its config.json is "
                          "for another model.")
        if tf.shapes[name] != shape:
            raise HFError(f"tensor {name!r} in {os.path.join(tf.folder, tf.where[name])!r} has shape "
                          f"{list(tf.shapes[name])}, but {config!r} implies {list(shape)}; the config does not "
                          "match the weights: fix config.json or use the matching weights.")
    extra = sorted(n for n in tf.where if n not in expected and not _ignored(cfg, n))
    if extra:
        raise HFError(f"tensor {extra[0]!r} in {os.path.join(tf.folder, tf.where[extra[0]])!r} has no place in "
                      f"jaxpar's {cfg.arch} ({len(extra)} such tensors); the checkpoint is a variant jaxpar "
                      "does not implement.")
    # The jaxpar model may hold fewer positions than the folder (a smaller model.seq_len).
    return entries(cfg, _gpt2_prefix(cfg, tf.where), fused=fused)


def load_params(folder: str, cfg, shardings: Any) -> dict:
    """The parameters of a Hugging Face folder in jaxpar's canonical layout, each array built on
    its sharding in `shardings` (a tree of `jax.sharding.Sharding` like the parameters, e.g.
    `jaxpar.train.step.build(cfg, mesh).state_shardings.params`). `cfg` is a Config or ModelConfig,
    checked against config.json (`check_matches`). Each process reads from the safetensors files
    only the slices its own devices hold; arrays have `cfg.model.param_dtype`."""
    from safetensors import safe_open

    from jaxpar import model

    mcfg = getattr(cfg, "model", cfg)
    hf_cfg = check_matches(mcfg, folder)
    tf = _index(folder)
    es = _check_tensors(mcfg, tf, hf_cfg)
    shapes = model.param_shapes(mcfg)
    dtype = np.dtype(mcfg.param_dtype)
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
            done: dict[tuple, np.ndarray] = {}  # replicas of one shard are read once

            def callback(idx, e=e, shape=shape, done=done):
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
            json.dump(hf_config(mcfg), f, indent=2, sort_keys=True)
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


def publish(tmp: str, target: str) -> None:
    """Rename the finished temporary directory `tmp` to `target`, it and its files with the user's
    umask (`jaxpar.files.publish`: mkdtemp makes the folder private, safetensors its files)."""
    _publish(tmp, target)


def tokenizer_files(folder: str) -> dict[str, str]:
    """The tokenizer (and generation) files of a Hugging Face folder that exist, name -> path."""
    return {n: os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))}
