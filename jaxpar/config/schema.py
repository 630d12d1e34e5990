"""The run configuration's schema: frozen, typed dataclasses, a docstring under every field, and
the construction of a `Config` from plain nested values (`from_dict`: every key and type checked).

A `Config` is built from YAML by `jaxpar.config.load`, checked by `jaxpar.config.validate`; the
rules that need the mesh's sizes and the pipeline's tables are `jaxpar.parallel.checks`'.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Sequence

from jaxpar.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: Literal["llama", "gpt2"] = "llama"
    """Architecture: `llama` (RMSNorm, RoPE, SwiGLU, GQA, untied) or `gpt2` (LayerNorm, learned positions, GELU, biases, tied)."""
    n_layers: int = 4
    """Number of transformer blocks (stacked on the `layers` dim and scanned)."""
    d_model: int = 128
    """Width of the residual stream (`embed`)."""
    n_heads: int = 4
    """Number of query heads; d_model must be divisible by it."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); null means n_heads. Must divide n_heads."""
    d_ff: int = 512
    """Hidden width of the MLP (`mlp`)."""
    vocab_size: int = 256
    """Vocabulary size; every token id must be below it."""
    vocab_multiple: int = 64
    """Embedding and output rows are padded to a multiple of this (padded logits never predicted);
    fixed by the config, not the mesh, so that every mesh holds the same parameters."""
    seq_len: int = 128
    """Tokens per training sequence (the context length)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of matmuls and activations; the loss is always computed in float32."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Storage dtype of parameters (and of the optimizer state unless train.master_weights is set)."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm / LayerNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency (llama only)."""
    head_dim: int | None = None
    """Width of one attention head; null means d_model / n_heads (Qwen 3 sets its own: the query
    and key projections are n_heads x head_dim wide, whatever d_model is)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (llama architecture; Qwen 2 / 2.5), split
    over `model` with their heads. gpt2 always has its biases."""
    fp8: bool = False
    """FP8 training (docs/fp8.md): every weight matmul of a block's attention, MLP and experts with
    its input and weight in float8_e4m3fn and its output's gradient in float8_e5m2, one scale per
    tensor from its amax over the whole tensor (current scaling); the embedding, output head,
    router, norms and attention's softmax stay in `dtype`."""
    fp8_scaling: Literal["current", "delayed"] = "current"
    """How FP8 scales are chosen (docs/fp8.md): `current`, from this step's tensor (its amax, reduced
    over the mesh); `delayed`, from the largest amax of the last `fp8_history` steps, kept per
    matmul tensor in the parameters (`fp8_history` leaves, never trained, checkpointed with them),
    as Transformer Engine's delayed scaling."""
    fp8_history: int = 0
    """`fp8_scaling: delayed`: how many steps' amaxes each FP8 tensor remembers (Transformer Engine
    and Flax use 1024; at least 1)."""
    qk_norm: bool = False
    """RMSNorm over head_dim of each query and key head before RoPE (llama architecture; Qwen 3),
    one scale of head_dim shared by the heads."""
    kv_lora_rank: int | None = None
    """Multi-head latent attention (DeepSeek-V2/V3; llama architecture): keys and values of every
    head are expanded from one shared latent of this width (normalised), and each key carries a
    rotary part shared by all heads; null is ordinary attention. With it set, qk_nope_head_dim,
    qk_rope_head_dim and v_head_dim give the head widths, and n_kv_heads and head_dim stay null."""
    q_lora_rank: int | None = None
    """MLA: queries through a low-rank projection of this width (normalised) before the per-head
    one (DeepSeek-V3: 1536; null, V2-Lite: a direct projection)."""
    qk_nope_head_dim: int | None = None
    """MLA: the width of each query and key head's part without RoPE (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int | None = None
    """MLA: the width of the rotary part of each query head and of the one rotary key all heads
    share (DeepSeek-V3: 64; even)."""
    v_head_dim: int | None = None
    """MLA: the width of each value head (DeepSeek-V3: 128; at most qk_nope_head_dim +
    qk_rope_head_dim)."""
    hf_model_type: Literal["mistral"] | None = None
    """The Hugging Face model_type a llama-architecture model exports as when its options do not
    decide it (Mistral is the llama architecture under its own name): set by the import of a
    Mistral folder; null exports llama, qwen2 (qkv_bias) or qwen3 (qk_norm)."""
    tie_embeddings: bool | None = None
    """Whether the output projection is the token embedding, transposed (one matrix, its gradient
    the sum of both uses): null takes the architecture's (gpt2 tied, llama untied); true for
    llamas that tie (Llama 3.2 1B and 3B). gpt2 is always tied."""
    rope_scaling: Literal["none", "linear", "llama3", "yarn"] = "none"
    """How RoPE's frequencies are rescaled for a longer context (llama only): none; linear (every
    frequency divided by rope_factor: positions interpolated); llama3 (Llama 3.1's: wavelengths
    longer than rope_original_context / rope_low_freq_factor divided by rope_factor, shorter than
    rope_original_context / rope_high_freq_factor kept, those between interpolated smoothly); yarn
    (YaRN: Qwen 2.5 / 3 long context, DeepSeek-V3: frequencies turning fewer than rope_beta_slow
    times in rope_original_context divided by rope_factor, more than rope_beta_fast times kept, a
    linear ramp over the dimensions between; cos and sin multiplied by rope_attention_factor)."""
    rope_factor: float = 1.0
    """The frequency divisor of rope_scaling linear, llama3 and yarn (Llama 3.1: 8, 3.2: 32; Qwen 2.5 / 3
    YaRN: 4)."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above rope_original_context / this are divided by rope_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below rope_original_context / this are kept."""
    rope_original_context: int | None = None
    """llama3 and yarn scaling: the context length the model was pretrained with before scaling
    (config.json's original_max_position_embeddings); null is Llama 3.1's 8192 under llama3, and
    yarn requires it (Qwen 2.5 / 3: 32768)."""
    rope_beta_fast: float = 32.0
    """yarn scaling: frequencies turning more than this many times in rope_original_context are kept."""
    rope_beta_slow: float = 1.0
    """yarn scaling: frequencies turning fewer than this many times in rope_original_context are
    divided by rope_factor."""
    rope_truncate: bool = True
    """yarn scaling: round the ends of the ramp outwards to whole dimensions (transformers'
    `truncate`, true unless config.json sets it)."""
    rope_attention_factor: float | None = None
    """yarn scaling: what cos and sin are multiplied by (attention logits grow by its square); null
    is YaRN's 0.1 ln(rope_factor) + 1 (1 for a factor of 1)."""
    rope_mscale_all_dim: float | None = None
    """Multi-head latent attention under rope scaling: every attention logit (not only the rotary
    part's) is multiplied by (0.1 m ln(rope_factor) + 1)^2 for m = this (DeepSeek-V3's YaRN
    `mscale_all_dim`: 1.0; transformers' `yarn_apply_mscale`); null or 0 leaves the softmax scale
    1/sqrt(qk_nope_head_dim + qk_rope_head_dim)."""
    init_std: float = 0.02
    """Standard deviation of the normal initializer of weight matrices."""
    block: str = "pre_norm"
    """The transformer block by registered name: `pre_norm` (x + attn(norm x), x + mlp(norm x)), or
    one registered with `jaxpar.model.register_block` (research code; see examples/custom_block.py)."""
    attention: Literal["auto", "xla_lse", "xla", "cudnn"] = "auto"
    """Attention kernel: auto (cuDNN's fused kernel on GPU when shapes and dtypes allow, else
    xla_lse), xla_lse (XLA's einsum-softmax whose backward recomputes the probabilities from the
    saved log-sum-exp: [seq] floats per head kept, not [seq, seq]), xla (jax's reference path, which
    keeps the probabilities), cudnn (fail if cuDNN cannot run it)."""
    n_experts: int = 0
    """Mixture of experts: routed experts per MLP (0: a dense MLP, the default). Every layer's MLP
    becomes an MoE layer (`jaxpar.model.moe`, DESIGN.md §10); llama architecture only."""
    experts_per_token: int = 2
    """MoE: experts each token is routed to (top-k; Mixtral 2, Qwen3-MoE 8)."""
    expert_d_ff: int | None = None
    """MoE: hidden width of one expert's SwiGLU MLP; null means d_ff."""
    n_shared_experts: int = 0
    """MoE: experts every token passes through besides its routed ones (DeepSeek / Qwen style),
    computed as one SwiGLU MLP of width n_shared_experts x expert_d_ff."""
    router: Literal["softmax", "sigmoid_bias"] = "softmax"
    """MoE router: softmax (softmax over experts, then top-k; Mixtral, Qwen3-MoE) or sigmoid_bias
    (sigmoid scores; top-k chosen on score + a per-expert bias that is not trained by the gradient
    but moved by router_bias_rate after each step towards equal load: DeepSeek-V3's
    auxiliary-loss-free balancing)."""
    router_norm_topk: bool = True
    """MoE: divide each token's top-k weights by their sum (Mixtral, Qwen3-MoE, DeepSeek-V3)."""
    router_groups: int = 1
    """MoE: experts form this many groups of consecutive ids (DeepSeek-V3's n_group: 8); with more
    than one, each token first keeps its router_topk_groups best groups, a group scored by the sum of
    its two best experts' choice scores (score + bias under sigmoid_bias), and picks its top-k
    experts inside them. 1: no groups."""
    router_topk_groups: int = 1
    """MoE: groups each token may route to when router_groups > 1 (DeepSeek-V3's topk_group: 4)."""
    router_scaling: float = 1.0
    """MoE: each token's expert weights multiplied by this after any renormalisation (DeepSeek-V3's
    routed_scaling_factor: 2.5)."""
    router_aux_loss: float = 0.01
    """MoE: coefficient of the load-balancing loss (Switch / GShard form, per sequence:
    n_experts x sum_e load_e x mean probability_e), averaged over sequences and summed over layers."""
    router_z_loss: float = 0.0
    """MoE: coefficient of the router z-loss (ST-MoE: mean over tokens of logsumexp(logits)^2)."""
    router_bias_rate: float = 0.001
    """MoE, router sigmoid_bias: each step, every expert's bias moves by this much towards equal
    load (up if the expert took fewer tokens than the mean, down if more)."""
    capacity_factor: float | None = None
    """MoE: null is dropless (every token reaches its k experts). A number c caps each expert at
    ceil(c x seq_len x k / n_experts) tokens per sequence (a group that does not depend on the
    mesh); assignments beyond it are dropped (top-1 choices first, then by position: Switch)."""
    moe_kernel: Literal["auto", "ragged_dot", "pallas"] = "auto"
    """MoE: the grouped matmuls of the experts (docs/moe.md, "Kernel choice"): auto (on CPU a scan
    over blocks of each expert's rows; on GPU and TPU `jax.lax.ragged_dot`, until GPU measurements
    choose), ragged_dot (`jax.lax.ragged_dot` on every backend; on CPU one dense product with every
    expert), or pallas (`jaxpar.model.grouped_gemm`: Pallas grouped GEMMs over the routed rows only,
    forward and both gradients; Triton on GPU, the Pallas interpreter on CPU; not on TPU)."""
    moe_exchange: Literal["auto", "fixed", "ragged"] = "auto"
    """MoE under expert parallelism: how tokens travel to their experts' data ranks and back
    (docs/moe.md, "The exchange"): fixed (a worst-case buffer per rank by all-to-alls; runs
    everywhere), ragged (`jax.lax.ragged_all_to_all`: only the routed rows; GPUs, not the CPU), or
    auto (ragged on GPUs, fixed elsewhere). The planner counts the bytes of the one that runs."""
    moe_layers: str = "all"
    """MoE: which layers are MoE (the others have a dense MLP of width d_ff): `all`; `every:N`
    (layers N-1, 2N-1, ...: Qwen2-MoE's decoder_sparse_step, Llama 4's interleave step);
    `first_dense:K` (layers K onwards: DeepSeek-V3's first_k_dense_replace); or
    `first_dense:K,every:N` (after K dense layers, every N-th). DESIGN.md §10."""
    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3 §2.2; llama architecture): D sequential modules after
    the model, module k predicting the token k + 1 ahead from the embedding of the token k ahead
    and module k - 1's output (the model's for k = 1), each with its own projection and transformer
    block (MoE when the model has experts) and the shared embedding and output head
    (`jaxpar.model.mtp`). 0: none. Evaluation and generation use the main head only."""
    mtp_loss_weight: float = 0.3
    """MTP: the weight of the mean of the D modules' losses in the training objective (DeepSeek-V3:
    0.3 for its first 10T tokens, then 0.1); logged apart from the main loss as `mtp_loss`."""
    init_from: str | None = None
    """A local Hugging Face model folder (config.json + *.safetensors) to start from (fine-tuning);
    its shapes must match this model section. Null initializes at random from train.seed."""

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def tied(self) -> bool:
        """Whether the output projection is the token embedding (`tie_embeddings`, or the arch's)."""
        return self.arch == "gpt2" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def head_size(self) -> int:
        """Width of one query and key head: `head_dim`, or d_model / n_heads when it is null; under
        MLA qk_nope_head_dim + qk_rope_head_dim (the value heads, v_head_dim wide, are padded to it
        for the attention kernel)."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (`kv_lora_rank` set)."""
        return self.kv_lora_rank is not None

    @property
    def rope_context(self) -> int:
        """The pretraining context of llama3 and yarn scaling: `rope_original_context`, or Llama 3.1's
        8192 when it is null."""
        return 8192 if self.rope_original_context is None else self.rope_original_context

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def moe_pattern(self) -> tuple[int, int]:
        """(K, N) of `moe_layers`: K dense layers first, then every N-th layer MoE ((0, 1): all)."""
        return parse_moe_layers(self.moe_layers)

    @property
    def mixed(self) -> bool:
        """An MoE model with dense layers too: its blocks are two stacks, {"dense", "moe"}."""
        return self.moe and self.moe_pattern != (0, 1)

    @property
    def n_moe_layers(self) -> int:
        K, N = self.moe_pattern
        return (self.n_layers - K) // N if self.moe else 0

    def is_moe_layer(self, i: int) -> bool:
        K, N = self.moe_pattern
        return self.moe and i >= K and (i - K + 1) % N == 0

    @property
    def expert_width(self) -> int:
        """Hidden width of one expert: expert_d_ff, or d_ff when it is null."""
        return self.d_ff if self.expert_d_ff is None else self.expert_d_ff

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1
    """Size of the `data` axis (data parallelism / ZeRO); -1 takes all remaining devices."""
    stage: int = 1
    """Size of the `stage` axis (pipeline parallelism); -1 takes all remaining devices."""
    model: int = 1
    """Size of the `model` axis (tensor / sequence parallelism); -1 takes all remaining devices."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    data_mode: Literal["ddp", "naive"] = "ddp"
    """How `data` shares gradients: ddp (all-reduce, every device updates its replica or ZeRO shard)
    or naive (torch DataParallel's pattern: gradients gathered onto device 0, which alone holds the
    optimizer state and updates, then sends the new parameters to the others; for comparison)."""
    zero: int = 0
    """ZeRO stage over `data`: 0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters (FSDP)."""
    zero_min_elements: int = 16384
    """ZeRO leaves with fewer elements than this (norm scales, biases) stay replicated over `data`."""
    expert_parallel: bool = True
    """MoE (model.n_experts > 0) with data > 1: the experts of every MoE layer are split over the
    `data` ranks (DeepSpeed-MoE's layout; n_experts divisible by data), tokens travel to their
    experts and back by all-to-alls over `data`, and expert weights (and their optimizer state)
    are never reduced over `data`. With data a multiple r of n_experts each expert is replicated
    on r data ranks: every rank stores a 1/data slice of every expert (d_model divisible by
    data), assembles its own expert by an all-to-all where it is used, and each expert's gradient
    is summed over its r replicas by that all-to-all's transpose (DESIGN.md §10).
    false: every data rank holds every expert, whose gradients are reduced like the other
    weights'."""
    expert_tensor_parallel: bool = True
    """MoE under tensor parallelism (model > 1): true splits each expert's width over `model`
    (Megatron's expert-TP layout: the layer's input gathered, its output reduced, as a dense MLP);
    false keeps every expert whole on every model rank and routes each rank's own sequence shard
    (needs parallel.sequence_parallel: no activation collective over `model` for the routed experts)."""
    schedule: Literal["gpipe", "1f1b", "1f1b_lockstep", "1f1b_one_action", "interleaved_1f1b", "zb_h1", "zb_v",
                      "dualpipe_v"] = "1f1b"
    """Pipeline schedule (mesh.stage > 1): gpipe, 1f1b (Megatron's order and memory, backward split
    into I and W), 1f1b_lockstep (one F and one fused B per tick), 1f1b_one_action, interleaved_1f1b,
    zb_h1 (zero-bubble ZB-H1: 1f1b with W deferred into the bubbles), zb_v (zero-bubble V: chunks s
    and 2p-1-s on stage s, virtual_stages 2) and dualpipe_v (DualPipeV: one microbatch's forward
    beside another's backward, V placement, virtual_stages 2); docs/pipeline.md."""
    microbatches: int = 1
    """Microbatches per step (gradient accumulation, or pipeline microbatches)."""
    virtual_stages: int = 1
    """Model chunks per pipeline device (interleaved schedule; 2 for the V schedules)."""
    sequence_parallel: bool = False
    """Shard norms and residual activations along `seq` over `model` (Megatron sequence parallelism)."""
    context: int = 1
    """Context parallelism: c of the `data` axis's ranks split each sequence (c divides mesh.data;
    model.seq_len divisible by 2c), the rest split the batch; context rank j holds chunks j and
    2c − 1 − j of 2c (zigzag: every rank the same causal attention work). The context ranks join
    the data ranks' gradient reduction and ZeRO shards (`jaxpar.parallel.context`)."""
    context_attention: Literal["all_gather", "ring"] = "all_gather"
    """How attention reads the other context ranks' keys and values: all_gather (Llama 3's: K and V
    all-gathered over the c ranks, their gradients reduce-scattered back) or ring (K and V blocks
    passed round the ring in c − 1 steps, partial outputs merged by their log-sum-exp)."""
    stage_layers: tuple[int, ...] | None = None
    """Layers per pipeline stage, e.g. [3, 5] (they sum to n_layers; one chunk per stage); null
    splits evenly. Lighter end stages balance the embedding and the loss."""
    remat: Literal["none", "full", "dots", "dots_except_mlp", "offload"] = "none"
    """Rematerialization of each block: none, full (recompute everything), dots (save matmul
    outputs), dots_except_mlp (save the attention projections q, k, v, o; recompute the MLP and
    the attention core), offload (the matmul outputs `dots` saves, kept in host memory: needs a
    backend with `pinned_host` memory)."""
    zero3_gather: Literal["microbatch", "step"] = "microbatch"
    """Where ZeRO-3 all-gathers parameters when a step runs several microbatches (accumulation or a
    pipeline): microbatch (per layer, in every forward and backward pass: least memory, most traffic)
    or step (each layer once per step, kept for the step: the memory of this stage's whole
    parameters, the traffic of one gather)."""
    offload: Literal["none", "optimizer"] = "none"
    """Host offload of the optimizer state (ZeRO-Offload): `optimizer` keeps Adam's moments (and,
    with train.master_weights, the float32 master) in pinned host memory, on the ZeRO layout, and
    the step copies them to the device for the update and back; `none` keeps them on the device.
    Needs a backend with `pinned_host` memory."""
    zero2_reduce: Literal["microbatch", "step"] = "microbatch"
    """Where ZeRO-2 reduce-scatters gradients when a step runs several microbatches: microbatch
    (per layer inside every backward pass, shards accumulated: 1/d of the gradient memory, m
    reduce-scatters per step, DeepSpeed's way) or step (full float32 gradients accumulated,
    reduce-scattered once after the loop: ZeRO-1's program)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    """Number of optimizer steps."""
    global_batch: int = 16
    """Sequences per optimizer step, across all devices."""
    lr: float = 3e-3
    """Peak learning rate (after warmup; cosine-decayed to lr * min_lr_ratio)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 30
    """Linear warmup steps from 0 to the peak learning rate."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to weight matrices and embeddings only (not norms or biases)."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.95
    """Adam beta2."""
    grad_clip: float = 1.0
    """Global-norm gradient clipping threshold; 0 disables clipping."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon: Muon (Moonlight / Kimi K2: Nesterov momentum, 5 Newton-Schulz iterations,
    the update scaled by 0.2 sqrt(max(m, n)) to AdamW's RMS, decoupled weight decay) on the hidden
    weight matrices, per logical matrix, and AdamW on embeddings, the output head, norms, biases
    and routers; the same lr, schedule and weight_decay (docs/muon.md)."""
    muon_momentum: float = 0.95
    """Muon's Nesterov momentum (Moonlight: 0.95); AdamW's leaves keep b1 and b2."""
    muon_ns_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype Muon's Newton-Schulz iterations compute in (Moonlight: bfloat16)."""
    reset_optimizer: bool = False
    """Resuming from a checkpoint whose optimizer state does not fit this config's optimizer
    (train.optimizer switched, or master_weights / grad_clip changed its structure): keep its
    parameters, step and skipped count and start a fresh optimizer state (one log line), instead
    of refusing. A checkpoint whose optimizer state fits is resumed whole."""
    master_weights: Literal["none", "float32"] = "none"
    """With a 16-bit model.param_dtype: `float32` keeps a float32 master copy of the parameters in
    the optimizer state (laid out like Adam's moments, so ZeRO-1+ shards it over data), takes
    float32 gradients, and stores the parameters the step uses as the master's 16-bit cast
    (Megatron's mixed precision: 2 + 4 + 12/d bytes per parameter under ZeRO-1); `none`: the
    optimizer updates the stored parameters, its moments in their dtype."""
    qk_clip: float | None = None
    """QK-clip (MuonClip, Kimi K2): after every update, each attention head whose largest
    pre-softmax logit over the step's batch exceeded this tau has its query and key projections
    rescaled so that that logit becomes tau (MLA: the no-RoPE parts by sqrt(tau / max) each, the
    rotary query by tau / max); logs max_logit and max_logit_<layer>. null: off. With either
    optimizer; stage 1, data_mode ddp, no context parallelism (docs/qk-clip.md)."""
    seed: int = 0
    """Seed of parameter initialization and of the data order."""
    run_dir: str = "runs/default"
    """Directory for config.yaml and metrics.jsonl."""
    log_every: int = 10
    """Log metrics every this many steps (and at the last step)."""
    checkpoint_every: int = 0
    """Save a checkpoint (orbax, under run_dir/checkpoints) every this many steps; 0 disables
    periodic checkpoints (the final step, a SIGTERM/SIGINT and a stop on NaN still save one)."""
    save_final: bool = True
    """Save a checkpoint of the last step when the run ends, so that `convert --to-hf`, `generate`
    and a longer rerun read the trained weights; false saves none (an explicit opt-out: export
    then refuses the run's older checkpoint unless told `--allow-stale`)."""
    keep_checkpoints: int = 3
    """Keep the newest this many checkpoints; older ones are deleted once a newer one is complete."""
    async_checkpoint: bool = True
    """Write checkpoints in the background while training continues."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest valid checkpoint in run_dir when there is one; never: start
    afresh (refused when run_dir already holds checkpoints, so none is overwritten)."""
    on_nan: Literal["skip", "stop"] = "stop"
    """A non-finite loss or gradient: skip (drop that update, count it in metrics, go on) or stop
    (save the last good state and exit non-zero)."""
    eval_every: int = 0
    """Compute the validation loss every this many steps and at the last step; 0 disables it."""
    eval_batches: int = 4
    """Batches of train.global_batch sequences per validation (the same ones every time)."""
    profile_start: int | None = None
    """Trace steps profile_start .. profile_start + profile_steps - 1 (step numbers as in the
    metrics, from 1) with jax.profiler into run_dir/profile (TensorBoard's profile plugin or
    Perfetto read it); null traces nothing."""
    profile_steps: int = 3
    """Number of steps the profile traces (with train.profile_start)."""
    tensorboard: bool = False
    """Also write every logged metric (validation loss included) as TensorBoard scalars under
    run_dir/tensorboard, their tags the metrics.jsonl keys (needs tensorboardX: `jaxpar[tensorboard]`)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"
    """`synthetic` (a seeded Markov language), the path of a flat binary token file (`.bin`), or a
    directory written by `python -m jaxpar.data prepare` (its train split; its val split for eval)."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a token file."""
    document_mask: bool = False
    """Attention stays inside each document of a packed sequence, and positions restart at each
    document's start. A document ends at (and includes) the EOS id: a prepared directory's
    tokenizer EOS (meta.json `eos_id`), id vocab_size - 1 for `synthetic` (whose rows then pack
    documents of random lengths); a plain token file, or a directory prepared without an EOS
    (`byte`), has no document ends and is refused (`jaxpar.train.data.document_eos`)."""


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    cpu_devices: int | None = None
    """Simulate this many devices on the CPU (set before JAX starts a backend); null leaves JAX's default."""
    coordinator: str | None = None
    """`host:port` of process 0 for a multi-process run (with num_processes and process_id); null
    lets jax.distributed detect a launcher (SLURM, Open MPI, Kubernetes) or runs one process."""
    num_processes: int | None = None
    """Number of processes of a multi-process run (with coordinator and process_id)."""
    process_id: int | None = None
    """This process's index in 0 .. num_processes - 1 (with coordinator and num_processes)."""
    cpu_malloc: Literal["keep", "glibc"] = "keep"
    """glibc's malloc in a process that trains on `cpu_devices`, set before XLA starts its threads:
    `keep` (one arena, no mmap, trimmed only past 2 GiB free: what XLA:CPU frees after a step is
    reused by the next instead of going back to the kernel and being faulted in again; the process
    keeps its peak heap) or `glibc` (glibc's defaults). `jaxpar.mesh.keep_freed_memory`."""
    xla_flags: str = "auto"
    """XLA flags jaxpar adds to XLA_FLAGS before JAX starts: `auto` (on a GPU backend, a preset
    for the installed jaxlib: latency-hiding scheduler, collective combining, while-loop double
    buffering, collective pipelining; nothing on CPU), `none`, or flags like
    `--xla_gpu_enable_latency_hiding_scheduler=true`. Each is checked against the flags the
    installed jaxlib registers; flags already in XLA_FLAGS win (`jaxpar.xla_flags`)."""
    step_timeout_s: float | Literal["auto", "off"] = "auto"
    """The watchdog (`jaxpar.train.watchdog`): a step or a checkpoint save that takes longer than
    this many seconds writes every thread's stack to run_dir/hang-<time>.txt and ends the process
    with exit code 75 (rerun it: it resumes from the last checkpoint). The start-up (restore,
    first compile, first step) gets at least 30 minutes. `auto`: off on CPU; on GPUs 10x the
    median step time of steps 2-11, at least 5 minutes (30 minutes until then); `off`: never."""
    peak_tflops: float | None = None
    """Dense peak TFLOP/s of one device, the MFU's denominator; null takes it from the table of
    known GPUs (A100, H100 SXM, H200: bf16, or TF32 for float32 compute), else shows no MFU."""


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested values (tuples as lists), as YAML holds them."""
        def plain(x: Any) -> Any:
            return {k: plain(v) for k, v in x.items()} if isinstance(x, dict) else list(x) if isinstance(x, tuple) else x
        return plain(dataclasses.asdict(self))

    def replace(self, **sections: Any) -> "Config":
        """`cfg.replace(train={"steps": 3})`, or with `--set`'s dotted keys
        `cfg.replace(**{"train.steps": 3})`: a copy with some fields of some sections changed."""
        update: dict = {}
        for key, value in sections.items():
            section, dot, field = key.partition(".")
            update = _merge(update, {section: {field: value}} if dot else {key: value})
        return from_dict(_merge(self.to_dict(), update))


def parse_moe_layers(text: str) -> tuple[int, int]:
    """`model.moe_layers` as (K dense layers first, then every N-th layer MoE)."""
    if str(text).strip() == "all":
        return 0, 1
    parts = {}
    for item in str(text).replace(" ", "").split(","):
        key, _, value = item.partition(":")
        if key not in ("first_dense", "every") or key in parts or not value.isdigit():
            raise ConfigError(f"model.moe_layers = {text!r} is not a layer pattern; write all, every:N, "
                              "first_dense:K or first_dense:K,every:N (e.g. every:2).")
        parts[key] = int(value)
    return parts.get("first_dense", 0), parts.get("every", 1)


# --------------------------------------------------------------------------------------------
# Construction from plain values (YAML's): every key and type checked


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key(key: str, valid: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key.split(".")[-1], valid, n=1)
    prefix = key.rpartition(".")[0]
    hint = (f"did you mean `{prefix + '.' if prefix else ''}{close[0]}`?" if close
            else f"valid keys are: {', '.join(valid)}.")
    return ConfigError(f"unknown config key `{key}` in {where}; {hint}")


def _check_key(section: str, key: str | None, where: str) -> None:
    """Raise the unknown-key ConfigError, blaming `where`, if `section` (and `section.key`) is not in the schema."""
    sections = _field_types(Config)
    head, dot, rest = section.partition(".")
    if section not in sections and dot and head in sections:  # `mesh.data: 8` at the top of a YAML file
        raise ConfigError(f"config key `{section}` in {where} is written dotted at the top level; nest it under "
                          f"its section (`{head}:` then `  {rest}: ...`), or pass it as --set {section}=...")
    if section not in sections:
        raise _unknown_key(section, list(sections), where)
    fields = _field_types(sections[section])
    if key is not None and key not in fields:
        raise _unknown_key(f"{section}.{key}", list(fields), where)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(typing.get_args(tp)[0], "values")
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            type(None): "null"}.get(tp, str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Return `value` as type `tp` or raise a ConfigError naming the key, the value and the type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif tp is type(None):
        if value is None:
            return None
    elif origin is tuple:  # tuple[int, ...]: a YAML list
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(f"{key}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value))
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `run_dir: 2024` means the directory named 2024
    raise ConfigError(
        f"config key `{key}` got {value!r}, but it must be {_describe(tp)}; "
        f"set it to a valid value, e.g. `--set {key}=...`.")


def from_dict(raw: dict[str, Any], where: str = "the config") -> Config:
    """Build a Config from nested plain values (as in YAML), checking every key and type."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of sections (model, mesh, ...), got {type(raw).__name__}; "
                          "write it as YAML sections like `model: {d_model: 128}`.")
    sections = _field_types(Config)
    kwargs = {}
    for name, section in raw.items():
        _check_key(name, None, where)
        section = {} if section is None else section  # a section whose keys are all commented out
        if not isinstance(section, dict):
            raise ConfigError(f"config section `{name}` must be a mapping of keys, got {section!r}; "
                              f"write it as `{name}: {{key: value}}`.")
        fields = _field_types(sections[name])
        values = {}
        for key, value in section.items():
            _check_key(name, key, where)
            values[key] = _coerce(f"{name}.{key}", value, fields[key])
        kwargs[name] = sections[name](**values)
    return Config(**kwargs)
