"""Model presets of `python -m jaxpar.plan` (`--preset`): published model shapes, the `model`
section of a config plus a typical global batch. The hardware presets (`--hardware`, datasheet
figures) are `jaxpar.hardware.HARDWARE`.
"""

from __future__ import annotations


def _model(arch, L, D, N, F, V, S, K=None, theta=10000.0, batch=512, **options):
    return {"model": {"arch": arch, "n_layers": L, "d_model": D, "n_heads": N, "n_kv_heads": K, "d_ff": F,
                      "vocab_size": V, "seq_len": S, "dtype": "bfloat16", "rope_theta": theta, **options},
            "train": {"global_batch": batch}}


# Llama 3.1's RoPE scaling, as its config.json states it.
_LLAMA31 = dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                rope_original_context=8192)


# DeepSeek-V3's and Kimi K2's multi-head latent attention.
_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


# name -> (description, config sections). Batches are typical of each model's published run,
# in sequences (about 0.5M tokens for GPT-2, 1-4M for the larger models).
MODELS = {
    "gpt2-small": ("GPT-2 small (124M)", _model("gpt2", 12, 768, 12, 3072, 50257, 1024)),
    "gpt2-medium": ("GPT-2 medium (350M)", _model("gpt2", 24, 1024, 16, 4096, 50257, 1024)),
    "gpt2-large": ("GPT-2 large (774M)", _model("gpt2", 36, 1280, 20, 5120, 50257, 1024)),
    "gpt2-xl": ("GPT-2 XL (1.5B)", _model("gpt2", 48, 1600, 25, 6400, 50257, 1024)),
    "llama-1b": ("Llama-3.2-1B shape", _model("llama", 16, 2048, 32, 8192, 128256, 2048, K=8, theta=500000.0,
                                              batch=512)),
    "llama-7b": ("Llama-2-7B shape", _model("llama", 32, 4096, 32, 11008, 32000, 4096, batch=1024)),
    "llama-13b": ("Llama-2-13B shape", _model("llama", 40, 5120, 40, 13824, 32000, 4096, batch=1024)),
    "llama-70b": ("Llama-3-70B shape", _model("llama", 80, 8192, 64, 28672, 128256, 8192, K=8, theta=500000.0,
                                              batch=512)),
    # From each model's config.json on the Hugging Face hub (context: the training sequence
    # length of a fine-tuning run, not the 128K the scaled RoPE reaches).
    "llama-3.1-8b": ("Llama-3.1-8B shape", _model("llama", 32, 4096, 32, 14336, 128256, 8192, K=8, theta=500000.0,
                                                  batch=512, **_LLAMA31)),
    "llama-3.1-70b": ("Llama-3.1-70B shape", _model("llama", 80, 8192, 64, 28672, 128256, 8192, K=8,
                                                    theta=500000.0, batch=512, **_LLAMA31)),
    "qwen3-8b": ("Qwen3-8B shape", _model("llama", 36, 4096, 32, 12288, 151936, 4096, K=8, theta=1000000.0,
                                          batch=512, head_dim=128, qk_norm=True, norm_eps=1e-6)),
    "qwen3-32b": ("Qwen3-32B shape", _model("llama", 64, 5120, 64, 25600, 151936, 4096, K=8, theta=1000000.0,
                                            batch=512, head_dim=128, qk_norm=True, norm_eps=1e-6)),
    "mistral-7b": ("Mistral-7B-v0.3 shape", _model("llama", 32, 4096, 32, 14336, 32768, 4096, K=8, theta=1000000.0,
                                                   batch=512, norm_eps=1e-5)),
    "llama-405b": ("Llama-3.1-405B shape", _model("llama", 126, 16384, 128, 53248, 128256, 8192, K=8,
                                                  theta=500000.0, batch=2048)),
    # Mixture of experts (every layer's MLP an MoE layer). Mixtral-8x7B from its config.json: 8
    # experts of 14336, top-2, GQA 32/8, vocab 32000, rope theta 1e6.
    "mixtral-8x7b": ("Mixtral-8x7B shape", _model("llama", 32, 4096, 32, 14336, 32000, 4096, K=8, theta=1000000.0,
                                                  batch=1024, n_experts=8, experts_per_token=2, norm_eps=1e-5)),
    # DeepSeek-V3 and Kimi K2 from their config.json: 61 layers of d 7168, multi-head latent
    # attention (q_lora 1536, kv_lora 512, heads of 128 + 64 rotary, values of 128), dense first
    # layers of 18432, then routed experts of 2048 + 1 shared, top-8, sigmoid router with the bias.
    # DeepSeek-V3: 128 heads, 3 dense layers, 256 experts in 8 groups (4 per token), scaling 2.5,
    # vocab 129280; Kimi K2: 64 heads, 1 dense layer, 384 experts (no groups), scaling 2.827,
    # vocab 163840. (Multi-token prediction, not built, is left out: DeepSeek-V3's 671 B excludes it.)
    "deepseek-v3": ("DeepSeek-V3 (671 B, 37 B active)",
                    _model("llama", 61, 7168, 128, 18432, 129280, 4096, batch=4096, n_experts=256,
                           experts_per_token=8, expert_d_ff=2048, n_shared_experts=1, router="sigmoid_bias",
                           moe_layers="first_dense:3", router_groups=8, router_topk_groups=4, router_scaling=2.5,
                           norm_eps=1e-6, **_MLA)),
    "kimi-k2": ("Kimi K2 (1.04 T, 32 B active)",
                _model("llama", 61, 7168, 64, 18432, 163840, 4096, batch=4096, n_experts=384, experts_per_token=8,
                       expert_d_ff=2048, n_shared_experts=1, router="sigmoid_bias", moe_layers="first_dense:1",
                       router_scaling=2.827, norm_eps=1e-6, **_MLA)),
    "gpt3-175b": ("GPT-3 175B", _model("gpt2", 96, 12288, 96, 49152, 50257, 2048, batch=1536)),
    # Megatron-LM's 530B configuration (Narayanan et al. 2021, table 1; the MT-NLG shape): 105
    # layers, hidden 20480, 128 heads, vocabulary 51200, 2048 tokens, batch 2520.
    "gpt-530b": ("530B-parameter GPT (Megatron-LM's / MT-NLG's shape)", _model("gpt2", 105, 20480, 128, 81920, 51200,
                                                                             2048, batch=2520)),
    # Megatron-LM's 1T configuration (Narayanan et al. 2021, table 1): 128 layers, hidden 25600,
    # 160 heads. Its 126 layers would not split over power-of-two pipelines; 128 do.
    "gpt-1t": ("1T-parameter GPT (Megatron-LM's 1T shape)", _model("gpt2", 128, 25600, 160, 102400, 51200, 2048,
                                                                  batch=3072)),
}
