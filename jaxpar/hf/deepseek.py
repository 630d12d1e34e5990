"""The DeepSeek-V3 family of `jaxpar.hf`: `deepseek_v3` folders (DeepseekV3ForCausalLM), and
`kimi_k2` ones, which have the same architecture and tensors and are read the same way (export
always writes `deepseek_v3`).

The llama architecture with multi-head latent attention (`jaxpar.model.layers.LatentAttention`)
and, after `first_k_dense_replace` dense layers, MoE layers with the sigmoid router and its
balancing bias (`e_score_correction_bias` is the float32 `router_bias` leaf), expert groups
(`n_group`, `topk_group`), `routed_scaling_factor` and shared experts of width
n_shared_experts x moe_intermediate_size.

Rotary columns: with `rope_interleave` (true in DeepSeek's and Kimi's checkpoints and by default
in transformers) each rotary part is laid out in interleaved pairs (x0, x1), (x2, x3), ..., each
pair turned by one frequency; jaxpar rotates halves (x_j with x_{j + dr/2}). Import takes jaxpar's
rotary column j from HF column `ROPE_ORDER[j]` = [0, 2, 4, ..., 1, 3, 5, ...][j] of each query
head's last qk_rope_head_dim rows (q_proj or q_b_proj) and of kv_a_proj_with_mqa's last
qk_rope_head_dim rows; transformers' `apply_rotary_pos_emb_interleave` computes exactly the
half-rotation of those columns, so the logits are the same. Export writes the inverse and
`rope_interleave: true`; a folder with `rope_interleave: false` is read without permutation.

Multi-token prediction: DeepSeek-V3's checkpoints hold module k as layer num_hidden_layers + k
(`model.layers.61.*`): a decoder layer, `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`, and copies
of the embedding (`embed_tokens`) and the head (`shared_head.head`). A model with `mtp_depth` D reads
the first D such layers into `mtp` (the copies are not read: the model's own are shared), and
export writes them, the copies included, with `num_nextn_predict_layers` D (transformers builds no
MTP module and does not load them). With fewer modules than the folder holds, the import skips
the rest with a warning; a folder saved by transformers holds none.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jaxpar.config import ModelConfig
from jaxpar.hf.common import Entry, HFError, refuse

FAMILIES = ("deepseek_v3", "kimi_k2")
# Read kinds of this family (see `read`): heads with their rotary rows permuted, and
# kv_a_proj_with_mqa with its rotary rows permuted.
KINDS = ("rope_heads_in", "rope_t")


def rope_order(dr: int) -> np.ndarray:
    """HF's column of each of jaxpar's dr rotary columns: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])


def interleaved(hf_cfg: dict) -> bool:
    """Does a deepseek_v3 config.json lay the rotary columns out in pairs (`rope_interleave`,
    transformers' default true)?"""
    value = hf_cfg.get("rope_interleave")
    return True if value is None else value


# --------------------------------------------------------------------------------------------
# config.json


