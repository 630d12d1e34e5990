"""FP8 weight matmuls (`model.fp8`, docs/fp8.md): each matmul of a block's attention, MLP and
experts with its input and weight in float8_e4m3fn and its output's cotangent in float8_e5m2, each
tensor with one float32 scale, current scaling (the amax of this tensor as the matmul sees it).

The scale of a tensor does not depend on the mesh: its amax is the whole tensor's, a `pmax` over
every manual mesh axis it varies over (inside a shard_map: `data` for rows of the batch or a
ZeRO/expert-parallel shard, `model` for a tensor-parallel shard or a sequence-parallel part),
never over `stage` (a stage holds other layers and other microbatches). On one device it is a
plain max. So a mesh whose ranks hold the same microbatch's parts matches one device exactly.

The lowered form is the one XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM (JAX-Toolbox's
native FP8 guide): `q = clip(x / s, -max, max).astype(f8)` (clipped first: a cast of an
out-of-range value to e4m3fn is NaN), then `dot(q.astype(dtype) * s, ...)`: a convert from f8, a
scale and a dot. On CPU the same program runs as converts to the compute dtype, so it is exactly
the upcast product and every test runs without a GPU. The backward pass (`apply`'s custom VJP)
quantizes the output's cotangent to e5m2 and takes the VJP of the same product at the dequantized
operands: the input gradient and the weight gradient are FP8 matmuls too; the residuals kept for
it are the FP8 input and its scale (a byte per element) and the weight as handed out (which the
remat policies never save: re-gathered or recast, and quantized again, in the backward pass).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar.sharding import vary, varying_axes

E4M3 = jnp.float8_e4m3fn  # forward operands: 448 at most, 3 mantissa bits
E5M2 = jnp.float8_e5m2    # gradients: 57344 at most, 2 mantissa bits

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxpar_fp8", default=False)
_DELAYED: contextvars.ContextVar[_History | None] = contextvars.ContextVar("jaxpar_fp8_delayed", default=None)

HISTORY = "fp8_history"
"""The name of a block's amax-history leaf (`model.fp8_scaling: delayed`)."""


class _History:
    """A block's amax history while the block runs: `sites` matmuls (in call order) x `TENSORS` (x,
    g) x `length` steps, flat as the leaf is stored; `take()` gives the next matmul its row."""

    def __init__(self, flat: jax.Array, sites: int, length: int):
        self.flat, self.sites, self.length, self.taken = flat, sites, length, 0

    def take(self) -> int:
        if self.taken == self.sites:
            raise AssertionError(f"model.fp8_scaling = delayed: the block ran more than its {self.sites} FP8 matmuls "
                                 "(`fp8.sites` counts fewer than the block calls)")
        self.taken += 1
        return self.taken - 1


@contextlib.contextmanager
def matmuls(on: bool = True, history: jax.Array | None = None, sites: int = 0, length: int = 0):
    """Within: the weight matmuls (`layers.linear`, `moe.grouped`) run in FP8 (when `on`). With
    `history` (a block's `fp8_history` leaf as handed out, `model.fp8_scaling: delayed`), their
    scales of x and g come from it, the i-th FP8 matmul reading row i (`sites` x `TENSORS` x
    `length`)."""
    token = _ON.set(on)
    hist = _History(history, sites, length) if on and history is not None else None
    token_d = _DELAYED.set(hist)
    try:
        yield
    finally:
        _DELAYED.reset(token_d)
        _ON.reset(token)
    if hist is not None and hist.taken != sites:
        raise AssertionError(f"model.fp8_scaling = delayed: the block ran {hist.taken} FP8 matmuls, its history has "
                             f"rows for {sites} (`fp8.sites`)")


def active() -> bool:
    return _ON.get()


def amax(x: jax.Array) -> jax.Array:
    """The largest |x| of the whole tensor, float32: a max over x's elements, then (inside a
    shard_map) a pmax over the manual axes x varies over but `stage` (module docstring)."""
    a = jnp.max(jnp.abs(x)).astype(jnp.float32)
    axes = tuple(ax for ax in varying_axes(x) if ax != "stage")
    return jax.lax.pmax(a, axes) if axes else a


def scale(x: jax.Array, fmt) -> jax.Array:
    """float32 s with max|x| / s the format's largest value (1 for an all-zero tensor)."""
    a = amax(x)
    return jnp.where(a > 0, a / float(jnp.finfo(fmt).max), 1.0)


