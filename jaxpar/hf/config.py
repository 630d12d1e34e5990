"""config.json <-> jaxpar's ModelConfig: `config_from_hf` reads a folder's config.json (the llama
families, `gpt2`, the MoE families of `jaxpar.hf.moe` and DeepSeek-V3's of `jaxpar.hf.deepseek`),
`hf_config` writes one, and
`check_matches` compares a ModelConfig with a folder's, listing every setting that differs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from jaxpar.cli import KINDS, folder_kind
from jaxpar.config import Config, ConfigError, ModelConfig, validate
from jaxpar.hf import deepseek, moe
from jaxpar.hf.common import HFError, refuse

# Context length given to an imported llama when config.json allows more: a training default the
# user lowers or raises with model.seq_len; RoPE has no parameters, so nothing depends on it.
LLAMA_SEQ_CAP = 4096
# transformers' max_position_embeddings of a llama config.json without the key.
LLAMA_POSITIONS = 2048


def read_hf_config(folder: str) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face model folder."""
    if not os.path.isdir(folder):
        raise HFError(f"{folder!r} is not a directory; pass a Hugging Face model folder (config.json + *.safetensors).")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
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


# model_types of the llama architecture: Mistral as llama; Qwen 2 / 2.5 with q, k, v biases; Qwen 3
# with q and k norms and its own head_dim.
LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def config_from_hf(folder: str, *, seq_len: int | None = None, vocab_multiple: int = 64) -> ModelConfig:
    """jaxpar's ModelConfig for a Hugging Face `llama` or `gpt2` folder.

    `seq_len` (default: the folder's maximum, capped at 4096 for llama) may exceed the llama
    families' max_position_embeddings (context extension: RoPE has no position parameters), not
    gpt2's learned positions. The vocabulary is padded to a multiple of `vocab_multiple` (64: a
    multiple of any power-of-two tensor-parallel size up to 64; 50257 -> 50304).
    """
    hf = read_hf_config(folder)
    path = os.path.join(folder, "config.json")
    arch = hf.get("model_type")
    llamas = LLAMA_FAMILIES + moe.FAMILIES + deepseek.FAMILIES
    if arch not in llamas + ("gpt2",):
        raise HFError(f"{path!r} has model_type = {arch!r}, which jaxpar does not support; jaxpar reads "
                      f"{', '.join(f'`{a}`' for a in llamas)} and `gpt2` models.")
    v = lambda key, default=...: _value(hf, path, key, default)  # noqa: E731

    def i(key: str, default: Any = ...) -> int:
        value = v(key, default)
        refuse(isinstance(value, int) and not isinstance(value, bool) and value > 0, path, f"{key} = {value!r}",
                f"{key} must be a positive integer")
        return value

    def f(key: str, default: float) -> float:
        value = v(key, default)
        refuse(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, path,
                f"{key} = {value!r}", f"{key} must be a positive number")
        return float(value)

    def nonneg(key: str, default: float) -> float:
        value = v(key, default)
        refuse(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, path,
                f"{key} = {value!r}", f"{key} must be a non-negative number")
        return float(value)

    if arch in llamas:  # the llama architecture under their own model_types and options
        if arch in deepseek.FAMILIES:
            deepseek.refuse_unsupported(hf, path)
        d, n = i("hidden_size"), i("num_attention_heads")
        rope = hf.get("rope_parameters") or {}
        if "rope_theta" in rope:  # transformers 5 keeps it there
            hf = {**hf, "rope_theta": rope["rope_theta"]}
        scaling = hf.get("rope_scaling") or {}
        # transformers 5 writes the scaling into rope_parameters, 4.x into rope_scaling.
        scaling = rope if ("rope_type" in rope or "type" in rope) else scaling
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        refuse(rope_type in ("default", "linear", "llama3", "yarn"), path, f"RoPE type {rope_type!r}",
                "jaxpar implements the default, linear, llama3 and yarn rotary embeddings")
        refuse(rope_type == "yarn" or scaling.get("attention_factor") in (None, 1, 1.0), path,
                f"rope attention_factor = {scaling.get('attention_factor')!r}",
                "jaxpar's linear and llama3 RoPE leave the attention scale unchanged (attention_factor 1)")
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        refuse(v("hidden_act", "silu") == "silu", path, f"hidden_act = {hf.get('hidden_act')!r}",
                "jaxpar's llama MLP is SwiGLU with silu")
        refuse(not hf.get("attention_bias") and not hf.get("mlp_bias"), path, "attention_bias or mlp_bias",
                "jaxpar's llama architecture has biases only on q, k and v (qwen2), none on the output "
                "projection or the MLP")
        head_dim = i("head_dim", d // n)
        max_pos = i("max_position_embeddings", LLAMA_POSITIONS)
        fields = dict(n_layers=i("num_hidden_layers"), d_model=d, n_heads=n, n_kv_heads=i("num_key_value_heads", n),
                      d_ff=i("intermediate_size"), norm_eps=f("rms_norm_eps", 1e-6),
                      rope_theta=f("rope_theta", 10000.0), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                      head_dim=None if head_dim == d // n and d % n == 0 else head_dim,
                      qkv_bias=arch == "qwen2", qk_norm=arch in ("qwen3", "qwen3_moe"),
                      hf_model_type="mistral" if arch == "mistral" else None)
        if arch in moe.FAMILIES:
            fields.update(moe.config_fields(hf, path, arch, i, nonneg))
        if arch in deepseek.FAMILIES:
            fields.update(deepseek.config_fields(hf, path, fields["n_layers"], i, nonneg, rope_type, scaling))
        if rope_type != "default":
            sv = lambda key: _value({**scaling, "model_type": f"{arch} with {rope_type} RoPE"}, path, key)  # noqa: E731
            fields.update(rope_scaling=rope_type, rope_factor=float(sv("factor")))
        if rope_type == "llama3":
            fields.update(rope_low_freq_factor=float(sv("low_freq_factor")),
                          rope_high_freq_factor=float(sv("high_freq_factor")),
                          rope_original_context=int(sv("original_max_position_embeddings")))
        if rope_type == "yarn":
            fields.update(_yarn_fields(scaling, path, fields["rope_factor"], int(sv("original_max_position_embeddings"))))
        # Full causal attention equals a sliding window of W tokens on sequences of at most W.
        default_len = min(max_pos, LLAMA_SEQ_CAP, window or max_pos)
        refuse(window is None or seq_len is None or window >= seq_len, path, f"sliding_window = {window}",
                f"jaxpar's attention is full causal attention, which equals a sliding window only when the window "
                f"covers the sequence (seq_len = {seq_len}); choose seq_len <= {window}")
    else:
        d = i("n_embd")
        act = v("activation_function", "gelu_new")
        refuse(act in ("gelu_new", "gelu_pytorch_tanh"), path, f"activation_function = {act!r}",
                "jaxpar's gpt2 MLP uses the tanh approximation of GELU (gelu_new)")
        refuse(v("scale_attn_weights", True) and not hf.get("scale_attn_by_inverse_layer_idx")
                and not hf.get("add_cross_attention"), path,
                "scale_attn_weights = false, scale_attn_by_inverse_layer_idx or add_cross_attention",
                "jaxpar's gpt2 attention is plain causal self-attention scaled by 1/sqrt(head_dim)")
        refuse(hf.get("tie_word_embeddings", True), path, "tie_word_embeddings = false",
                "jaxpar's gpt2 ties its output projection to the token embedding")
        max_pos = i("n_positions", i("max_position_embeddings", 1024))
        fields = dict(n_layers=i("n_layer"), d_model=d, n_heads=i("n_head"), n_kv_heads=None,
                      d_ff=i("n_inner", 4 * d), norm_eps=f("layer_norm_epsilon", 1e-5))
        default_len = max_pos
        if seq_len is not None and seq_len > max_pos:
            raise HFError(f"seq_len = {seq_len} exceeds the {max_pos} positions of {path!r}, and gpt2's learned "
                          f"position embedding (wpe) covers only those {max_pos}; keep model.seq_len <= {max_pos}.")
    if "initializer_range" in hf:
        fields["init_std"] = f("initializer_range", 0.02)
    cfg = ModelConfig(arch="gpt2" if arch == "gpt2" else "llama", vocab_size=i("vocab_size"), vocab_multiple=vocab_multiple,
                      seq_len=default_len if seq_len is None else seq_len, **fields)
    try:
        validate(Config(model=cfg))
    except ConfigError as e:
        raise HFError(f"{path!r} describes a model jaxpar cannot build: {e}") from None
    return cfg


def _yarn_fields(scaling: dict[str, Any], path: str, factor: float, original: int) -> dict[str, Any]:
    """The ModelConfig fields of a yarn rope_scaling (or rope_parameters) besides its factor, read as
    transformers' _compute_yarn_parameters reads them: beta_fast and beta_slow 32 and 1 when absent
    (or 0), truncate true when absent; attention_factor as written, else from mscale and
    mscale_all_dim when both are set (DeepSeek-V3), else null (0.1 ln(factor) + 1)."""
    def number(key: str) -> float | None:
        value = scaling.get(key)
        refuse(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0),
                path, f"rope {key} = {value!r}", f"{key} must be a non-negative number")
        return None if value is None else float(value)

    truncate = scaling.get("truncate", True)
    refuse(isinstance(truncate, bool), path, f"rope truncate = {truncate!r}", "truncate must be true or false")
    attention, mscale, mscale_all_dim = number("attention_factor"), number("mscale"), number("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        get = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731 (yarn_get_mscale)
        attention = float(get(mscale) / get(mscale_all_dim))
    return dict(rope_original_context=original, rope_beta_fast=number("beta_fast") or 32.0,
                rope_beta_slow=number("beta_slow") or 1.0, rope_truncate=truncate, rope_attention_factor=attention)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json of a jaxpar model (the keys both transformers 4.45+ and 5 read)."""
    dtype = cfg.param_dtype
    if cfg.arch == "llama" and cfg.mla:
        return deepseek.config_keys(cfg, _positions(cfg), _rope_scaling(cfg))
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
            "hidden_act": "silu", "max_position_embeddings": _positions(cfg), "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": _rope_scaling(cfg), "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": cfg.tied, "initializer_range": cfg.init_std, "torch_dtype": dtype,
        }
        if family == "qwen2":
            del out["attention_bias"]  # not a Qwen 2 key: its q, k, v always have biases
        if family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
        if family == "mistral":
            out["sliding_window"] = None
        return moe.config_keys(cfg, out) if cfg.moe else out
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model, "n_inner": cfg.d_ff, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
        "n_positions": cfg.seq_len, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
        "scale_attn_weights": True, "tie_word_embeddings": True, "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
    }


def _positions(cfg: ModelConfig) -> int:
    """config.json's max_position_embeddings: seq_len, or under yarn at least the scaled context
    (factor x original), as YaRN checkpoints write it (transformers 4.x derives yarn's factor from
    the two when both are present)."""
    if cfg.rope_scaling == "yarn":
        return max(cfg.seq_len, round(cfg.rope_factor * cfg.rope_context))
    return cfg.seq_len


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """config.json's rope_scaling of `cfg` (transformers 4.x reads it; 5 reads it into rope_parameters)."""
    if cfg.rope_scaling == "none":
        return None
    out = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                   original_max_position_embeddings=cfg.rope_context)
    if cfg.rope_scaling == "yarn":  # the optional keys only where they differ from transformers' defaults
        out["original_max_position_embeddings"] = cfg.rope_context
        for key, value, default in (("beta_fast", cfg.rope_beta_fast, 32.0), ("beta_slow", cfg.rope_beta_slow, 1.0),
                                    ("truncate", cfg.rope_truncate, True),
                                    ("attention_factor", cfg.rope_attention_factor, None)):
            if value != default:
                out[key] = value
    return out


