"""`model.moe_kernel` (docs/moe.md, "Kernel choice"): the Pallas grouped GEMMs
(`jaxpar.model.grouped_gemm`, interpreted on CPU) against `jax.lax.ragged_dot` and a per-expert
dense loop (values, input and weight gradients), their Triton lowering without a GPU, every kernel
choice through `moe.grouped` (FP8 included), MoE parity with one device, the compiled layer's
largest buffer, and the key's refusal."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import assert_parity, run_steps
from jaxpar.config import ConfigError, load_config, validate
from jaxpar.model import fp8, grouped_gemm
from jaxpar.model import moe as moe_lib
from test_moe import moe_run, reference_run

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # CPU thread-count warnings

SMALL = grouped_gemm.Tiles(m=16, n=16, k=16)  # several tiles per dim at these shapes


def dense_loop(x, w, sizes):
    """Each expert's rows times its matrix, one product per expert; the rows past the groups 0."""
    y, start = np.zeros((x.shape[0], w.shape[2]), np.float64), 0
    for e, n in enumerate(sizes):
        y[start:start + n] = np.asarray(x[start:start + n], np.float64) @ np.asarray(w[e], np.float64)
        start += n
    return y


def dense_loop_grads(x, w, sizes, g):
    """(dx, dw) of sum(g * dense_loop(x, w)): per expert g_e w_eᵀ and x_eᵀ g_e; 0 elsewhere."""
    x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
    dx, dw, start = np.zeros_like(x), np.zeros_like(w), 0
    for e, n in enumerate(sizes):
        dx[start:start + n] = g[start:start + n] @ w[e].T
        dw[e] = x[start:start + n].T @ g[start:start + n]
        start += n
    return dx, dw


# Empty experts (first, middle, last, all), groups that do not divide the 16-row tile and groups
# sharing a tile, a group of exactly one tile, rows past the groups (M above the sum), and 40
# contraction columns (not a multiple of 16: padded) into 20 outputs.
SIZES = [[5, 0, 23, 9], [0, 0, 0], [16, 16], [40, 1, 0, 3], [0, 7, 0], [3, 3, 3, 3, 3, 3, 3, 3]]


@pytest.mark.parametrize("sizes", SIZES)
def test_pallas_grouped_gemm_is_ragged_dot_and_the_dense_loop(sizes):
    M, E, C, O = sum(sizes) + 11, len(sizes), 40, 20
    x = jax.random.normal(jax.random.key(0), (M, C))
    w = jax.random.normal(jax.random.key(1), (E, C, O))
    g = jax.random.normal(jax.random.key(2), (M, O))
    s = jnp.array(sizes, jnp.int32)
    y, pull = jax.vjp(lambda x, w: grouped_gemm.gmm(x, w, s, tiles=SMALL, interpret=True), x, w)
    dx, dw = pull(g)
    want_dx, want_dw = dense_loop_grads(x, w, sizes, g)
    # float32 sums of 40 (values, dx: 20) products of unit normals, or of up to 40 rows (dw), in
    # another order than float64's: observed <= 1.2e-5.
    np.testing.assert_allclose(y, dense_loop(x, w, sizes), atol=5e-5)
    np.testing.assert_allclose(dx, want_dx, atol=5e-5)
    np.testing.assert_allclose(dw, want_dw, atol=5e-5)
    assert not np.any(np.asarray(y)[sum(sizes):]) and not np.any(np.asarray(dx)[sum(sizes):])  # exactly 0
    ragged = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, s), x, w)
    np.testing.assert_allclose(y, ragged[0], atol=5e-5)
    for a, b in zip((dx, dw), ragged[1](g)):
        np.testing.assert_allclose(a, b, atol=5e-5)


def test_pallas_grouped_gemm_in_bfloat16():
    """bf16 operands, float32 accumulation, a bf16 result: against the float64 loop over the same
    bf16 values, off by the result's rounding (8 significant bits: relative 2^-8) and the
    cotangent's (the backward casts g to x's dtype), so 1% of the largest magnitude."""
    sizes = [37, 0, 50, 9]
    M, E, C, O = 100, 4, 64, 48
    x = jax.random.normal(jax.random.key(0), (M, C), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (E, C, O), jnp.bfloat16)
    g = jax.random.normal(jax.random.key(2), (M, O), jnp.bfloat16)
    s = jnp.array(sizes, jnp.int32)
    y, pull = jax.vjp(lambda x, w: grouped_gemm.gmm(x, w, s, tiles=SMALL, interpret=True), x, w)
    dx, dw = pull(g)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    for got, want in zip((y, dx, dw), (dense_loop(x, w, sizes), *dense_loop_grads(x, w, sizes, g))):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-2 * np.max(np.abs(want)))