def quantize(x: jax.Array, fmt, s: jax.Array) -> jax.Array:
    """x / s in the FP8 format `fmt`, clipped to its range first (round to nearest)."""
    top = float(jnp.finfo(fmt).max)
    return jnp.clip(x.astype(jnp.float32) / s, -top, top).astype(fmt)


def dequantize(q: jax.Array, s: jax.Array, dtype) -> jax.Array:
    """q converted to `dtype`, times its scale: the form XLA's GPU compiler folds into the GEMM."""
    return q.astype(dtype) * s.astype(dtype)


def apply(f: Callable, x: jax.Array, w: jax.Array, *rest) -> jax.Array:
    """`f(x, w, *rest)` (a product linear in x and in w, e.g. an einsum or a grouped matmul) with
    x and w in e4m3 and, in the backward pass, the output's cotangent in e5m2 (module docstring).
    `rest` (e.g. group sizes) is not differentiated. x and w must vary over the same manual axes
    (as `layers.linear` casts them), so that their cotangents come back with their types. Inside a
    block with a history (`model.fp8_scaling: delayed`), the scales are the history's (`_delayed`)."""
    hist = _DELAYED.get()
    if hist is not None:
        i = hist.take()
        axes = (*varying_axes(x), *varying_axes(hist.flat))
        return _delayed(f, i, hist.sites, hist.length, x, w, vary(hist.flat, axes), *rest)
    return _apply(f, x, w, *rest)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _apply(f, x, w, *rest):
    return _forward(f, x, w, *rest)[0]


def _forward(f, x, w, *rest):
    sx, sw = scale(x, E4M3), scale(w, E4M3)
    qx, qw = quantize(x, E4M3, sx), quantize(w, E4M3, sw)
    y = f(dequantize(qx, sx, x.dtype), dequantize(qw, sw, w.dtype), *rest)
    # Kept for the backward pass: the input in FP8 (as bytes, uint8: kept as float8 under a remat
    # policy that saves everything, `none`, the step's primal output came out NaN; jax 0.10.2,
    # XLA:CPU, measured) and its scale; the weight as handed out, quantized again there, so that
    # the remat policies treat it as every handed-out parameter (never saved: ZeRO-3 gathers it
    # again rather than hold every layer's weights). x's dtype rides along as an empty array.
    return y, (_bytes(qx), sx, jnp.zeros((0,), x.dtype), w, rest)


