"""The mixture-of-experts families of `jaxpar.hf`: Mixtral (`mixtral`) and Qwen3-MoE (`qwen3_moe`).

Both are the llama architecture whose every MLP is `jaxpar.model.moe`: a softmax router, top-k,
SwiGLU experts, no shared experts (Mixtral always renormalises the top-k weights, Qwen3-MoE when
`norm_topk_prob`; Qwen3-MoE adds Qwen 3's q/k norms). The router's HF weight is [E, D], each
expert's linear weights [out, in]; jaxpar stacks the experts: `router` [D, E], `w_gate` and
`w_up` [E, D, F], `w_down` [E, F, D] (and a leading `layers` dim).

Checkpoints store the experts one tensor per expert (`...experts.{e}.w1.weight` for Mixtral,
`...experts.{e}.gate_proj.weight` for Qwen3-MoE: the Hub's files, and what transformers 4 and 5
write) or fused, as transformers 5 holds them in memory and loads them too
(`mlp.experts.gate_up_proj` [E, 2F, D], gate rows first; `mlp.experts.down_proj` [E, D, F]).
Both are read, only the experts and rows a device holds; export writes one tensor per expert.
The `router_stats` leaf is a buffer, not a weight: zeros on import, never exported.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpar.config import ModelConfig
from jaxpar.hf.common import Entry, HFError, refuse

FAMILIES = ("mixtral", "qwen3_moe")
KINDS = ("experts_t", "fused_t")
# The leaves of an MoE model that no HF tensor holds: zeros on import, left out on export.
BUFFERS = (("blocks", "mlp", "router_stats"),)


def config_fields(hf_cfg: dict, path: str, arch: str, i, number) -> dict[str, Any]:
    """The MoE fields of the ModelConfig of a `mixtral` or `qwen3_moe` config.json (`i` reads a
    positive integer key, `number` a non-negative number key, both with optional defaults)."""
    if arch == "mixtral":
        n_experts, width, norm = i("num_local_experts"), i("intermediate_size"), True
    else:
        key = "num_experts" if hf_cfg.get("num_experts") is not None else "num_local_experts"
        n_experts, width = i(key), i("moe_intermediate_size")
        norm = hf_cfg.get("norm_topk_prob", False)
        refuse(isinstance(norm, bool), path, f"norm_topk_prob = {norm!r}", "norm_topk_prob must be true or false")
        pattern = _qwen_pattern(hf_cfg, path, i("num_hidden_layers"))
        if pattern != "all":  # dense layers among the MoE ones: an MLP of intermediate_size
            return dict(n_experts=n_experts, experts_per_token=i("num_experts_per_tok"), expert_d_ff=width,
                        d_ff=i("intermediate_size"), moe_layers=pattern, n_shared_experts=0, router="softmax",
                        router_norm_topk=norm, router_aux_loss=number("router_aux_loss_coef", 0.001), router_z_loss=0.0)
    # d_ff (a dense MLP's width) is unused when every MLP is MoE: the expert width keeps it valid.
    return dict(n_experts=n_experts, experts_per_token=i("num_experts_per_tok"), expert_d_ff=width, d_ff=width,
                n_shared_experts=0, router="softmax", router_norm_topk=norm,
                router_aux_loss=number("router_aux_loss_coef", 0.001), router_z_loss=0.0)


def _qwen_pattern(hf_cfg: dict, path: str, n_layers: int) -> str:
    """`model.moe_layers` of Qwen3-MoE's decoder_sparse_step and mlp_only_layers (layer i is MoE if
    it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0), where jaxpar's patterns
    (K dense layers, then every N-th MoE) can say it."""
    step, dense = hf_cfg.get("decoder_sparse_step", 1), hf_cfg.get("mlp_only_layers") or []
    refuse(isinstance(step, int) and step >= 1, path, f"decoder_sparse_step = {step!r}",
               "decoder_sparse_step must be a positive integer")
    refuse(isinstance(dense, list) and all(isinstance(x, int) for x in dense), path,
               f"mlp_only_layers = {dense!r}", "mlp_only_layers must be a list of layer indices")
    moe = {i for i in range(n_layers) if i not in dense and (i + 1) % step == 0}
    for K in range(n_layers):
        for N in range(1, n_layers - K + 1):
            if (n_layers - K) % N == 0 and moe == {i for i in range(K, n_layers) if (i - K + 1) % N == 0}:
                return "all" if (K, N) == (0, 1) else ",".join(
                    ([f"first_dense:{K}"] if K else []) + ([f"every:{N}"] if N > 1 else []))
    refuse(False, path, f"decoder_sparse_step = {step} with mlp_only_layers = {dense}",
               "jaxpar's model.moe_layers says K dense layers then every N-th layer MoE, which cannot make these "
               f"MoE layers ({sorted(moe)}); use a checkpoint whose MoE layers follow such a pattern")
    raise AssertionError


def family(cfg: ModelConfig) -> str:
    """The HF model_type an MoE model exports as (qwen3_moe with q/k norms, else mixtral); raises
    HFError for options neither family has."""
    def refuse_family(ok: bool, what: str, fix: str) -> None:
        if not ok:
            raise HFError(f"{what} has no Hugging Face MoE family jaxpar writes (mixtral, qwen3_moe); {fix}.")

    refuse_family(cfg.qk_norm or not cfg.mixed, f"model.moe_layers = {cfg.moe_layers} without model.qk_norm",
                  "Mixtral's every layer is MoE: export a model with moe_layers=all, or qk_norm=true (qwen3_moe)")
    refuse_family(cfg.n_shared_experts == 0, f"model.n_shared_experts = {cfg.n_shared_experts}",
                  "neither has shared experts: export a model with n_shared_experts=0")
    refuse_family(cfg.router == "softmax", f"model.router = {cfg.router}",
                  "both route by softmax: export a model with router=softmax")
    refuse_family(cfg.router_groups == 1, f"model.router_groups = {cfg.router_groups}",
                  "neither groups its experts: export a model with router_groups=1")
    refuse_family(cfg.router_scaling == 1.0, f"model.router_scaling = {cfg.router_scaling}",
                  "neither scales the expert weights: export a model with router_scaling=1")
    refuse_family(not cfg.qkv_bias, "model.qkv_bias with model.n_experts",
                  "neither has q, k, v biases: export a model with qkv_bias=false")
    refuse_family(cfg.qk_norm or cfg.router_norm_topk, "model.router_norm_topk = false without model.qk_norm",
                  "Mixtral always renormalises the top-k weights: set router_norm_topk=true, or qk_norm=true "
                  "(qwen3_moe)")
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


def config_keys(cfg: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
    """config.json of an MoE model from the llama one `out` (of the same shapes)."""
    fam = family(cfg)
    out = {k: v for k, v in out.items() if k not in ("attention_bias", "mlp_bias", "use_sliding_window")}
    common = {"model_type": fam, "num_experts_per_tok": cfg.experts_per_token,
              "router_aux_loss_coef": cfg.router_aux_loss, "output_router_logits": False, "sliding_window": None}
    if fam == "mixtral":
        return {**out, **common, "architectures": ["MixtralForCausalLM"], "num_local_experts": cfg.n_experts,
                "intermediate_size": cfg.expert_width, "router_jitter_noise": 0.0}
    return {**out, **common, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": cfg.n_experts,
            "moe_intermediate_size": cfg.expert_width, "norm_topk_prob": cfg.router_norm_topk,
            "decoder_sparse_step": 1, "use_sliding_window": False, "attention_bias": False,
            # A mixed model's dense layers by index (and their MLP width, intermediate_size = d_ff).
            "mlp_only_layers": [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)]}


def entries(cfg: ModelConfig, fused: bool) -> list:
    """The MLP entries of an MoE model: per-expert tensors, or the fused ones (`fused`)."""
    D, E, F = cfg.d_model, cfg.n_experts, cfg.expert_width
    fam = family(cfg)
    m = "model.layers.{i}.mlp." if fused or fam == "qwen3_moe" else "model.layers.{i}.block_sparse_moe."
    router = Entry(("blocks", "mlp", "router"), m + "gate.weight", "t", (E, D))
    if fused:
        return [router, Entry(("blocks", "mlp", "w_gate"), m + "experts.gate_up_proj", "fused_t", (E, 2 * F, D)),
                Entry(("blocks", "mlp", "w_up"), m + "experts.gate_up_proj", "fused_t", (E, 2 * F, D), F),
                Entry(("blocks", "mlp", "w_down"), m + "experts.down_proj", "fused_t", (E, D, F))]
    gate, up, down = ("w1", "w3", "w2") if fam == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    return [router, Entry(("blocks", "mlp", "w_gate"), m + f"experts.{{e}}.{gate}.weight", "experts_t", (F, D)),
            Entry(("blocks", "mlp", "w_up"), m + f"experts.{{e}}.{up}.weight", "experts_t", (F, D)),
            Entry(("blocks", "mlp", "w_down"), m + f"experts.{{e}}.{down}.weight", "experts_t", (D, F))]


def is_fused(cfg: ModelConfig, names) -> bool:
    """Does a checkpoint with these tensor names store the experts fused?"""
    first = next((i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)), 0)
    return cfg.moe and f"model.layers.{first}.mlp.experts.gate_up_proj" in names


def expert_names(cfg: ModelConfig, name: str) -> list[str]:
    return [name.replace("{e}", str(k)) for k in range(cfg.n_experts)] if "{e}" in name else [name]


def read(e, name: str, get, idx: tuple[slice, ...]) -> np.ndarray:
    """The slice idx = (experts, a, b) of one layer's [E, a, b] leaf from [b, a] per expert, or
    from the fused [E, (offset +) b, a]: only those experts, rows and columns are read."""
    x, a, b = idx
    if e.kind == "experts_t":
        return np.stack([get(name.replace("{e}", str(k)), (b, a)).T for k in range(x.start, x.stop)])
    if e.kind == "fused_t":
        return get(name, (x, slice(e.offset + b.start, e.offset + b.stop), a)).transpose(0, 2, 1)
    raise AssertionError(e.kind)


def write(e, name: str, x: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """One layer's per-expert HF tensors (name, [b, a]) from its [E, a, b] leaf."""
    if e.kind != "experts_t":  # export writes one tensor per expert
        raise AssertionError(e.kind)
    return [(name.replace("{e}", str(k)), x[k].T) for k in range(x.shape[0])]
