"""The rules a run configuration must satisfy that need only the config: `validate` (every one
that does not need the devices), the syntax of `runtime.xla_flags`, and `resolve_mesh_shape` (the
mesh sizes against a device count).

Each broken rule is one `ConfigError` sentence that names the value, the rule and a fix. The rules
that need the pipeline's tables or stage layouts (an axis's size against the model, the batch
against data x microbatches) are `jaxpar.parallel.checks`'; this module imports nothing of
jaxpar's model or parallel layers (only the plain-Python rule of which schedules place their
chunks in a V, `jaxpar.parallel.pipeline.placement`).
"""

from __future__ import annotations

import functools
import math
import re

from jaxpar.config.schema import Config, MeshConfig, ModelConfig
from jaxpar.errors import ConfigError
from jaxpar.parallel.pipeline.placement import placement_of


def require(ok: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `ok`."""
    if not ok:
        raise ConfigError(message)


@functools.lru_cache(maxsize=1024)  # (evaluated for a refusal's message, on every check)
def nearest_divisor(n: int, near: int) -> int:
    """The divisor of n nearest to `near` (the smaller on a tie): a fix a message proposes."""
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    return min(divisors, key=lambda k: (abs(k - near), k))


FLAG_TOKEN = re.compile(r"--(xla_[a-z0-9_]+)(?:=(\S*))?")
"""One flag as XLA_FLAGS spells it: `--name=value`, or `--name` (a boolean set true)."""


def syntax_error(text: str) -> str | None:
    """Why `text` is not `auto`, `none` or XLA flags (None when it is): config validation.
    (Whether the installed jaxlib registers each flag is `jaxpar.xla_flags`', when a run starts.)"""
    if text in ("auto", "none"):
        return None
    bad = [t for t in text.split() if not FLAG_TOKEN.fullmatch(t)]
    if not text.split() or bad:
        return (f"runtime.xla_flags = {text!r} must be auto, none, or XLA flags separated by spaces, each "
                f"--xla_name=value{f' (not {bad[0]!r})' if bad else ''}; e.g. "
                "'--xla_gpu_enable_latency_hiding_scheduler=true'.")
    return None


MOE_KERNELS = ("auto", "ragged_dot", "pallas")
MOE_EXCHANGES = ("auto", "fixed", "ragged")  # (`jaxpar.model.moe_exchange.EXCHANGES`)
"""`model.moe_kernel`'s values (the schema's Literal; checked again here for a ModelConfig built
without `from_dict`)."""


def _validate_moe(m: ModelConfig) -> None:
    """The mixture-of-experts keys (`model.n_experts` > 0)."""
    require(m.n_experts > 0, f"model.n_experts = {m.n_experts} must not be negative; set it to 0 for a dense MLP "
                             "or to the number of experts.")
    require(m.arch == "llama", f"model.n_experts = {m.n_experts} needs model.arch = llama (got {m.arch}); set "
                               "arch=llama or n_experts=0.")
    require(1 <= m.experts_per_token <= m.n_experts,
            f"model.experts_per_token = {m.experts_per_token} must be between 1 and model.n_experts = "
            f"{m.n_experts}; route each token to at most as many experts as there are.")
    require(m.expert_width > 0, f"model.expert_d_ff = {m.expert_d_ff} must be positive; set it, or null for d_ff.")
    require(m.n_shared_experts >= 0, f"model.n_shared_experts = {m.n_shared_experts} must not be negative; set "
                                     "it to 0 for none.")
    require(m.capacity_factor is None or m.capacity_factor > 0,
            f"model.capacity_factor = {m.capacity_factor} must be positive; set it to e.g. 1.25, or null for "
            "dropless routing.")
    K, N = m.moe_pattern
    require(N >= 1 and (m.n_layers - K) % N == 0 and m.n_layers - K >= N,
            f"model.moe_layers = {m.moe_layers} does not fit model.n_layers = {m.n_layers}: the layers after the "
            f"{K} dense ones must be whole groups of {N} (each ending in its MoE layer), at least one; change "
            "n_layers or the pattern.")
    if m.moe:
        E, G, K = m.n_experts, m.router_groups, m.router_topk_groups
        require(G >= 1 and E % G == 0 and (G == 1 or E // G >= 2),
                f"model.router_groups = {G} must divide model.n_experts = {E} into groups of at least 2 experts "
                "(a group is scored by its two best); set router_groups to a divisor of n_experts up to "
                f"{E // 2}, or 1 for no groups.")
        require(1 <= K <= G, f"model.router_topk_groups = {K} must lie in 1 .. model.router_groups = {G} (a token "
                             f"routes within that many of the groups); set router_topk_groups to at most {G}.")
        require(m.experts_per_token <= K * (E // G),
                f"model.experts_per_token = {m.experts_per_token} exceeds the {K * (E // G)} experts of "
                f"model.router_topk_groups = {K} groups of {E // G}; raise router_topk_groups or lower "
                "experts_per_token.")
        require(m.router_scaling > 0, f"model.router_scaling = {m.router_scaling} must be positive; set it to 1 "
                                      "(no scaling) or DeepSeek-V3's 2.5.")
    for key in ("router_aux_loss", "router_z_loss", "router_bias_rate"):
        require(getattr(m, key) >= 0, f"model.{key} = {getattr(m, key)} must not be negative; set it to 0 to "
                                      "turn it off.")


def _validate_mla(m: ModelConfig) -> None:
    """Multi-head latent attention's keys (`model.kv_lora_rank` and the head widths)."""
    given = [k for k in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if getattr(m, k) is not None]
    if not m.mla:
        require(not given, f"model.{given[0] if given else ''} is a key of multi-head latent attention, which "
                           "model.kv_lora_rank turns on; set kv_lora_rank, or remove it.")
        return
    require(m.arch == "llama", f"model.kv_lora_rank = {m.kv_lora_rank} (multi-head latent attention) is a key of "
                               f"the llama architecture (model.arch = {m.arch}); remove it for gpt2.")
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        require(getattr(m, key) is not None and getattr(m, key) > 0,
                f"model.{key} = {getattr(m, key)} must be a positive width with model.kv_lora_rank = "
                f"{m.kv_lora_rank} (multi-head latent attention); set it (DeepSeek-V3: 128, 64, 128).")
    for key in ("kv_lora_rank", "q_lora_rank"):
        require(getattr(m, key) is None or getattr(m, key) > 0,
                f"model.{key} = {getattr(m, key)} must be positive; set a width (DeepSeek-V3: 512 and 1536).")
    require(m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim = {m.qk_rope_head_dim} must be even for RoPE; "
                                         "set an even width (DeepSeek-V3: 64).")
    require(m.v_head_dim <= m.head_size,
            f"model.v_head_dim = {m.v_head_dim} exceeds qk_nope_head_dim + qk_rope_head_dim = {m.head_size} (the "
            "values are padded to the query and key width for the attention kernel); set v_head_dim to at most "
            f"{m.head_size}.")
    for key, value, why in (("n_kv_heads", m.n_kv_heads, "every head's keys and values come from the latent"),
                            ("head_dim", m.head_dim, "the head widths are qk_nope_head_dim, qk_rope_head_dim and "
                                                     "v_head_dim"),
                            ("qk_norm", m.qk_norm or None, "MLA normalises its latents instead"),
                            ("qkv_bias", m.qkv_bias or None, "MLA's projections have no biases")):
        require(value is None, f"model.{key} = {value} cannot be combined with model.kv_lora_rank = {m.kv_lora_rank} "
                               f"(multi-head latent attention: {why}); remove model.{key}.")


def validate(cfg: Config) -> None:
    """Check every rule that does not need the devices; raise one ConfigError for the first broken one."""
    m, mesh, par, tr = cfg.model, cfg.mesh, cfg.parallel, cfg.train
    for key in ("n_layers", "d_model", "n_heads", "d_ff", "vocab_size", "seq_len", "vocab_multiple"):
        require(getattr(m, key) > 0, f"model.{key} = {getattr(m, key)} must be positive; set it to a positive integer.")
    require(m.kv_heads > 0, f"model.n_kv_heads = {m.n_kv_heads} must be positive; set it to a divisor of "
                            f"n_heads, or null for n_heads.")
    require(m.head_dim is None or m.head_dim > 0,
            f"model.head_dim = {m.head_dim} must be positive; set it, or null for d_model / n_heads.")
    require(m.head_dim is not None or m.d_model % m.n_heads == 0,
            f"model.d_model = {m.d_model} is not divisible by model.n_heads = {m.n_heads}; "
            f"choose n_heads among the divisors of d_model (e.g. {nearest_divisor(m.d_model, m.n_heads)}).")
    require(m.n_heads % m.kv_heads == 0,
            f"model.n_heads = {m.n_heads} is not divisible by model.n_kv_heads = {m.kv_heads} "
            f"(each kv head serves a whole group of query heads); "
            f"choose n_kv_heads among the divisors of n_heads (e.g. {nearest_divisor(m.n_heads, m.kv_heads)}).")
    _validate_mla(m)
    if m.arch == "llama" and not m.mla:
        require(m.head_size % 2 == 0, f"head_dim = {m.head_size} must be even for RoPE; "
                                      "change model.head_dim, or d_model or n_heads.")
    require(m.arch == "llama" or not (m.qkv_bias or m.qk_norm or m.head_dim not in (None, m.d_model // m.n_heads)),
            f"model.qkv_bias, qk_norm and head_dim are keys of the llama architecture (model.arch = {m.arch}); "
            "remove them for gpt2.")
    require(m.arch != "gpt2" or m.tie_embeddings in (None, True),
            "model.tie_embeddings = false, but gpt2 ties its output projection to the token embedding; "
            "remove the key or set it to true.")
    require(m.rope_scaling in ("none", "linear", "llama3", "yarn"),
            f"model.rope_scaling = {m.rope_scaling!r} is not a RoPE scaling jaxpar implements; use none, "
            "linear, llama3 or yarn.")
    if m.rope_scaling != "none":
        require(m.arch == "llama", f"model.rope_scaling = {m.rope_scaling} needs model.arch = llama (got {m.arch}, "
                                   "which has learned positions); set rope_scaling=none.")
        require(m.rope_factor >= 1, f"model.rope_factor = {m.rope_factor} must be at least 1 (it divides RoPE's "
                                    "frequencies); set it to the checkpoint's factor, e.g. 8.")
    if m.rope_scaling == "llama3":
        require(0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
                f"model.rope_low_freq_factor = {m.rope_low_freq_factor} and rope_high_freq_factor = "
                f"{m.rope_high_freq_factor} must satisfy 0 < low < high; set them to the checkpoint's (Llama 3.1: 1 and 4).")
        require(m.rope_context > 0, f"model.rope_original_context = {m.rope_original_context} must be "
                                    "positive; Llama 3.1 uses 8192.")
    if m.rope_scaling == "yarn":
        require(m.rope_original_context is not None,
                "model.rope_scaling = yarn needs model.rope_original_context, the context length the model was "
                "pretrained with before scaling; set it to the checkpoint's original_max_position_embeddings "
                "(Qwen 2.5 / 3: 32768).")
        require(m.rope_original_context > 0, f"model.rope_original_context = {m.rope_original_context} must be "
                                             "positive; set it to the checkpoint's original_max_position_embeddings.")
        require(m.rope_beta_fast > 0 and m.rope_beta_slow > 0,
                f"model.rope_beta_fast = {m.rope_beta_fast} and rope_beta_slow = {m.rope_beta_slow} must be "
                "positive; set them to the checkpoint's (YaRN: 32 and 1).")
        require(m.rope_attention_factor is None or m.rope_attention_factor > 0,
                f"model.rope_attention_factor = {m.rope_attention_factor} must be positive; set it to the "
                "checkpoint's attention_factor, or null for 0.1 ln(rope_factor) + 1.")
    if m.rope_mscale_all_dim:
        require(m.mla and m.rope_scaling != "none" and m.rope_mscale_all_dim > 0,
                f"model.rope_mscale_all_dim = {m.rope_mscale_all_dim} scales multi-head latent attention's logits "
                f"under rope scaling (DeepSeek-V3), but model.kv_lora_rank = {m.kv_lora_rank} and "
                f"model.rope_scaling = {m.rope_scaling}; set a positive value with both, or remove it.")
    require(m.mtp_depth >= 0, f"model.mtp_depth = {m.mtp_depth} must not be negative; set 0 (no multi-token "
                              "prediction) or the number of modules (DeepSeek-V3: 1).")
    if m.mtp_depth:
        require(m.arch == "llama", f"model.mtp_depth = {m.mtp_depth} (multi-token prediction) needs the llama "
                                   f"architecture (model.arch = {m.arch}); set mtp_depth=0 for gpt2.")
        require(m.mtp_depth < m.seq_len, f"model.mtp_depth = {m.mtp_depth} leaves no target in a sequence of "
                                         f"model.seq_len = {m.seq_len}; set it below seq_len (DeepSeek-V3: 1).")
        require(m.mtp_loss_weight >= 0, f"model.mtp_loss_weight = {m.mtp_loss_weight} must not be negative; "
                                        "set it to e.g. 0.3 (DeepSeek-V3), or mtp_depth=0 to train without MTP.")
    require(m.moe_kernel in MOE_KERNELS,
            f"model.moe_kernel = {m.moe_kernel!r} is not a grouped-matmul kernel jaxpar has (one of "
            f"{', '.join(MOE_KERNELS)}); set model.moe_kernel=auto.")
    require(m.moe_exchange in MOE_EXCHANGES,
            f"model.moe_exchange = {m.moe_exchange!r} is not a token exchange jaxpar has (one of "
            f"{', '.join(MOE_EXCHANGES)}); set model.moe_exchange=auto.")
    if m.n_experts != 0:
        _validate_moe(m)
    else:
        require(m.moe_pattern == (0, 1), f"model.moe_layers = {m.moe_layers} needs model.n_experts > 0 (a dense "
                                         "model has no MoE layers); set n_experts, or moe_layers=all.")
    require(m.norm_eps > 0, f"model.norm_eps = {m.norm_eps} must be positive; set it to a small number like 1e-5.")
    require(m.init_std > 0, f"model.init_std = {m.init_std} must be positive; set it to e.g. 0.02.")

    sizes = {"data": mesh.data, "stage": mesh.stage, "model": mesh.model}
    for axis, size in sizes.items():
        require(size == -1 or size >= 1,
                f"mesh.{axis} = {size} is invalid; use a positive size or -1 for all remaining devices.")
    minus = [a for a, s in sizes.items() if s == -1]
    require(len(minus) <= 1,
            f"mesh axes {' and '.join('mesh.' + a for a in minus)} are both -1, but at most one axis may "
            "take the remaining devices; give all but one of them an explicit size.")

    require(par.zero in (0, 1, 2, 3), f"parallel.zero = {par.zero} must be 0, 1, 2 or 3; pick one of those stages.")
    require(par.zero_min_elements >= 0, f"parallel.zero_min_elements = {par.zero_min_elements} must not be "
                                        "negative; set it to 0 to shard every leaf that can be sharded.")
    if par.data_mode == "naive":  # one device updates everything: nothing else may split the state
        require(not m.moe, f"model.n_experts = {m.n_experts} cannot be combined with parallel.data_mode = naive "
                           "(the baseline step has no MoE router report or bias update); set "
                           "parallel.data_mode=ddp.")
        require(not m.mtp_depth, f"model.mtp_depth = {m.mtp_depth} cannot be combined with parallel.data_mode = "
                                 "naive (the baseline step logs no MTP loss); set parallel.data_mode=ddp.")
        for key, value, ok in (("parallel.zero", par.zero, 0), ("mesh.stage", mesh.stage, 1),
                               ("mesh.model", mesh.model, 1), ("parallel.offload", par.offload, "none")):
            require(value == ok, f"{key} = {value} cannot be combined with parallel.data_mode = naive, which "
                                 "keeps the whole optimizer state and update on device 0 (data parallelism "
                                 f"only); set {key}={ok}, or parallel.data_mode=ddp.")
    require(par.microbatches >= 1, f"parallel.microbatches = {par.microbatches} must be at least 1; set it to 1 or more.")
    require(par.context >= 1, f"parallel.context = {par.context} must be at least 1; set it to 1 (no context "
                              "parallelism) or a divisor of mesh.data.")
    if par.context > 1:
        c = par.context
        require(m.seq_len % (2 * c) == 0,
                f"model.seq_len = {m.seq_len} is not divisible by 2 x parallel.context = {2 * c} (each sequence is "
                f"cut into {2 * c} chunks, two per context rank); set model.seq_len to a multiple of {2 * c}.")
        for key, value, ok, why in (
                ("parallel.data_mode", par.data_mode, "ddp", "the naive baseline step has no context ranks"),
                ("model.attention", m.attention, "auto", "context-parallel attention runs the tiled kernel")):
            require(value == ok or (key == "model.attention" and value == "xla_lse"),
                    f"{key} = {value} cannot be combined with parallel.context = {c} ({why}); set {key}={ok}, "
                    "or parallel.context=1.")
    require(par.virtual_stages >= 1, f"parallel.virtual_stages = {par.virtual_stages} must be at least 1; set it to 1 or more.")

    require(tr.steps >= 1, f"train.steps = {tr.steps} must be at least 1; set it to 1 or more.")
    require(tr.global_batch >= 1, f"train.global_batch = {tr.global_batch} must be at least 1; set it to a multiple of mesh.data.")
    require(tr.lr >= 0, f"train.lr = {tr.lr} must not be negative; set a positive learning rate like 3e-4.")
    require(tr.warmup_steps >= 0, f"train.warmup_steps = {tr.warmup_steps} must not be negative; set it to 0 or more.")
    require(0 <= tr.min_lr_ratio <= 1, f"train.min_lr_ratio = {tr.min_lr_ratio} must lie in [0, 1]; set e.g. 0.1.")
    require(tr.grad_clip >= 0, f"train.grad_clip = {tr.grad_clip} must not be negative; set e.g. 1.0, or 0 to disable clipping.")
    require(tr.master_weights == "none" or m.param_dtype != "float32",
            f"train.master_weights = {tr.master_weights} needs a 16-bit model.param_dtype, but it is float32 "
            "(the parameters are their own float32 master: a copy would only add 4 bytes per parameter); "
            "set model.param_dtype=bfloat16 or train.master_weights=none.")
    require(0 <= tr.muon_momentum < 1, f"train.muon_momentum = {tr.muon_momentum} must lie in [0, 1); set e.g. 0.95 "
            "(Moonlight's).")
    require(tr.weight_decay >= 0, f"train.weight_decay = {tr.weight_decay} must not be negative; set e.g. 0.1, or 0 to disable it.")
    require(tr.log_every >= 1, f"train.log_every = {tr.log_every} must be at least 1; set it to 1 or more.")
    require(tr.checkpoint_every >= 0, f"train.checkpoint_every = {tr.checkpoint_every} must not be negative; set it to 0 to disable checkpoints.")
    require(tr.keep_checkpoints >= 1, f"train.keep_checkpoints = {tr.keep_checkpoints} must be at least 1; "
                                      "set it to the number of checkpoints to keep.")
    require(tr.eval_every >= 0, f"train.eval_every = {tr.eval_every} must not be negative; set it to 0 to disable evaluation.")
    require(tr.eval_batches >= 1, f"train.eval_batches = {tr.eval_batches} must be at least 1; set it to 1 or more.")
    require(tr.profile_start is None or 1 <= tr.profile_start <= tr.steps,
            f"train.profile_start = {tr.profile_start} must be a step number in 1 .. train.steps = {tr.steps}; "
            "set the first step to trace, or null to trace none.")
    require(tr.profile_steps >= 1, f"train.profile_steps = {tr.profile_steps} must be at least 1; set the "
                                   "number of steps to trace, e.g. 3.")
    rt = cfg.runtime
    require(not isinstance(rt.step_timeout_s, float) or rt.step_timeout_s > 0,
            f"runtime.step_timeout_s = {rt.step_timeout_s} must be positive seconds; set e.g. 600, or auto, or off.")
    require(rt.cpu_devices is None or rt.cpu_devices >= 1,
            f"runtime.cpu_devices = {rt.cpu_devices} must be at least 1; set a device count, or null.")
    require(rt.peak_tflops is None or rt.peak_tflops > 0,
            f"runtime.peak_tflops = {rt.peak_tflops or 0:g} must be positive; set one device's dense peak TFLOP/s "
            "(e.g. 989 for an H100 SXM in bf16), or null to look it up.")
    flags_error = syntax_error(rt.xla_flags)
    require(flags_error is None, flags_error or "")
    given = {k: getattr(rt, k) for k in ("coordinator", "num_processes", "process_id")}
    require(all(v is None for v in given.values()) or all(v is not None for v in given.values()),
            "runtime.coordinator, runtime.num_processes and runtime.process_id go together, but only "
            f"{', '.join(k for k, v in given.items() if v is not None)} is set; set all three or none.")
    if rt.num_processes is not None:
        require(rt.num_processes >= 1, f"runtime.num_processes = {rt.num_processes} must be at least 1; set the process count.")
        require(0 <= rt.process_id < rt.num_processes,
                f"runtime.process_id = {rt.process_id} must lie in 0 .. runtime.num_processes - 1 = "
                f"{rt.num_processes - 1}; give each process its own index.")
        require(":" in rt.coordinator, f"runtime.coordinator = {rt.coordinator!r} must be host:port of process 0, "
                                       "e.g. localhost:12355.")

    # The batch's divisibility over data x microbatches is checked with the mesh
    # (`jaxpar.parallel.checks.check_batch`), once the data size is resolved against the devices:
    # a wrong mesh is reported first.

    if tr.qk_clip is not None:
        _validate_qk_clip(cfg)
    if cfg.model.fp8:
        require(cfg.mesh.model <= cfg.model.kv_heads,
                f"model.fp8 = true cannot run mesh.model = {cfg.mesh.model} over model.n_kv_heads = "
                       f"{cfg.model.kv_heads} (each replicated key and value head's gradient is a sum of the "
                       "ranks' parts, which FP8 would quantize apart, unlike one device); set mesh.model to at most "
                       "n_kv_heads, or model.fp8=false.")
    if cfg.model.fp8_scaling == "delayed":
        _validate_delayed_fp8(cfg)

    v_shape = placement_of(par.schedule) == "v"
    require(par.virtual_stages == 1 or par.schedule == "interleaved_1f1b" or v_shape,
            f"parallel.virtual_stages = {par.virtual_stages} needs parallel.schedule = interleaved_1f1b "
            f"(got {par.schedule}); set the schedule or parallel.virtual_stages=1.")
    if v_shape:  # (stage s holds chunks s and 2p-1-s: docs/pipeline.md)
        require(par.virtual_stages == 2,
                f"parallel.virtual_stages = {par.virtual_stages} does not fit parallel.schedule = {par.schedule}, "
                f"whose V places exactly two chunks on every stage (s and 2p-1-s); set parallel.virtual_stages=2.")
        p = cfg.mesh.stage
        require(p < 1 or m.n_layers >= 2 * p,
                f"model.n_layers = {m.n_layers} is fewer than the 2 x mesh.stage = {2 * p} chunks of "
                f"parallel.schedule = {par.schedule} (its V needs a layer in each chunk); use at least {2 * p} "
                f"layers, or mesh.stage={max(1, m.n_layers // 2)}.")


def _validate_delayed_fp8(cfg: Config) -> None:
    """model.fp8_scaling: delayed (docs/fp8.md): FP8 on, a history, and a step that keeps one."""
    m, par = cfg.model, cfg.parallel
    require(m.fp8, "model.fp8_scaling = delayed needs model.fp8 = true (it chooses the FP8 matmuls' scales); set "
                   "model.fp8=true, or model.fp8_scaling=current.")
    require(m.fp8_history >= 1, f"model.fp8_scaling = delayed needs model.fp8_history >= 1 (got {m.fp8_history}: "
                                "how many steps' amaxes each FP8 tensor remembers); set e.g. model.fp8_history=16, "
                                "or model.fp8_scaling=current.")
    require(par.data_mode != "naive", "model.fp8_scaling = delayed cannot be combined with parallel.data_mode = "
                                      "naive (its baseline step does not update the amax history); set "
                                      "parallel.data_mode=ddp, or model.fp8_scaling=current.")


def _validate_qk_clip(cfg: Config) -> None:
    """train.qk_clip (docs/qk-clip.md): a positive tau, and what the step records its maxima in."""
    m, par, tau = cfg.model, cfg.parallel, cfg.train.qk_clip
    require(tau > 0, f"train.qk_clip = {tau} must be positive (the largest attention logit a head may keep); "
                     "set it to e.g. 100 (Kimi K2), or null to turn QK-clip off.")
    require(par.data_mode != "naive", f"train.qk_clip = {tau} cannot be combined with parallel.data_mode = naive "
                                      "(its baseline step does not return the attention logits' maxima); set "
                                      "parallel.data_mode=ddp, or train.qk_clip=null.")
    require(not m.qk_norm or m.mla, f"train.qk_clip = {tau} cannot act with model.qk_norm = true (the query and "
                                    "key norms undo any scaling of their projections); set model.qk_norm=false, "
                                    "or train.qk_clip=null.")


def resolve_mesh_shape(mesh: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    """(data, stage, model) sizes with -1 filled in; raises ConfigError if they do not cover n_devices."""
    sizes = [mesh.data, mesh.stage, mesh.model]
    names = ["data", "stage", "model"]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        i = sizes.index(-1)
        if n_devices % known != 0:
            raise ConfigError(
                f"mesh.{names[i]} = -1 cannot fill {n_devices} devices: the other axes multiply to {known}, "
                f"which does not divide {n_devices}; choose sizes whose product divides the device count.")
        sizes[i] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ConfigError(
            f"mesh (data, stage, model) = {tuple(sizes)} has {math.prod(sizes)} devices but {n_devices} are "
            f"available; choose sizes whose product is {n_devices}, or set one axis to -1.")
    return tuple(sizes)  # type: ignore[return-value]