def test_work_items_cover_each_groups_tiles_once():
    """The forward's work list: each group's items are the row tiles its rows touch, the rows past
    the groups one more group, the rest unused (group E + 1): ceil(M / tm) + E items suffice."""
    tile, group = grouped_gemm.work_items(jnp.array([5, 0, 23, 9], jnp.int32), 50, 16)
    pairs = [(int(t), int(e)) for t, e in zip(tile, group) if e <= 4]
    assert pairs == [(0, 0), (0, 2), (1, 2), (1, 3), (2, 3), (2, 4), (3, 4)]  # rows 0-4, 5-27, 28-36, 37-49
    assert len(tile) == 4 + 4 and all(int(e) == 5 for e in group[len(pairs):])


def test_the_triton_lowering_holds_three_kernels_and_no_ragged_dot():
    """The GPU path lowers without a GPU (jax.export for CUDA): forward and both gradients are
    Triton calls (tile shapes powers of 2, every primitive one the Triton lowering has), at a
    DeepSeek-like expert width (704, not a multiple of 128: padded), in bf16; and in a shard_map
    over `data`, as the MoE layer calls it."""
    def fwd_bwd(x, w, s):
        y, pull = jax.vjp(lambda x, w: grouped_gemm.gmm(x, w, s, interpret=False), x, w)
        return y, pull(y)

    args = (jax.ShapeDtypeStruct((1000, 256), jnp.bfloat16), jax.ShapeDtypeStruct((8, 256, 704), jnp.bfloat16),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    mesh = jax.sharding.AbstractMesh((2,), ("data",))
    sharded = jax.shard_map(fwd_bwd, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=(P("data"), (P("data"), P())))
    for f in (fwd_bwd, sharded):
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
        assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 3
        assert not re.search(r"(chlo|stablehlo|mhlo)\.ragged_dot", text)


@pytest.mark.parametrize("kernel", ["auto", "ragged_dot", "pallas"])
@pytest.mark.parametrize("fp8_on", [False, True])
def test_every_kernel_choice_is_the_grouped_matmul(kernel, fp8_on):
    """`moe.grouped` with each `model.moe_kernel`: the dense loop's values and gradients; under
    FP8 (`fp8.apply` around any product linear in x and w) each kernel equals the default's."""
    sizes = [9, 0, 20, 4]
    x = jax.random.normal(jax.random.key(0), (40, 24))
    w = jax.random.normal(jax.random.key(1), (4, 24, 16))
    s = jnp.array(sizes, jnp.int32)

    def run(k):
        with fp8.matmuls(fp8_on):
            return jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(moe_lib.grouped(x, w, s, k))), (0, 1))(x, w)

    got = run(kernel)
    if fp8_on:  # e4m3 operands: compare with the default kernel under the same quantization
        want = run("auto")
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, atol=1e-4)
        return
    h = dense_loop(x, w, sizes)
    np.testing.assert_allclose(got[0], np.sum(np.sin(h)), rtol=1e-5)
    dx, dw = dense_loop_grads(x, w, sizes, np.cos(h))
    np.testing.assert_allclose(got[1][0], dx, atol=5e-5)
    np.testing.assert_allclose(got[1][1], dw, atol=5e-5)


def test_pallas_in_a_shard_map_matches_each_ranks_ragged_dot():
    """Interpreted inside a shard_map (the layer's case: operands varying over `data`), each rank's
    rows and sizes its own; the experts' gradient summed over the ranks by the cast's transpose."""
    mesh = jax.make_mesh((8,), ("data",))
    x = jax.random.normal(jax.random.key(0), (8 * 24, 16))
    w = jax.random.normal(jax.random.key(1), (3, 16, 8))
    s = jnp.array([[r, 0, 20 - r] for r in range(8)], jnp.int32)

    def per_rank(f):
        body = lambda x, w, s: f(x, w, s[0])  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P("data"))

    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    xs, ss = put(x, P("data")), put(s, P("data"))
    pallas = lambda x, w, s: grouped_gemm.gmm(x, w, s, tiles=SMALL)  # noqa: E731
    got = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(per_rank(pallas)(x, w, ss))), (0, 1)))(xs, w)
    want = jax.jit(jax.value_and_grad(
        lambda x, w: jnp.sum(jnp.sin(per_rank(jax.lax.ragged_dot)(x, w, ss))), (0, 1)))(xs, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


# Parity with one device (the default kernel's run, shared with tests/test_moe.py's references):
# data-8 with every expert on every rank (`experts_dropless`), 8 experts over 8 data ranks
# (`experts_parallel`), expert parallelism beside tensor parallelism, and a 1F1B pipeline on
# (2, 2, 2). Each compiles twice and takes 30-40 s on 2 cores.
PALLAS_PARITY = [((8, 1, 1), dict(expert_parallel=False)), ((8, 1, 1), dict(n_experts=8)),
                 ((4, 1, 2), dict()), ((2, 2, 2), dict(zero=0))]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, options", PALLAS_PARITY,
                         ids=["dropless_data8", "expert_parallel_data8", "ep4_tp2", "1f1b_2x2x2"])
def test_pallas_moe_matches_single_device(mesh, options):
    cfg = moe_run(*mesh, **{"zero": 1, **options})
    out = run_steps(cfg.replace(model={"moe_kernel": "pallas"}))
    assert_parity(out, reference_run(cfg))
    assert out["moe"].shape[1] >= 4  # the router metrics were compared