_MATCHED = ("arch", "n_layers", "d_model", "n_heads", "kv_heads", "head_size", "n_experts", "experts_per_token",
            "expert_width", "n_shared_experts", "router", "router_norm_topk", "router_groups", "router_topk_groups",
            "router_scaling", "moe_pattern", "d_ff", "vocab_size", "norm_eps", "tied", "qkv_bias", "qk_norm",
            "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_theta",
            "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_context",
            "rope_beta_fast", "rope_beta_slow", "rope_truncate", "rope_attention_factor", "rope_mscale_all_dim")
# Keys compared as the model uses them, set through another field (null there: derived from others).
_SET_BY = {"kv_heads": "n_kv_heads", "head_size": "head_dim", "tied": "tie_embeddings", "expert_width": "expert_d_ff",
           "moe_pattern": "moe_layers", "rope_context": "rope_original_context"}
# The RoPE keys each scaling uses (the others are compared with nothing).
# (rope_mscale_all_dim: MLA's softmax scale under any scaling, as transformers' yarn_apply_mscale.)
_ROPE_KEYS = {"none": ("rope_theta", "rope_scaling"),
              "linear": ("rope_theta", "rope_scaling", "rope_factor", "rope_mscale_all_dim"),
              "llama3": ("rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                         "rope_context", "rope_mscale_all_dim"),
              "yarn": ("rope_theta", "rope_scaling", "rope_factor", "rope_context", "rope_beta_fast", "rope_beta_slow",
                       "rope_truncate", "rope_attention_factor", "rope_mscale_all_dim")}


def trained_length(folder: str) -> int:
    """The context length a folder's model was trained at: config.json's max_position_embeddings
    (gpt2: n_positions)."""
    hf = read_hf_config(folder)
    if hf.get("model_type") == "gpt2":
        return hf.get("n_positions") or hf.get("max_position_embeddings") or 1024
    return hf.get("max_position_embeddings") or LLAMA_POSITIONS


def check_matches(cfg: ModelConfig, folder: str) -> ModelConfig:
    """The folder's ModelConfig, after checking that `cfg` describes the same function (shapes,
    norm epsilon, RoPE base and scaling, tie, q/k/v biases and norms; a gpt2 seq_len within the
    folder's learned positions); raises one HFError listing every setting that differs otherwise.

    Context extension: a llama-architecture `cfg` may have a longer seq_len than the folder's
    max_position_embeddings (`trained_length`), and then its own RoPE settings (a larger
    rope_theta, a linear, llama3 or yarn scaling), which the continued training adapts to. At or
    below the folder's length a RoPE change would silently alter the trained function: refused.

    A derived value (the head width, KV heads, tie, expert width) is listed only if it still
    differs once the settings it derives from take the folder's values: d_model = 128 against 64
    is one difference, not also a head_dim one."""
    hf_cfg = config_from_hf(folder)
    path = os.path.join(folder, "config.json")
    extending = cfg.arch == hf_cfg.arch == "llama" and cfg.seq_len > trained_length(folder)

    def compared(key: str) -> bool:
        if key.startswith("rope") and (cfg.arch != "llama" or extending or key not in _ROPE_KEYS[hf_cfg.rope_scaling]):
            return False
        if key == "d_ff" and hf_cfg.moe and not hf_cfg.mixed:  # every MLP is MoE: d_ff is unused
            return False
        if key in ("experts_per_token", "expert_width", "n_shared_experts", "router", "router_norm_topk",
                   "router_groups", "router_topk_groups", "router_scaling", "moe_pattern") and not hf_cfg.moe:  # both dense (n_experts matched): the MoE keys are unused
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
        config_from_hf(folder, seq_len=cfg.seq_len)  # raises past gpt2's positions or a sliding window
    except HFError:
        if not diffs or cfg.seq_len <= hf_cfg.seq_len:  # alone, or another problem: its own sentence
            raise
        seq_ok = False
    if diffs or not seq_ok:
        items = [f"model.{k} = {got!r} (folder: {want!r})" for k, (got, want) in diffs.items()]
        if not seq_ok:
            items.append(f"model.seq_len = {cfg.seq_len} (folder: at most {hf_cfg.seq_len})")
        n = len(items)
        sets = " ".join(f"--set model.{k}={'null' if want is None else want}" for k, (_, want) in diffs.items())
        if not seq_ok:
            sets += f" --set model.seq_len={hf_cfg.seq_len}"
        raise HFError(f"{n} setting{'s' if n > 1 else ''} of the model section differ{'s' if n == 1 else ''} from "
                      f"{path!r}: {', '.join(items)}; set {'them' if n > 1 else 'it'} to the folder's "
                      f"value{'s' if n > 1 else ''} (`{sets.strip()}`) or start from another folder.")
    return hf_cfg
