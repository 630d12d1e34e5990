"""Transformer layers: norms, attention (GQA, RoPE), MLPs. Maths only: no mesh, no PartitionSpec.

Every parameter dim carries a logical name (`nnx.Param(..., sharding_names=...)`) and every
activation is marked with logical names through `constrain`; the rule tables in
`jaxpar.sharding` decide what those names mean on a mesh. Shape suffixes: B batch, T seq,
D embed, N heads, K kv_heads, H head_dim, F mlp, V vocab.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config import ModelConfig
from jaxpar.model import fp8, qk_clip, tiled_attention
from jaxpar.model.lse_attention import lse_attention, working_set_attention
from jaxpar.sharding import ATTN_TAG, DOT_TAG, constrain, exit_tp, local_kv_heads, tensor_parallel, varying_axes, vary


def param(rngs: nnx.Rngs | None, shape: tuple[int, ...], names: tuple[str, ...], dtype, std: float | None = None,
          fill: float = 0.0) -> nnx.Param:
    """A parameter with logical dim `names`: normal(std) when `std` is given, else constant `fill`.

    `eager_sharding=False`: placement is decided by the storage rules at `jit(init, out_shardings)`
    time, not by Flax when the variable is created.
    """
    assert len(shape) == len(names), (shape, names)
    if std is None:
        value = jnp.full(shape, fill, dtype)
    else:
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


# `linear`'s XLA:CPU weight-gradient layout (on by default; a switch for measuring without it).
CPU_WEIGHT_GRADIENT_LAYOUT = True


def linear(x: jax.Array, w: jax.Array, k: int = 1) -> jax.Array:
    """`x [..., C] @ w [C, O...]`: x's last `k` dims contract with w's first `k` (a weight matmul).

    The same value and gradients as the einsum. On XLA:CPU the weight gradient is computed from a
    materialised transpose of the input, `x^T [C, tokens] @ g [tokens, O]`, or of the output's
    cotangent where O < C, `(g^T @ x)^T` (the copy of the narrower one): the form XLA:CPU sends
    to YNNPACK. Left to itself, its simplifier folds the transpose into the dot, and a dot that
    contracts its left operand's major dim falls back to Eigen (measured: ~20% of an MLP's
    backward time on this project's 2-core machine; `benchmarks/vs_plain_jax.py`). Elsewhere it
    is the plain einsum: on other backends (cuBLAS takes transposed operands at no cost), in
    16-bit compute (XLA:CPU computes it in float32 after casts: measured no change), and under
    tensor parallelism (XLA:CPU runs independent collectives in any order per device, and with
    this backward a ZeRO-3 reduce-scatter over `data` and an all-gather over `model` deadlocked).
    The output is named `DOT_TAG`, so the `dots` remat policy saves it as it saves a plain dot's
    (and `offload` finds it by that name on every backend).
    """
    split = _SPLIT.get()
    if fp8.active() and split is None:  # model.fp8: e4m3 operands, an e5m2 output cotangent (`jaxpar.model.fp8`)
        axes = (*varying_axes(x), *varying_axes(w))
        return checkpoint_name(fp8.apply(functools.partial(_einsum, k=k), vary(x, axes), vary(w, axes)), DOT_TAG)
    if split is None and (not CPU_WEIGHT_GRADIENT_LAYOUT or jax.default_backend() != "cpu" or x.dtype != jnp.float32
                          or tensor_parallel()):
        return checkpoint_name(_einsum(x, w, k), DOT_TAG)
    # The custom backward returns each cotangent with its input's manual-axis type: make both
    # inputs vary over the same axes first (the pcast's own transpose then reduces, as autodiff of
    # the einsum would have).
    path = split.paths.get(id(w)) if split is not None else None  # (before the cast below makes a new w)
    axes = (*varying_axes(x), *varying_axes(w))
    x, w = vary(x, axes), vary(w, axes)
    if split is None:
        return checkpoint_name(_linear(x, w, k), DOT_TAG)
    if path is None:
        raise AssertionError("split backward: a weight matmul's weight is not one of the layer's parameters "
                             "as handed out (a copy was made between `use_params` and `linear`)")
    out = lambda y: y  # noqa: E731
    if fp8.active():  # model.fp8 under the split backward: the same FP8 product, as its parts
        # (`fp8.parts`): I's input gradient and W's weight gradient then take the e4m3 operands
        # and the e5m2 cotangent, as `fp8.apply`'s backward does.
        x, w, out = fp8.parts(x, w)
    x2, w2 = _flat(x, w, k)
    if split.taps is None:  # recording the taps' shapes
        split.shapes[path] = (x2.shape, x2.dtype, (x2.shape[0], w2.shape[1]), x2.dtype, tuple(sorted(set(axes))),
                              w.shape)
        return checkpoint_name(out(_linear(x, w, k)), DOT_TAG)
    tap = split.layer_taps[path]
    if split.stash_inputs:  # the caller stashes x for W itself: the tap carries g alone
        split.inputs[path] = x
    return checkpoint_name(out(_linear_tapped(x, w, tap, k, varying_axes(tap[1]), split.stash_inputs)), DOT_TAG)


# ---------------------------------------------------------------------------------------------
# The split backward (pipeline actions I and W): inside `split_backward(taps)`, every weight
# matmul of a layer takes a third input, its "tap" (zeros shaped like its flattened input and
# output cotangent). Its backward returns the input cotangent, no weight cotangent, and (x, g)
# as the tap's cotangent: one backward pass (I) yields the chunk's input gradient and, per
# matmul, the pairs from which W later computes the weight gradient x^T g alone.


class SplitBackward:
    """The active split-backward context: `taps` (path -> stacked (x, g) zeros, or None while
    recording their shapes into `shapes`), and per layer, while it runs, `paths` (id of each
    handed-out parameter -> its path in the layer's tree) and `layer_taps`. With `stash_inputs`
    the caller keeps each matmul's input for W itself: a tap is (None, g zeros), the matmul's
    pullback keeps no x (its backward needs only w), and `inputs` collects path -> x as the layer
    runs (the pipeline's F returns them from its `jax.vjp` and stashes each once)."""

    def __init__(self, taps, stash_inputs=False):
        self.taps, self.shapes, self.paths, self.layer_taps = taps, {}, {}, None
        self.stash_inputs, self.inputs = stash_inputs, {}


_SPLIT: contextvars.ContextVar[SplitBackward | None] = contextvars.ContextVar("jaxpar_split_backward", default=None)


@contextlib.contextmanager
def split_backward(taps=None, stash_inputs=False):
    """Run the model's weight matmuls with taps (`taps` None: record the taps' shapes instead)."""
    token = _SPLIT.set(SplitBackward(taps, stash_inputs))
    try:
        yield _SPLIT.get()
    finally:
        _SPLIT.reset(token)


def active_split() -> SplitBackward | None:
    return _SPLIT.get()


def weight_gradient(x2: jax.Array, g2: jax.Array) -> jax.Array:
    """W's work for one matmul stacked over layers: x [L, N, C], g [L, N, O] -> [L, C, O] (in
    the form XLA:CPU sends to YNNPACK, see `linear`)."""
    if jax.default_backend() == "cpu":
        return jax.lax.optimization_barrier(jnp.swapaxes(x2, 1, 2)) @ g2
    return jnp.einsum("lnc,lno->lco", x2, g2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _linear_tapped(x, w, tap, k, tap_axes, stash_inputs):
    return _linear(x, w, k)


def _linear_tapped_fwd(x, w, tap, k, tap_axes, stash_inputs):
    # (With `stash_inputs` x is no residual of this matmul: its backward needs only w.)
    return _linear(x, w, k), (None if stash_inputs else x, w)


def _linear_tapped_bwd(k, tap_axes, stash_inputs, res, g):
    x, w = res
    c, o = math.prod(w.shape[:k]), math.prod(w.shape[k:])
    g2 = g.reshape(-1, o)
    dx = (g2 @ w.reshape(c, o).T).reshape(*g.shape[:g.ndim - (w.ndim - k)], *w.shape[:k])
    x2 = None if stash_inputs else vary(x.reshape(-1, c), tap_axes)
    return dx, jnp.zeros_like(w), (x2, vary(g2, tap_axes))


_linear_tapped.defvjp(_linear_tapped_fwd, _linear_tapped_bwd)


def _flat(x: jax.Array, w: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    c = math.prod(w.shape[:k])
    return x.reshape(-1, c), w.reshape(c, -1)


def _einsum(x, w, k):
    """x's last k dims contracted with w's first k: the plain product, one `dot_general` (not
    `jnp.einsum`, which lowers as a call: FP8's converts and scales must reach the dot itself)."""
    return jax.lax.dot_general(x, w, ((tuple(range(x.ndim - k, x.ndim)), tuple(range(k))), ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear(x, w, k):
    x2, w2 = _flat(x, w, k)
    return (x2 @ w2).reshape(*x.shape[:x.ndim - k], *w.shape[k:])


def _linear_fwd(x, w, k):
    return _linear(x, w, k), (x, w)


def _linear_bwd(k, res, g):
    x, w = res
    x2, w2 = _flat(x, w, k)
    g2 = g.reshape(x2.shape[0], w2.shape[1])
    dx = (g2 @ w2.T).reshape(x.shape)
    # The barrier keeps the transpose a copy (see `linear`); it costs one pass over the narrower
    # of x and g (an MLP's down projection: g, [tokens, D] against x's [tokens, d_ff]; then the
    # product comes out [O, C], and the second barrier keeps XLA from folding its weight-sized
    # transpose into the dot, which then fell back to Eigen).
    if x2.shape[1] > g2.shape[1]:
        dw = jax.lax.optimization_barrier(jax.lax.optimization_barrier(g2.T) @ x2).T.reshape(w.shape)
    else:
        dw = (jax.lax.optimization_barrier(x2.T) @ g2).reshape(w.shape)
    return dx, dw


_linear.defvjp(_linear_fwd, _linear_bwd)


_WORKING_SET: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxpar_backward_working_set", default=False)


@contextlib.contextmanager
def backward_working_set():
    """Trace the model with `xla_lse` attention saving, beside its residuals, what its backward
    materializes at once (`jaxpar.model.lse_attention.working_set_attention`): the planner reads a
    layer's backward working set this way (`jaxpar.costs_activations`). SwiGLU's rule needs no
    stand-in: its backward is one elementwise fusion over the g and u it keeps."""
    token = _WORKING_SET.set(True)
    try:
        yield
    finally:
        _WORKING_SET.reset(token)


class Sequence(NamedTuple):
    """How the tokens of a traced batch sit in their sequences, where that is not one whole sequence
    per row (`sequence_layout`): packed documents (`data.document_mask`) and sequences split over
    devices (context parallelism, `jaxpar.parallel.context`)."""

    positions: jax.Array
    """int32 [B, T]: each token's position for RoPE and learned position embeddings (in its
    document under document masking, else in the whole sequence)."""
    segments: jax.Array | None = None
    """int32 [B, T]: each token's document (`document_segments`), or None: one document."""
    attend: Callable | None = None
    """`attend(q, k, v, cfg) -> o` replacing the attention kernel (context parallelism: the keys
    and values of the other ranks' tokens), or None."""
    groups: tuple[tuple[int, ...], ...] | None = None
    """The groups of `data` ranks whose tokens are parts of the same sequences (context
    parallelism: per-sequence sums, such as an MoE router's loads, add over a group), or None."""
    whole: Callable | None = None
    """`whole(x)`: x [B, T, ...] of this rank's tokens gathered into their whole sequences
    [B, c·T, ...], in sequence order (context parallelism: over the group), or None."""
    own: Callable | None = None
    """`own(x)`: this rank's tokens [B, T, ...] of whole sequences [B, c·T, ...] (`whole`'s inverse
    on this rank), or None."""


_SEQUENCE: contextvars.ContextVar[Sequence | None] = contextvars.ContextVar("jaxpar_sequence", default=None)


def document_segments(tokens_BxT: jax.Array, eos_id: int) -> jax.Array:
    """Each token's document in a packed sequence, int32 [B, T] counting from 0: a document ends at
    (and includes) the token `eos_id`, the next token starts the next one (`data.document_mask`)."""
    ends = (tokens_BxT == eos_id).astype(jnp.int32)
    return jnp.cumsum(ends, axis=1) - ends


def document_positions(segments_BxT: jax.Array) -> jax.Array:
    """Each token's position in its document, int32 [B, T]: positions restart at 0 where the
    document changes."""
    T = segments_BxT.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones_like(segments_BxT[:, :1], bool),
                              segments_BxT[:, 1:] != segments_BxT[:, :-1]], axis=1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def packed(segments_BxT: jax.Array) -> Sequence:
    """The layout of packed documents `segments_BxT` (`document_segments`) on one device: attention
    inside each document, positions restarting at every document start."""
    return Sequence(document_positions(segments_BxT), segments_BxT)


@contextlib.contextmanager
def sequence_layout(sequence: Sequence | None):
    """Trace the model with the tokens laid out as `sequence` says (None: one whole sequence per
    row, the default)."""
    token = _SEQUENCE.set(sequence)
    try:
        yield
    finally:
        _SEQUENCE.reset(token)


def sequence() -> Sequence | None:
    """The layout being traced (`sequence_layout`), or None."""
    return _SEQUENCE.get()


def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    """silu(g) * u, SwiGLU's gate (Shazeer, 2020), keeping only g and u for its backward: JAX's own
    derivative of `jax.nn.silu(g) * u` keeps four more [tokens, d_ff] values (sigmoid(g), silu(g)
    and their products), most of a dense layer's saved activations. The backward recomputes
    sigmoid(g) (elementwise work) in float32."""
    return _swiglu(g, u)


@jax.custom_vjp
def _swiglu(g, u):
    return jax.nn.silu(g) * u


def _swiglu_fwd(g, u):
    return _swiglu(g, u), (g, u)


def _swiglu_bwd(res, dh):
    g, u = res
    g32, u32, dh32 = g.astype(jnp.float32), u.astype(jnp.float32), dh.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    # d silu(g) / dg = sigmoid(g) (1 + g (1 - sigmoid(g)))
    dg = dh32 * u32 * sig * (1 + g32 * (1 - sig))
    du = dh32 * g32 * sig
    return dg.astype(g.dtype), du.astype(u.dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last dim. Statistics in float32 whatever the compute dtype: bf16 sums of
    squares lose the small terms."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig):
        self.eps = cfg.norm_eps
        self.scale = param(None, (cfg.d_model,), ("embed",), cfg.param_dtype, fill=1.0)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        return rms_norm(x_BxTxD, self.scale[...], self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig):
        self.eps = cfg.norm_eps
        self.scale = param(None, (cfg.d_model,), ("embed",), cfg.param_dtype, fill=1.0)
        self.bias = param(None, (cfg.d_model,), ("embed",), cfg.param_dtype)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x = x_BxTxD.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x_BxTxD.dtype)


def norm(cfg: ModelConfig) -> nnx.Module:
    return RMSNorm(cfg) if cfg.arch == "llama" else LayerNorm(cfg)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """RoPE's inverse frequencies [H/2] (float32) of `cfg`: theta^(-2i/H), rescaled as
    `cfg.rope_scaling` says (the formulas of transformers' rope utilities, in the same order)."""
    H = cfg.head_size
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        context = cfg.rope_context
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        return jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    if cfg.rope_scaling == "yarn":
        # The dimension whose frequency turns `turns` times in the original context, from either end
        # of the ramp (YaRN's find_correction_range), rounded outwards when truncating.
        def dim(turns: float) -> float:
            return H * math.log(cfg.rope_context / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        low, high = dim(cfg.rope_beta_fast), dim(cfg.rope_beta_slow)
        if cfg.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, H - 1)
        high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
        # The ramp in numpy's float32 (a constant of the config): rounded as PyTorch rounds it, where
        # XLA's division by a constant can differ in the last bit.
        ramp = jnp.asarray(np.clip((np.arange(H // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low),
                                   0, 1))
        pos_freqs = cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
        extrapolation = 1 - ramp
        return 1.0 / (cfg.rope_factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq


def rope_attention_scale(cfg: ModelConfig) -> float:
    """What RoPE's cos and sin are multiplied by: yarn's `rope_attention_factor`, or YaRN's default
    0.1 ln(rope_factor) + 1 (1 for a factor of at most 1) when it is null; 1 for the other scalings."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor
    return 1.0 if cfg.rope_factor <= 1 else 0.1 * math.log(cfg.rope_factor) + 1.0


def softmax_gain(cfg: ModelConfig) -> float:
    """What every attention logit is multiplied by beyond 1/sqrt(head size): YaRN's mscale squared
    for `rope_mscale_all_dim` (MLA; transformers' yarn_apply_mscale), else 1."""
    if not cfg.rope_mscale_all_dim or cfg.rope_scaling == "none" or cfg.rope_factor <= 1:
        return 1.0
    return (0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1.0) ** 2


def rope_tables(seq_len: int | jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [T, H/2] (float32) for rotary position embeddings, each multiplied by
    `rope_attention_scale` (yarn's attention factor) as transformers does; for positions [B, T]
    (int: packed documents), [B, T, H/2]."""
    positions = jnp.arange(seq_len) if isinstance(seq_len, int) else seq_len
    angles_TxH2 = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
    scale = rope_attention_scale(cfg)
    if scale == 1.0:
        return jnp.cos(angles_TxH2), jnp.sin(angles_TxH2)
    return jnp.cos(angles_TxH2) * scale, jnp.sin(angles_TxH2) * scale


def apply_rope(x_BxTxNxH: jax.Array, cos_TxH2: jax.Array, sin_TxH2: jax.Array) -> jax.Array:
    """Rotate the two halves of each head (the GPT-NeoX / Hugging Face Llama convention); tables
    [T, H/2], or [B, T, H/2] (per-token positions)."""
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    lead = (None,) if cos_TxH2.ndim == 2 else ()
    cos, sin = cos_TxH2[(*lead, ..., None, slice(None))], sin_TxH2[(*lead, ..., None, slice(None))]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)


def flash_attention_applies(cfg: ModelConfig, platform: str) -> bool:
    """Whether `model.attention: auto` runs cuDNN's fused (flash) attention: on a GPU, with bf16 or
    fp16 compute and a head size cuDNN takes (a multiple of 8, at most 128). One rule, read by the
    model and the planner (`jaxpar.costs.uses_flash_attention`). jax's own default
    (`implementation=None`) is XLA's attention, which materializes the float32 [seq, seq] scores
    and probabilities of every head (checked on an H200, jax 0.11.2)."""
    return (platform == "gpu" and cfg.dtype in ("bfloat16", "float16")
            and cfg.head_size % 8 == 0 and cfg.head_size <= 128)


def dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, cfg: ModelConfig) -> jax.Array:
    """Causal attention with grouped-query heads (N a multiple of K), by `model.attention`: `xla_lse`
    (XLA's einsums and softmax, whose backward recomputes the probabilities from the saved
    log-sum-exp: `jaxpar.model.lse_attention` in causal query blocks up to `tiled_attention.BLOCK`
    positions, `jaxpar.model.tiled_attention` tiled over keys too beyond, and on packed documents),
    `xla` (`jax.nn.dot_product_attention`'s reference path, which keeps the [seq, seq]
    probabilities for the backward), `cudnn` (its fused kernel); `auto` cuDNN's kernel where
    `flash_attention_applies` on the backend the step is traced for and the sequence is one
    document, else `xla_lse`, and `xla_lse` also where cuDNN refuses the shapes while tracing (jax
    raises ValueError or NotImplementedError before emitting anything). Within the documents of
    the `sequence_layout` if one is set; by its own `attend` if it has one (context parallelism)."""
    layout = sequence()
    if layout is not None and layout.attend is not None:
        return layout.attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, cfg)
    segments = None if layout is None else layout.segments
    # (train.qk_clip: each head's largest logit, recorded inside a block body's `qk_clip.layer()`.)
    qk_clip.record(q_BxTxNxH, k_BxTxKxH, segments)
    if cfg.attention in ("xla", "cudnn"):
        mask = None
        if segments is not None:  # (model.attention: cudnn with document masking is refused by the config)
            mask = (segments[:, :, None] == segments[:, None, :])[:, None]  # [B, 1, T, S]
        return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask=mask, is_causal=True,
                                            implementation=cfg.attention)
    if cfg.attention == "auto" and segments is None and flash_attention_applies(cfg, jax.default_backend()):
        try:
            return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=True,
                                                implementation="cudnn")
        except (ValueError, NotImplementedError):
            pass
    T = q_BxTxNxH.shape[1]
    if segments is not None or tiled_attention.tile(T) < T:
        index = jnp.arange(T, dtype=jnp.int32)
        return tiled_attention.attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH,
                                         tiled_attention.Mask(index, index, segments, segments))
    if _WORKING_SET.get():  # (the planner's trace of what a layer's backward holds)
        return working_set_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH)
    return lse_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH)


class Attention(nnx.Module):
    """Causal self-attention with grouped-query heads: N query heads share K = n_kv_heads kv heads."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size
        pd, std = cfg.param_dtype, cfg.init_std
        # Residual-branch outputs scaled by 1/sqrt(2L) so the residual stream's variance stays O(1) (GPT-2).
        out_std = std / math.sqrt(2 * cfg.n_layers)
        self.arch, self.dtype, self.head_dim = cfg.arch, cfg.dtype, H
        self.rope = cfg  # read by rope_tables (head_dim, rope_theta, rope_scaling and its factors)
        self.attention = cfg  # read by dot_product_attention (model.attention, dtype, head size)
        self.wq = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), pd, std)
        self.wk = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), pd, std)
        self.wv = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), pd, std)
        self.wo = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), pd, out_std)
        self.qkv_bias, self.qk_norm, self.eps = cfg.arch == "gpt2" or cfg.qkv_bias, cfg.qk_norm, cfg.norm_eps
        if self.qkv_bias:  # gpt2; Qwen 2
            self.bq = param(None, (N, H), ("heads", "head_dim"), pd)
            self.bk = param(None, (K, H), ("kv_heads", "head_dim"), pd)
            self.bv = param(None, (K, H), ("kv_heads", "head_dim"), pd)
        if cfg.arch == "gpt2":
            self.bo = param(None, (D,), ("embed",), pd)
        if cfg.qk_norm:  # Qwen 3: one RMSNorm scale over head_dim for all query heads, one for keys
            self.q_norm = param(None, (H,), ("head_dim",), pd, fill=1.0)
            self.k_norm = param(None, (H,), ("head_dim",), pd, fill=1.0)

    def project_qkv(self, x_BxTxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries [B, T, N, H], keys and values [B, T, K, H] (biases added, RoPE not yet applied)."""
        dt = self.dtype
        # Named as projected (`ATTN_TAG`, what remat `dots_except_mlp` saves): bias, q/k norm and
        # RoPE are recomputed from them, and the norm's backward needs its input, not its output.
        q_BxTxNxH = checkpoint_name(linear(x_BxTxD, self.wq[...].astype(dt)), ATTN_TAG)
        k_BxTxKxH = checkpoint_name(linear(x_BxTxD, self.wk[...].astype(dt)), ATTN_TAG)
        v_BxTxKxH = checkpoint_name(linear(x_BxTxD, self.wv[...].astype(dt)), ATTN_TAG)
        if self.qkv_bias:
            q_BxTxNxH += self.bq[...].astype(dt)
            k_BxTxKxH += self.bk[...].astype(dt)
            v_BxTxKxH += self.bv[...].astype(dt)
        if self.qk_norm:
            q_BxTxNxH = rms_norm(q_BxTxNxH, self.q_norm[...], self.eps)
            k_BxTxKxH = rms_norm(k_BxTxKxH, self.k_norm[...], self.eps)
        return q_BxTxNxH, k_BxTxKxH, v_BxTxKxH

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        dt = self.dtype
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = self.project_qkv(x_BxTxD)
        if self.arch == "llama":  # tables for the whole sequence (constants XLA folds), or per token
            layout = sequence()
            rope = rope_tables(x_BxTxD.shape[1] if layout is None else layout.positions, self.rope)
            q_BxTxNxH = apply_rope(q_BxTxNxH, *rope)
            k_BxTxKxH = apply_rope(k_BxTxKxH, *rope)
        q_BxTxNxH = constrain(q_BxTxNxH, ("batch", "seq", "heads", "head_dim"))
        k_BxTxKxH = constrain(local_kv_heads(k_BxTxKxH), ("batch", "seq", "kv_heads", "head_dim"))
        v_BxTxKxH = constrain(local_kv_heads(v_BxTxKxH), ("batch", "seq", "kv_heads", "head_dim"))
        o_BxTxNxH = dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, self.attention)
        o_BxTxNxH = constrain(o_BxTxNxH, ("batch", "seq", "heads", "head_dim"))
        # Row-parallel: each model rank holds a partial sum until `exit_tp`; the bias comes after.
        # Named after `exit_tp`, so a policy that saves it (`dots_except_mlp`) keeps the reduced
        # value (1/t of it under SP) and the backward pass does not repeat the collective.
        out_BxTxD = checkpoint_name(exit_tp(linear(o_BxTxNxH, self.wo[...].astype(dt), 2)), ATTN_TAG)
        if self.arch == "gpt2":
            out_BxTxD += self.bo[...].astype(dt)
        return out_BxTxD


class LatentAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2/V3, `model.kv_lora_rank`). Keys and values of all
    N heads are expanded from one latent c = norm(x W_kv_a) of kv_lora_rank (W_kv_b: per head,
    qk_nope_head_dim of key and v_head_dim of value); each key's rotary part, qk_rope_head_dim
    wide, comes from x directly and is shared by all heads; queries come from x, or through
    their own normalised latent of q_lora_rank, with a no-RoPE and a rotary part per head. Training
    attends over the expanded keys and values, with the values padded to the query and key
    width (zeros: the output's extra columns are zero and dropped) so that every attention kernel,
    and context parallelism, runs unchanged; the softmax scale is 1/sqrt(qk_nope + qk_rope), times
    `softmax_gain` (YaRN's mscale_all_dim), applied to the queries so that every kernel keeps its own.

    Tensor parallelism splits the heads (W_q_b or W_q, W_kv_b, W_o) over `model`; the latent
    projections and their norms are replicated (`latent`), computed on every model rank as
    Megatron-Core does, and their gradients summed over `model`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, N = cfg.d_model, cfg.n_heads
        dn, dr, dv, r_kv, r_q = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
                                 cfg.q_lora_rank)
        pd, std = cfg.param_dtype, cfg.init_std
        out_std = std / math.sqrt(2 * cfg.n_layers)
        self.dtype, self.eps, self.widths = cfg.dtype, cfg.norm_eps, (dn, dr, dv, r_kv)
        # RoPE over the rotary part only (its tables' width is qk_rope_head_dim).
        self.rope = dataclasses.replace(cfg, kv_lora_rank=None, q_lora_rank=None, qk_nope_head_dim=None,
                                        qk_rope_head_dim=None, v_head_dim=None, head_dim=dr)
        self.attention, self.gain = cfg, softmax_gain(cfg)
        if r_q is None:
            self.wq = param(rngs, (D, N, dn + dr), ("embed", "heads", "head_dim"), pd, std)
        else:
            self.wq_a = param(rngs, (D, r_q), ("embed", "latent"), pd, std)
            self.q_norm = param(None, (r_q,), ("latent",), pd, fill=1.0)
            self.wq_b = param(rngs, (r_q, N, dn + dr), ("latent", "heads", "head_dim"), pd, std)
        self.wkv_a = param(rngs, (D, r_kv + dr), ("embed", "latent"), pd, std)
        self.kv_norm = param(None, (r_kv,), ("latent",), pd, fill=1.0)
        self.wkv_b = param(rngs, (r_kv, N, dn + dv), ("latent", "heads", "head_dim"), pd, std)
        self.wo = param(rngs, (N, dv, D), ("heads", "head_dim", "embed"), pd, out_std)

    def queries(self, x_BxTxD: jax.Array) -> jax.Array:
        """Queries [B, T, N, dn + dr], their rotary part (the last dr) without RoPE yet, times
        `softmax_gain`."""
        dt = self.dtype
        if hasattr(self, "wq"):
            q = checkpoint_name(linear(x_BxTxD, self.wq[...].astype(dt)), ATTN_TAG)
        else:
            c_q = checkpoint_name(linear(x_BxTxD, self.wq_a[...].astype(dt)), ATTN_TAG)
            q = checkpoint_name(linear(rms_norm(c_q, self.q_norm[...], self.eps), self.wq_b[...].astype(dt)), ATTN_TAG)
        return q if self.gain == 1.0 else q * jnp.asarray(self.gain, q.dtype)

    def latent(self, x_BxTxD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the normalised latent [B, T, kv_lora_rank], the shared rotary key [B, T, 1, dr] without
        RoPE yet): what a KV cache holds of each position (RoPE applied)."""
        dt, r_kv = self.dtype, self.widths[3]
        c_kv = checkpoint_name(linear(x_BxTxD, self.wkv_a[...].astype(dt)), ATTN_TAG)
        return rms_norm(c_kv[..., :r_kv], self.kv_norm[...], self.eps), c_kv[..., r_kv:, None].swapaxes(-1, -2)

    def keys_values(self, latent_BxSxR: jax.Array, k_rot_BxSx1xR: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys [B, S, N, dn + dr] (the expanded part and the shared rotary key, RoPE applied) and
        values [B, S, N, dn + dr] (v_head_dim wide, padded with zeros) of every head."""
        dt, (dn, dr, dv, _) = self.dtype, self.widths
        kv = checkpoint_name(linear(latent_BxSxR, self.wkv_b[...].astype(dt)), ATTN_TAG)
        n = kv.shape[2]  # this rank's heads
        k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_rot_BxSx1xR, (*k_rot_BxSx1xR.shape[:2], n, dr))], axis=-1)
        return k, jnp.pad(kv[..., dn:], ((0, 0), (0, 0), (0, 0), (0, dn + dr - dv)))

    def rotate(self, q_BxTxNxH: jax.Array, k_rot_BxTx1xR: jax.Array, rope) -> tuple[jax.Array, jax.Array]:
        """RoPE on the queries' rotary part and on the rotary key, by the tables `rope`."""
        dn = self.widths[0]
        return (jnp.concatenate([q_BxTxNxH[..., :dn], apply_rope(q_BxTxNxH[..., dn:], *rope)], axis=-1),
                apply_rope(k_rot_BxTx1xR, *rope))

    def output(self, o_BxTxNxH: jax.Array) -> jax.Array:
        """The attention's output [B, T, D] from the padded value heads (row-parallel, `exit_tp`)."""
        o = constrain(o_BxTxNxH[..., :self.widths[2]], ("batch", "seq", "heads", "head_dim"))
        return checkpoint_name(exit_tp(linear(o, self.wo[...].astype(self.dtype), 2)), ATTN_TAG)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        layout = sequence()
        rope = rope_tables(x_BxTxD.shape[1] if layout is None else layout.positions, self.rope)
        c, k_rot = self.latent(x_BxTxD)
        q, k_rot = self.rotate(self.queries(x_BxTxD), k_rot, rope)
        k, v = self.keys_values(c, k_rot)
        names = ("batch", "seq", "heads", "head_dim")
        return self.output(dot_product_attention(constrain(q, names), constrain(k, names), constrain(v, names),
                                                 self.attention))


def attention(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    """The attention layer `cfg` asks for: latent (`kv_lora_rank`) or grouped-query."""
    return LatentAttention(cfg, rngs=rngs) if cfg.mla else Attention(cfg, rngs=rngs)


class MLP(nnx.Module):
    """SwiGLU (llama: down(silu(gate x) * up x)) or GELU (gpt2: down(gelu(up x + b)) + b)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, F, pd, std = cfg.d_model, cfg.d_ff, cfg.param_dtype, cfg.init_std
        self.arch, self.dtype = cfg.arch, cfg.dtype
        self.w_up = param(rngs, (D, F), ("embed", "mlp"), pd, std)
        self.w_down = param(rngs, (F, D), ("mlp", "embed"), pd, std / math.sqrt(2 * cfg.n_layers))
        if cfg.arch == "llama":
            self.w_gate = param(rngs, (D, F), ("embed", "mlp"), pd, std)
        else:
            self.b_up = param(None, (F,), ("mlp",), pd)
            self.b_down = param(None, (D,), ("embed",), pd)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        dt = self.dtype
        h_BxTxF = linear(x_BxTxD, self.w_up[...].astype(dt))
        if self.arch == "llama":
            g_BxTxF = linear(x_BxTxD, self.w_gate[...].astype(dt))
            h_BxTxF = swiglu(g_BxTxF, h_BxTxF)
        else:
            h_BxTxF = jax.nn.gelu(h_BxTxF + self.b_up[...].astype(dt), approximate=True)
        h_BxTxF = constrain(h_BxTxF, ("batch", "seq", "mlp"))
        out_BxTxD = exit_tp(linear(h_BxTxF, self.w_down[...].astype(dt)))
        if self.arch == "gpt2":
            out_BxTxD += self.b_down[...].astype(dt)
        return out_BxTxD