def test_an_unknown_moe_kernel_is_refused_before_compiling():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.n_experts=4", "model.moe_kernel=megablocks"])
    msg = str(err.value)
    assert "megablocks" in msg and "model.moe_kernel" in msg and "'pallas'" in msg and "\n" not in msg
    cfg = load_config(None, ["model.n_experts=4"])
    with pytest.raises(ConfigError, match=r"model.moe_kernel = 'cutlass' is not a grouped-matmul kernel jaxpar has "
                                          r"\(one of auto, ragged_dot, pallas\); set model.moe_kernel=auto\."):
        validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_kernel="cutlass")))


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def largest_arrays(hlo_text: str, n: int = 3) -> list[tuple[int, str]]:
    """The n largest arrays (bytes, shape) any instruction of a compiled program names."""
    sizes = {(int(np.prod([int(d) for d in dims.split(",") if d])) * _BYTES[t], f"{t}[{dims}]")
             for t, dims in re.findall(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]", hlo_text) if t in _BYTES}
    return sorted(sizes, reverse=True)[:n]


@pytest.mark.parametrize("kernel", ["auto", "pallas"])
def test_the_compiled_layer_holds_the_routed_rows_not_tokens_times_experts(kernel):
    """Dropless dispatch, forward and backward compiled: no array of the program is as large as
    [tokens, experts, d_model] (N·E·D = 512·32·64 float32 = 4 MiB). The Pallas kernel's largest is
    the routed rows' (N·k rows and one tile, 576 KiB for gate and up together); `auto` on CPU
    (`_blocked`) adds each group's padding to whole blocks of 128 rows (N·k + E·128 rows: 1.25 MiB)."""
    N, D, F, E, k = 512, 64, 64, 32, 2
    x = jax.random.normal(jax.random.key(0), (N, D))
    experts = jax.random.randint(jax.random.key(1), (N, k), 0, E)
    gates = jnp.full((N, k), 0.5)
    w = [jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate([(E, D, F), (E, D, F), (E, F, D)], 2)]

    def loss(x, *w):
        return jnp.sum(moe_lib.experts_dropless(x, experts, gates, *w, kernel=kernel) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, *w).compile().as_text()
    (top, shape), *_ = largest_arrays(text)
    # pallas: observed f32[1152, 128], the routed rows and one tile more, with the gate and up
    # products side by side (XLA fuses the two), the only array above the expert stacks.
    bound = (N * k + E * moe_lib.GROUP_BLOCK) * D * 4 if kernel == "auto" else (N * k + 128) * 2 * F * 4
    assert top <= bound < N * E * D * 4 // 3, (shape, largest_arrays(text))


@pytest.mark.parametrize("kernel", ["auto", "pallas"])
def test_the_compiled_expert_parallel_layer_holds_its_buffers_not_tokens_times_experts(kernel):
    """Expert parallelism (`experts_parallel`, the fixed exchange CPU runs) on 4 data ranks, 32
    experts (8 per rank), forward and backward compiled: no array of the program is as large as a
    rank's [tokens, experts, d_model] (N·E·D = 64·32·64 float32 = 512 KiB); the largest is the
    exchange's receive buffer (4 ranks x N·min(k, 8) rows of d_model: 128 KiB) or its padding to
    `_blocked`'s blocks (+ 8 local experts x one block of 128 rows, or for Pallas the gate and up
    products side by side). (Fails for `ragged_dot`, whose CPU lowering is dense over the experts.)"""
    d, N, D, F, E, k = 4, 64, 64, 64, 32, 2
    El, rows = E // d, N * k
    mesh = jax.make_mesh((d,), ("data",), devices=jax.devices()[:d])

    def body(x, experts, gates, *w):
        return moe_lib.experts_parallel(x, experts, gates, None, *w, n_experts=E, rows=rows, kernel=kernel)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 6, out_specs=P("data"))

    def loss(x, experts, gates, *w):
        return jnp.sum(f(x, experts, gates, *w) ** 2)

    shard = NamedSharding(mesh, P("data"))
    args = [jax.ShapeDtypeStruct(s, t, sharding=shard) for s, t in [
        ((d * N, D), jnp.float32), ((d * N, k), jnp.int32), ((d * N, k), jnp.float32), ((E, D, F), jnp.float32),
        ((E, D, F), jnp.float32), ((E, F, D), jnp.float32)]]
    text = jax.jit(jax.grad(loss, argnums=(0, 3, 4, 5))).lower(*args).compile().as_text()
    # Per-device shapes: the program's arguments (the global x, weights) are sharded into it, so its
    # arrays are the rank's; the weight stacks (E/d experts of D x F) are the next largest.
    (top, shape), *_ = largest_arrays(text)
    buffer = d * rows * D * 4
    bound = (buffer + El * moe_lib.GROUP_BLOCK * D * 4) if kernel == "auto" else 2 * buffer + 128 * 2 * F * 4
    assert top <= bound < N * E * D * 4 * 2, (shape, largest_arrays(text))