def _bytes(q: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _backward(f, res, g):
    qx, sx, like_x, w, rest = res
    sw = scale(w, E4M3)
    qx, qw = jax.lax.bitcast_convert_type(qx, E4M3), quantize(w, E4M3, sw)
    sg = scale(g, E5M2)
    gq = dequantize(quantize(g, E5M2, sg), sg, g.dtype)
    _, pull = jax.vjp(lambda a, b: f(a, b, *rest), dequantize(qx, sx, like_x.dtype), dequantize(qw, sw, w.dtype))
    dx, dw = pull(gq)
    return (dx, dw, *(None for _ in rest))


_apply.defvjp(_forward, _backward)


# -- delayed scaling ---------------------------------------------------------------------------------
# Each FP8 matmul's row of its block's history holds, for its input x and its output's cotangent
# g, the amaxes of the last `length` steps, newest first. This step's scales of x and g are the
# largest of them (1 for an empty history: the first step, as Transformer Engine starts); the
# weight's scale stays current (its amax, as `scale`): the weight is known before the step, so
# its amax waits on no computation, and ZeRO-3's FP8 gather (`gather`) quantizes it with that scale.
# This step's amaxes of x and g leave through the custom VJP as the history's "gradient" (at
# position 0 of each tensor's row, zeros elsewhere), and `record` shifts them in after the step.
# The amax is the whole tensor's, as current scaling's (`amax`: a pmax over the manual axes); the
# gradient reductions then sum it over every rank that holds a copy of the history (the
# transposes of the casts that made the replicated history vary), so only the first rank of
# those axes reports it and the sum is the amax exactly; over microbatches the accumulation takes
# the maximum (`is_history`, `jaxpar.parallel.microbatches.add_f32`).

TENSORS = 2
"""The tensors of a matmul with a history row: its input x (e4m3) and its output's cotangent g (e5m2)."""


def history_scales(row_2xH: jax.Array) -> jax.Array:
    """The scales [2] (x in e4m3, g in e5m2) of a matmul's history row [2, length]."""
    top = jnp.array([float(jnp.finfo(E4M3).max), float(jnp.finfo(E5M2).max)])
    a = jnp.max(row_2xH.astype(jnp.float32), axis=-1)
    return jnp.where(a > 0, a / top, 1.0)


def _first_rank(axes) -> jax.Array:
    """True on the rank whose index is 0 along every axis of `axes` (True without axes)."""
    first = jnp.bool_(True)
    for a in axes:
        first = first & (jax.lax.axis_index(a) == 0)
    return first


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _delayed(f, i, sites, length, x, w, hist, *rest):
    return _delayed_fwd(f, i, sites, length, x, w, hist, *rest)[0]


def _delayed_fwd(f, i, sites, length, x, w, hist, *rest):
    s = history_scales(hist.reshape(sites, TENSORS, length)[i])
    sw = scale(w, E4M3)
    qx, qw = quantize(x, E4M3, s[0]), quantize(w, E4M3, sw)
    y = f(dequantize(qx, s[0], x.dtype), dequantize(qw, sw, w.dtype), *rest)
    # (As `_forward`'s residuals, with x's amax, taken here, and the history's type.)
    return y, (_bytes(qx), s, amax(x), jnp.zeros((0,), x.dtype), w, hist[:0], rest)


def _delayed_bwd(f, i, sites, length, res, g):
    qx, s, ax, like_x, w, like_hist, rest = res
    sw = scale(w, E4M3)
    qx, qw = jax.lax.bitcast_convert_type(qx, E4M3), quantize(w, E4M3, sw)
    gq = dequantize(quantize(g, E5M2, s[1]), s[1], g.dtype)
    _, pull = jax.vjp(lambda a, b: f(a, b, *rest), dequantize(qx, s[0], like_x.dtype), dequantize(qw, sw, w.dtype))
    dx, dw = pull(gq)
    return (dx, dw, _report(i, sites, length, ax, amax(g), like_hist), *(None for _ in rest))


_delayed.defvjp(_delayed_fwd, _delayed_bwd)


def parts(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, Callable]:
    """The product as parts, for the pipelines' split backward (`layers.linear`: I computes the
    input's gradient, W the weight's, each from the dequantized operands and cotangent): (x and w
    quantized and dequantized, a wrapper of the product's output that quantizes its cotangent),
    each with a straight-through gradient, so that `out(f(x', w'))` has `apply(f, x, w)`'s value
    and gradients. Inside a block with a history (delayed scaling) x's and g's scales are the
    history's and the wrapper reports their amaxes, as `_delayed` does."""
    hist = _DELAYED.get()
    if hist is None:
        return fake_quantize(x), fake_quantize(w), cotangent_in_e5m2
    i = hist.take()
    h = vary(hist.flat, (*varying_axes(x), *varying_axes(hist.flat)))
    s = history_scales(jax.lax.stop_gradient(h).reshape(hist.sites, TENSORS, hist.length)[i])
    ax = amax(jax.lax.stop_gradient(x))
    return (_fake_quantize_at(x, s[0]), fake_quantize(w),
            lambda y: _cotangent_delayed(i, hist.sites, hist.length, y, h, s[1], ax))


@jax.custom_vjp
def _fake_quantize_at(x: jax.Array, s: jax.Array) -> jax.Array:
    """x quantized to e4m3 with the scale `s` and dequantized; the gradient passes straight through."""
    return dequantize(quantize(x, E4M3, s), s, x.dtype)


_fake_quantize_at.defvjp(lambda x, s: (_fake_quantize_at(x, s), None), lambda _, g: (g, None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _cotangent_delayed(i, sites, length, y, hist, sg, ax):
    """y itself; in the backward pass its cotangent quantized to e5m2 with the history's scale
    `sg`, and the amaxes of x (`ax`) and of the cotangent reported as `hist`'s cotangent."""
    return y


def _cotangent_delayed_fwd(i, sites, length, y, hist, sg, ax):
    return y, (sg, ax, hist[:0])


def _cotangent_delayed_bwd(i, sites, length, res, g):
    sg, ax, like_hist = res
    return dequantize(quantize(g, E5M2, sg), sg, g.dtype), _report(i, sites, length, ax, amax(g), like_hist), None, None


_cotangent_delayed.defvjp(_cotangent_delayed_fwd, _cotangent_delayed_bwd)


def _report(i, sites, length, ax, ag, like_hist) -> jax.Array:
    """A history's cotangent reporting one matmul's amaxes of x and g: position 0 of row i, zeros
    elsewhere, on the first rank of the axes the history varies over but `stage` (whose copies the
    gradient reductions sum), zeros on the others."""
    axes = sorted(a for a in set(varying_axes(like_hist)) if a != "stage")
    amaxes = jnp.where(_first_rank(axes), jnp.stack([ax, ag]), 0.0)
    ct = jnp.zeros((sites, TENSORS, length), jnp.float32).at[i, :, 0].set(amaxes).reshape(-1)
    return vary(ct.astype(like_hist.dtype), varying_axes(like_hist))


def is_history(path) -> bool:
    """Is this tree path (`jax.tree_util` keys, or their `keystr`: the pipeline's flat
    accumulators) a block's amax history (`model.fp8_scaling: delayed`)?"""
    if isinstance(path, str):
        return path.endswith(f"['{HISTORY}']")
    return bool(path) and getattr(path[-1], "key", None) == HISTORY


def without_amax(grads: Any) -> Any:
    """The gradients with zeros for every history leaf (whose "gradient" is the step's amaxes)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: jnp.zeros_like(x) if is_history(p) else x, grads)


def record(params: Any, grads: Any, length: int) -> Any:
    """`params` with each history leaf's rows shifted by one step, this step's amaxes (position 0 of
    each row of the leaf's "gradient" in `grads`) in front: the newest `length` steps kept."""
    def one(p, h, a):
        if not is_history(p):
            return h
        rows, new = h.reshape(*h.shape[:-1], -1, length), a.reshape(*a.shape[:-1], -1, length)
        return jnp.concatenate([new[..., :1].astype(h.dtype), rows[..., :-1]], axis=-1).reshape(h.shape)
    return jax.tree_util.tree_map_with_path(one, params, grads)


# -- ZeRO-3's gathers in FP8 ------------------------------------------------------------------------


def gathered(names) -> bool:
    """Does ZeRO-3 gather a parameter with these logical names (as `use_params` hands it out) in
    FP8: a matrix of a block (attention, MLP, experts, MLA's projections; the MTP modules' blocks),
    not the embedding or output head (`vocab`), the router, or MTP's input projection."""
    return sum(n not in ("layers", "mtp") for n in names) >= 2 and not {"vocab", "router", "mtp_cat"} & set(names)


def gather(shard: jax.Array, all_gather: Callable, dtype, stacked: int = 0) -> jax.Array:
    """A ZeRO-3 weight shard quantized to e4m3 with the whole weight's scale (`scale`: the pmax
    over the axes the shard varies over, `data` among them), gathered by `all_gather` as bytes (1
    per element: half of bf16's), and dequantized in `dtype`: the e4m3 values `apply` computes
    from the gathered weight, which it quantizes again to the same values. A stack of weights
    (`stacked` leading dims: `layers`, `mtp`; `parallel.zero3_gather: step` gathers whole stacks)
    has a scale per weight, as each layer's matmul sees it."""
    if stacked:
        axes = tuple(ax for ax in varying_axes(shard) if ax != "stage")
        a = jnp.max(jnp.abs(shard), axis=tuple(range(stacked, shard.ndim)), keepdims=True).astype(jnp.float32)
        a = jax.lax.pmax(a, axes) if axes else a
        s = jnp.where(a > 0, a / float(jnp.finfo(E4M3).max), 1.0)
    else:
        s = scale(shard, E4M3)
    full = jax.lax.bitcast_convert_type(all_gather(_bytes(quantize(shard, E4M3, s))), E4M3)
    return dequantize(full, s, dtype)


# -- the same product as parts (the pipeline's split backward, `layers.linear`) ---------------------
# `cotangent_in_e5m2(f(fake_quantize(x), fake_quantize(w)))` has `apply(f, x, w)`'s value and
# gradients (the gradient passes each quantization straight through, as `apply`'s backward takes
# the VJP at the dequantized operands), while letting the split backward compute the input and
# weight gradients in different actions (I and W) from the dequantized operands and cotangent.


@jax.custom_vjp
def fake_quantize(x: jax.Array) -> jax.Array:
    """x quantized to e4m3 with its whole-tensor scale and dequantized; the gradient passes
    straight through."""
    s = scale(x, E4M3)
    return dequantize(quantize(x, E4M3, s), s, x.dtype)


fake_quantize.defvjp(lambda x: (fake_quantize(x), None), lambda _, g: (g,))


@jax.custom_vjp
def cotangent_in_e5m2(y: jax.Array) -> jax.Array:
    """y itself; in the backward pass its cotangent quantized to e5m2 (whole-tensor scale) and
    dequantized."""
    return y


def _e5m2_bwd(_, g):
    s = scale(g, E5M2)
    return (dequantize(quantize(g, E5M2, s), s, g.dtype),)


cotangent_in_e5m2.defvjp(lambda y: (y, None), _e5m2_bwd)