def refuse_unsupported(hf: dict, path: str) -> None:
    """One sentence for each setting of a deepseek_v3 config.json that jaxpar computes otherwise."""
    quant = hf.get("quantization_config")
    refuse(not quant, path, f"quantization_config = {quant!r}",
           "jaxpar reads unquantized weights (bfloat16 or float32), not fp8 blocks with their weight_scale_inv "
           "tensors; dequantize the checkpoint first (DeepSeek's inference/fp8_cast_bf16.py) and remove "
           "quantization_config")
    scoring = hf.get("scoring_func")
    refuse(scoring in (None, "sigmoid"), path, f"scoring_func = {scoring!r}",
           "jaxpar's sigmoid_bias router scores experts by sigmoid, as DeepSeek-V3 does; use a checkpoint with "
           "scoring_func sigmoid")
    method = hf.get("topk_method")
    refuse(method in (None, "noaux_tc"), path, f"topk_method = {method!r}",
           "jaxpar routes as DeepSeek-V3's noaux_tc (top-k on score + bias inside the best groups); use a "
           "checkpoint with topk_method noaux_tc")
    freq = hf.get("moe_layer_freq")
    refuse(freq in (None, 1), path, f"moe_layer_freq = {freq!r}",
           "jaxpar reads first_k_dense_replace dense layers followed by MoE layers only (moe_layer_freq 1); use a "
           "checkpoint whose every layer after the dense ones is MoE")
    refuse(not hf.get("attention_bias"), path, "attention_bias = true",
           "jaxpar's multi-head latent attention has no biases (q_a_proj, kv_a_proj_with_mqa and o_proj); use a "
           "checkpoint with attention_bias false")
    n, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    refuse(kv is None or kv == n, path, f"num_key_value_heads = {kv!r} with num_attention_heads = {n!r}",
           "multi-head latent attention expands keys and values for every head (DeepSeek-V3 writes the two "
           f"equal); set num_key_value_heads to {n}")
    dn, dr, dv = hf.get("qk_nope_head_dim"), hf.get("qk_rope_head_dim"), hf.get("v_head_dim")
    if all(isinstance(x, int) for x in (dn, dr, dv)):
        refuse(dv <= dn + dr, path, f"v_head_dim = {dv}",
               f"jaxpar pads the value heads to the query width qk_nope_head_dim + qk_rope_head_dim = {dn + dr}, "
               f"so v_head_dim may not exceed it; use a checkpoint with v_head_dim <= {dn + dr}")
    value = hf.get("rope_interleave")
    refuse(value is None or isinstance(value, bool), path, f"rope_interleave = {value!r}",
           "rope_interleave must be true or false")
    norm = hf.get("norm_topk_prob")
    refuse(norm is None or isinstance(norm, bool), path, f"norm_topk_prob = {norm!r}",
           "norm_topk_prob must be true or false")


def config_fields(hf: dict, path: str, n_layers: int, i, number, rope_type: str, scaling: dict) -> dict[str, Any]:
    """The ModelConfig fields of a deepseek_v3 / kimi_k2 config.json beyond the llama ones (`i`
    reads a positive integer key, `number` a non-negative number, both with optional defaults
    where transformers' DeepseekV3Config has them). The router's balancing loss is off
    (router_aux_loss 0): DeepSeek-V3 balances by the bias (aux_loss_alpha, a key of DeepSeek's own
    code that its V3 model never reads, is ignored)."""
    dn, dr, dv = i("qk_nope_head_dim", 128), i("qk_rope_head_dim", 64), i("v_head_dim", 128)
    q_rank = hf.get("q_lora_rank", 1536)
    refuse(q_rank is None or (isinstance(q_rank, int) and not isinstance(q_rank, bool) and q_rank > 0), path,
           f"q_lora_rank = {q_rank!r}", "q_lora_rank must be a positive integer, or null for a direct query projection")
    fields: dict[str, Any] = dict(kv_lora_rank=i("kv_lora_rank", 512), q_lora_rank=q_rank, qk_nope_head_dim=dn,
                                  qk_rope_head_dim=dr, v_head_dim=dv, n_kv_heads=None, head_dim=None,
                                  qkv_bias=False, qk_norm=False, d_ff=i("intermediate_size", 18432))
    if rope_type != "default" and scaling.get("mscale_all_dim"):
        m = scaling["mscale_all_dim"]
        refuse(isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0, path,
               f"rope mscale_all_dim = {m!r}", "mscale_all_dim must be a positive number")
        fields["rope_mscale_all_dim"] = float(m)
    dense = hf.get("first_k_dense_replace", 3)
    refuse(isinstance(dense, int) and not isinstance(dense, bool) and dense >= 0, path,
           f"first_k_dense_replace = {dense!r}", "first_k_dense_replace must be a non-negative integer")
    if dense >= n_layers:  # every layer dense: no MoE keys are read
        return fields
    shared = hf.get("n_shared_experts", 1)
    refuse(isinstance(shared, int) and not isinstance(shared, bool) and shared >= 1, path,
           f"n_shared_experts = {shared!r}", "jaxpar reads DeepSeek-V3's MoE layers with at least one shared expert "
           "(transformers builds them always); use a checkpoint with n_shared_experts >= 1")
    norm = hf.get("norm_topk_prob", True)
    fields.update(n_experts=i("n_routed_experts", 256), experts_per_token=i("num_experts_per_tok", 8),
                  expert_d_ff=i("moe_intermediate_size", 2048), n_shared_experts=shared, router="sigmoid_bias",
                  router_norm_topk=True if norm is None else norm, router_groups=i("n_group", 8),
                  router_topk_groups=i("topk_group", 4), router_scaling=number("routed_scaling_factor", 2.5),
                  moe_layers="all" if dense == 0 else f"first_dense:{dense}", router_aux_loss=0.0, router_z_loss=0.0)
    refuse(fields["router_scaling"] > 0, path, f"routed_scaling_factor = {fields['router_scaling']}",
           "routed_scaling_factor must be positive")
    return fields


