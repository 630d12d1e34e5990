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
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.sharding import varying_axes

E4M3 = jnp.float8_e4m3fn  # forward operands: 448 at most, 3 mantissa bits
E5M2 = jnp.float8_e5m2    # gradients: 57344 at most, 2 mantissa bits

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxpar_fp8", default=False)


@contextlib.contextmanager
def matmuls(on: bool = True):
    """Within: the weight matmuls (`layers.linear`, `moe.grouped`) run in FP8 (when `on`)."""
    token = _ON.set(on)
    try:
        yield
    finally:
        _ON.reset(token)


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
    (as `layers.linear` casts them), so that their cotangents come back with their types."""
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


# -- ZeRO-3's gathers in FP8 ------------------------------------------------------------------------


def gathered(names) -> bool:
    """Does ZeRO-3 gather a parameter with these logical names (as `use_params` hands it out) in
    FP8: a matrix of a block (attention, MLP, experts, MLA's projections; the MTP modules' blocks),
    not the embedding or output head (`vocab`), the router, or MTP's input projection."""
    return sum(n not in ("layers", "mtp") for n in names) >= 2 and not {"vocab", "router", "mtp_cat"} & set(names)


def gather(shard: jax.Array, all_gather: Callable, dtype) -> jax.Array:
    """A ZeRO-3 weight shard quantized to e4m3 with the whole weight's scale (`scale`: the pmax
    over the axes the shard varies over, `data` among them), gathered by `all_gather` as bytes (1
    per element: half of bf16's), and dequantized in `dtype`: the e4m3 values `apply` computes
    from the gathered weight, which it quantizes again to the same values."""
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