def refuse_export(cfg: ModelConfig) -> None:
    """HFError for an MLA model with an option deepseek_v3 does not have."""
    def need(ok: bool, what: str, fix: str) -> None:
        if not ok:
            raise HFError(f"{what} has no place in a deepseek_v3 folder, the Hugging Face family of multi-head "
                          f"latent attention; {fix}.")

    need(not cfg.qk_norm, "model.qk_norm with model.kv_lora_rank", "export a model with qk_norm=false")
    need(not cfg.qkv_bias, "model.qkv_bias with model.kv_lora_rank", "export a model with qkv_bias=false")
    if cfg.moe:
        need(cfg.router == "sigmoid_bias", f"model.router = {cfg.router}",
             "DeepSeek-V3 routes by sigmoid with a balancing bias: export a model with router=sigmoid_bias")
        need(cfg.moe_pattern[1] == 1, f"model.moe_layers = {cfg.moe_layers}",
             "DeepSeek-V3 has first_k_dense_replace dense layers and then only MoE layers: export a model with "
             "moe_layers=all or first_dense:K")
        need(cfg.n_shared_experts >= 1, f"model.n_shared_experts = {cfg.n_shared_experts}",
             "DeepSeek-V3's MoE layers always have shared experts: export a model with n_shared_experts >= 1")


def config_keys(cfg: ModelConfig, positions: int, rope_scaling: dict | None) -> dict[str, Any]:
    """config.json of an MLA model as deepseek_v3 (the keys transformers 5 and 4.x read)."""
    refuse_export(cfg)
    if rope_scaling is not None and cfg.rope_mscale_all_dim:
        rope_scaling = {**rope_scaling, "mscale_all_dim": cfg.rope_mscale_all_dim}
    out = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
        "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "hidden_act": "silu",
        "max_position_embeddings": positions, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling, "rope_interleave": True, "attention_bias": False,
        "tie_word_embeddings": cfg.tied, "initializer_range": cfg.init_std, "torch_dtype": cfg.param_dtype,
        # Multi-token prediction's modules, written as the layers after the model's (`mtp_entries`).
        "num_nextn_predict_layers": cfg.mtp_depth,
        # Keys of DeepSeek's own code, for the readers that check them.
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    }
    if cfg.moe:
        out.update(n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.expert_width, n_shared_experts=cfg.n_shared_experts,
                   n_group=cfg.router_groups, topk_group=cfg.router_topk_groups,
                   routed_scaling_factor=cfg.router_scaling, norm_topk_prob=cfg.router_norm_topk,
                   first_k_dense_replace=cfg.moe_pattern[0])
    else:  # every layer dense: first_k_dense_replace covers them all (the MoE keys build nothing)
        out.update(n_routed_experts=1, num_experts_per_tok=1, moe_intermediate_size=cfg.d_ff, n_shared_experts=1,
                   n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                   first_k_dense_replace=cfg.n_layers)
    return out


# --------------------------------------------------------------------------------------------
# Tensors


def entries(cfg: ModelConfig, fused: bool, interleave: bool = True) -> list[Entry]:
    """The entries of an MLA model (one stack: all dense, or all MoE; `tensors.entries` splits a
    mixed model); `fused`: experts stored as transformers 5 holds them; `interleave`: the folder's
    rope_interleave."""
    D, N, V = cfg.d_model, cfg.n_heads, cfg.vocab_size
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    r_kv, r_q = cfg.kv_lora_rank, cfg.q_lora_rank
    H = dn + dr
    a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    heads, t = ("rope_heads_in", "rope_t") if interleave else ("heads_in", "t")
    q = [Entry(("blocks", "attn", "wq"), a + "q_proj.weight", heads, (N * H, D), head=H)] if r_q is None else [
        Entry(("blocks", "attn", "wq_a"), a + "q_a_proj.weight", "t", (r_q, D)),
        Entry(("blocks", "attn", "q_norm"), a + "q_a_layernorm.weight", "same", (r_q,)),
        Entry(("blocks", "attn", "wq_b"), a + "q_b_proj.weight", heads, (N * H, r_q), head=H)]
    attn = [
        *q,
        Entry(("blocks", "attn", "wkv_a"), a + "kv_a_proj_with_mqa.weight", t, (r_kv + dr, D), head=r_kv),
        Entry(("blocks", "attn", "kv_norm"), a + "kv_a_layernorm.weight", "same", (r_kv,)),
        Entry(("blocks", "attn", "wkv_b"), a + "kv_b_proj.weight", "heads_in", (N * (dn + dv), r_kv), head=dn + dv),
        Entry(("blocks", "attn", "wo"), a + "o_proj.weight", "heads_out", (D, N * dv), head=dv),
    ]
    if cfg.moe:
        E, F, S = cfg.n_experts, cfg.expert_width, cfg.n_shared_experts * cfg.expert_width
        if fused:
            experts = [Entry(("blocks", "mlp", "w_gate"), m + "experts.gate_up_proj", "fused_t", (E, 2 * F, D)),
                       Entry(("blocks", "mlp", "w_up"), m + "experts.gate_up_proj", "fused_t", (E, 2 * F, D), F),
                       Entry(("blocks", "mlp", "w_down"), m + "experts.down_proj", "fused_t", (E, D, F))]
        else:
            experts = [Entry(("blocks", "mlp", "w_gate"), m + "experts.{e}.gate_proj.weight", "experts_t", (F, D)),
                       Entry(("blocks", "mlp", "w_up"), m + "experts.{e}.up_proj.weight", "experts_t", (F, D)),
                       Entry(("blocks", "mlp", "w_down"), m + "experts.{e}.down_proj.weight", "experts_t", (D, F))]
        mlp = [Entry(("blocks", "mlp", "router"), m + "gate.weight", "t", (E, D)),
               Entry(("blocks", "mlp", "router_bias"), m + "gate.e_score_correction_bias", "same", (E,)),
               *experts,
               Entry(("blocks", "mlp", "shared_gate"), m + "shared_experts.gate_proj.weight", "t", (S, D)),
               Entry(("blocks", "mlp", "shared_up"), m + "shared_experts.up_proj.weight", "t", (S, D)),
               Entry(("blocks", "mlp", "shared_down"), m + "shared_experts.down_proj.weight", "t", (D, S))]
    else:
        F = cfg.d_ff
        mlp = [Entry(("blocks", "mlp", "w_gate"), m + "gate_proj.weight", "t", (F, D)),
               Entry(("blocks", "mlp", "w_up"), m + "up_proj.weight", "t", (F, D)),
               Entry(("blocks", "mlp", "w_down"), m + "down_proj.weight", "t", (D, F))]
    return [
        Entry(("embed",), "model.embed_tokens.weight", "same", (V, D)),
        Entry(("blocks", "attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight", "same", (D,)),
        *attn,
        Entry(("blocks", "mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", "same", (D,)),
        *mlp,
        Entry(("final_norm", "scale"), "model.norm.weight", "same", (D,)),
    ] + ([] if cfg.tied else [Entry(("lm_head",), "lm_head.weight", "t", (V, D))])


def _take_rows(get, name: str, rows: np.ndarray, cols: slice) -> np.ndarray:
    """hf[rows, cols] for any row indices, read as few contiguous spans of exactly those rows."""
    order = np.argsort(rows, kind="stable")
    s = rows[order]
    cuts = np.flatnonzero(np.diff(s) != 1) + 1
    parts = [get(name, (slice(int(r[0]), int(r[-1]) + 1), cols)) for r in np.split(s, cuts)]
    x = np.concatenate(parts) if len(parts) > 1 else parts[0]
    out = np.empty_like(x)
    out[order] = x
    return out


def read(e: Entry, name: str, get, idx: tuple[slice, ...], dr: int) -> np.ndarray:
    """The slice `idx` of one layer's leaf of a rope kind, reading only the HF rows it needs
    (the rotary rows in jaxpar's half-rotation order)."""
    if e.kind == "rope_t":  # jaxpar [D, r_kv + dr] from HF [r_kv + dr, D]
        d, c = idx
        src = np.concatenate([np.arange(e.head), e.head + rope_order(dr)])
        return _take_rows(get, name, src[c], d).T
    if e.kind == "rope_heads_in":  # jaxpar [in, N, H] from HF [(N H), in]
        d, n, h = idx
        H = e.head
        src = np.concatenate([np.arange(H - dr), H - dr + rope_order(dr)])
        rows = (np.arange(n.start, n.stop)[:, None] * H + src[h][None, :]).reshape(-1)
        x = _take_rows(get, name, rows, d)
        return x.reshape(n.stop - n.start, h.stop - h.start, -1).transpose(2, 0, 1)
    raise AssertionError(e.kind)


def write(e: Entry, x: np.ndarray, dr: int) -> np.ndarray:
    """One layer's HF tensor of a rope kind from its jaxpar leaf (the rotary rows interleaved back)."""
    if e.kind == "rope_t":
        src = np.concatenate([np.arange(e.head), e.head + rope_order(dr)])
        out = np.empty_like(x)
        out[:, src] = x
        return out.T
    if e.kind == "rope_heads_in":
        H = e.head
        src = np.concatenate([np.arange(H - dr), H - dr + rope_order(dr)])
        out = np.empty_like(x)
        out[..., src] = x
        return out.reshape(x.shape[0], -1).T
    raise AssertionError(e.kind)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def beyond(cfg: ModelConfig, name: str) -> bool:
    """Is `name` a tensor of a checkpoint layer past the model's and its MTP modules' (DeepSeek-V3's
    multi-token prediction module, `model.layers.61.*`, when `mtp_depth` is 0), which the import
    skips?"""
    m = _LAYER.match(name)
    return m is not None and int(m[1]) >= cfg.n_layers + cfg.mtp_depth


# The MTP layers' copies of the embedding and the head: written on export, not read (shared).
COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_entries(cfg: ModelConfig, block_entries: list[Entry]) -> list[Entry]:
    """The entries of the `mtp_depth` modules: the MTP leaves of depth k from layer n_layers + k,
    the block's from `block_entries` (one MoE or dense layer's entries) moved under `mtp`."""
    D, d = cfg.d_model, cfg.mtp_depth
    layers = tuple(range(cfg.n_layers, cfg.n_layers + d))
    own = [Entry(("mtp", "enorm"), "model.layers.{i}.enorm.weight", "same", (D,), layers=layers),
           Entry(("mtp", "hnorm"), "model.layers.{i}.hnorm.weight", "same", (D,), layers=layers),
           Entry(("mtp", "eh_proj"), "model.layers.{i}.eh_proj.weight", "t", (D, 2 * D), layers=layers),
           Entry(("mtp", "norm"), "model.layers.{i}.shared_head.norm.weight", "same", (D,), layers=layers)]
    return own + [e._replace(path=("mtp", *e.path), layers=layers) for e in block_entries if e.path[0] == "blocks"]


def is_copy(cfg: ModelConfig, name: str) -> bool:
    """Is `name` an MTP layer's copy of the embedding or the head (not read)?"""
    m = _LAYER.match(name)
    return (m is not None and cfg.n_layers <= int(m[1]) < cfg.n_layers + cfg.mtp_depth
            and name[m.end():] in COPIES)
