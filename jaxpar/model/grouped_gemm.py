"""Grouped GEMMs as Pallas kernels (`model.moe_kernel: pallas`): the MoE expert matmuls computed
over the routed rows only, forward, input gradient and weight gradient.

The rows of x [M, C] are grouped by expert: the first sizes[0] rows are expert 0's, the next
sizes[1] expert 1's, ...; rows past the last group come out 0 (`moe.grouped`'s contract, that of
`jax.lax.ragged_dot`). XLA:GPU rewrites `ragged_dot` into a dense product over all E experts
(docs/moe.md, measured on an H200), so these kernels never ask XLA for a ragged contraction:

- `gmm`, y = x · w[group(row)]: a grid over (work items, output column tiles). A work item is a
  (row tile, group) pair: MegaBlocks' / megablox's layout, each group's rows cut by the fixed row
  tiles without padding, so a tile where two groups meet is visited once per group, each visit
  masked to its group's rows (disjoint rows: the stores never overlap, in any order). There are at
  most ceil(M / tm) + E items (one more per group boundary inside a tile); the rows past the last
  group are one more group whose items store zeros without a product (an expert-parallel receive
  buffer is mostly such rows). Items beyond the count run nothing.
- its VJP: dx = gmm(g, wᵀ) (the same kernel reading w transposed, no transposed copy), and
  dw[e] = x_eᵀ g_e (`tgmm`): a grid over (experts, C tiles, O tiles), each program looping over
  the row tiles of its expert's group (a dynamic trip count: 0 for an empty expert, whose gradient
  is 0), both operands masked to the group's rows.

Work: the routed rows' FLOPs plus, per group boundary, one partly masked tile (≤ (E − 1)·tm rows of
wasted multiply in all), against E times the routed FLOPs for XLA:GPU's dense rewrite. Memory:
the inputs padded to whole tiles only where a dim is not a multiple of its tile (no copy at the
usual widths), and the metadata (a few int32 vectors of length ceil(M / tm) + E).

Backends: Triton on GPU (`jax.experimental.pallas.triton`: tile sizes powers of 2, at least 16
for `tl.dot`; float32 products in IEEE precision, bf16 and fp16 products accumulated in float32),
the Pallas interpreter on CPU (`interpret=True`, chosen from the backend: a scan over the grid,
for tests, not for speed). The tile sizes are not tuned: no GPU has run this kernel yet
(docs/moe.md, "Kernel choice").
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Rows, output columns and contraction width of one tile; each is capped at the next power
    of 2 of its dim (and at least 16: Triton's dot) where the operands are smaller."""

    m: int = 128
    n: int = 128
    k: int = 64
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TILES = Tiles()


def gmm(x_MxC: jax.Array, w_ExCxO: jax.Array, sizes_E: jax.Array, *, tiles: Tiles = DEFAULT_TILES,
        interpret: bool | None = None) -> jax.Array:
    """The grouped product [M, O] of `moe.grouped` (module docstring), differentiable in x and w.
    `interpret`: None runs the Pallas interpreter exactly when the default backend is the CPU."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    axes = jax.typeof(x_MxC).manual_axis_type.varying | jax.typeof(w_ExCxO).manual_axis_type.varying
    return _gmm_vjp(_vary(x_MxC, axes), _vary(w_ExCxO, axes), sizes_E.astype(jnp.int32), tiles, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_vjp(x_MxC, w_ExCxO, sizes_E, tiles, interpret):
    return _gmm(x_MxC, w_ExCxO, sizes_E, tiles, interpret, transpose=False)


def _gmm_fwd(x_MxC, w_ExCxO, sizes_E, tiles, interpret):
    return _gmm(x_MxC, w_ExCxO, sizes_E, tiles, interpret, transpose=False), (x_MxC, w_ExCxO, sizes_E)


def _gmm_bwd(tiles, interpret, res, g_MxO):
    x_MxC, w_ExCxO, sizes_E = res
    g_MxO = g_MxO.astype(x_MxC.dtype)
    dx = _gmm(g_MxO, w_ExCxO, sizes_E, tiles, interpret, transpose=True).astype(x_MxC.dtype)
    dw = tgmm(x_MxC, g_MxO, sizes_E, w_ExCxO.shape[0], tiles=tiles, interpret=interpret).astype(w_ExCxO.dtype)
    return dx, dw, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


def _launch(kernel, grid: tuple[int, ...], operands: tuple[jax.Array, ...], shape: tuple[int, ...], dtype,
            tiles: Tiles, interpret: bool, name: str) -> jax.Array:
    """`kernel(program ids, accumulate, *operand refs, output ref)` run over `grid`: a `pallas_call` (Triton;
    or the Pallas interpreter), except interpreted inside a shard_map, where the same kernel runs
    as a `fori_loop` over the grid, each program a `pl.run_state` over the refs. (jax 0.10.2's
    interpreter evaluates the kernel traced without the operands' manual-axis types, and refuses
    the first operation that mixes a varying operand with a program id; tracing the kernel here,
    inside the shard_map, types it.) All operands are cast to x's (the last operand's) axes."""
    x = operands[-1]
    axes = jax.typeof(x).manual_axis_type.varying
    operands = tuple(_vary(a, axes) for a in operands)
    if interpret and axes:
        def program(p, y):
            ids = tuple(p // math.prod(grid[a + 1:]) % grid[a] for a in range(len(grid)))
            return pl.run_state(lambda refs: kernel(ids, accumulate, *refs))((*operands, y))[-1]

        def accumulate(steps, most, step, tile_shape, ref):
            # A float32 sum over `most` steps, those from `steps` on masked out (run_state's
            # discharge of a while loop fails on manual-axis types in jax 0.10.2; a scan's does not),
            # from zeros typed as the operands (through `ref`, one of them).
            zeros = jnp.where(False, ref[(0,) * ref.ndim].astype(jnp.float32), jnp.zeros(tile_shape, jnp.float32))
            return jax.lax.fori_loop(0, most, lambda t, acc: jnp.where(t < steps, step(t, acc), acc), zeros)


        return jax.lax.fori_loop(0, math.prod(grid), program, _vary(jnp.zeros(shape, dtype), axes))
    out = jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(x).manual_axis_type)
    return pl.pallas_call(
        lambda *refs: kernel(tuple(pl.program_id(a) for a in range(len(grid))), _accumulate, *refs),
        grid=grid, out_shape=out,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name=name)(*operands)


def _accumulate(steps, most, step, tile_shape, ref):
    """sum over t < `steps` (at most `most`) of step(t, acc), from float32 zeros (`ref` unused)."""
    del most, ref
    return jax.lax.fori_loop(0, steps, step, jnp.zeros(tile_shape, jnp.float32))


def _vary(a: jax.Array, axes) -> jax.Array:
    missing = tuple(sorted(set(axes) - jax.typeof(a).manual_axis_type.varying))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def _tile(size: int, dim: int) -> int:
    """`size`, or the next power of 2 of `dim` (at least 16) when that is smaller."""
    return max(16, min(size, pl.next_power_of_2(dim)))


def _pad(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """x with zeros appended along `axis` up to a multiple (no copy when it is one already)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def group_bounds(sizes_E: jax.Array, M: int) -> tuple[jax.Array, jax.Array]:
    """(start, end) [E + 1] of each group's rows, the last group being the rows past the experts'
    (end clipped to M: sizes summing past M cover the rows there are)."""
    ends = jnp.minimum(jnp.cumsum(sizes_E), M).astype(jnp.int32)
    starts = ends - jnp.minimum(sizes_E, ends).astype(jnp.int32)
    return jnp.append(starts, ends[-1]), jnp.append(ends, jnp.int32(M))


def work_items(sizes_E: jax.Array, M: int, tm: int) -> tuple[jax.Array, jax.Array]:
    """`gmm`'s work list from the group sizes: (row tile [I], group [I]) with I = ceil(M / tm) + E,
    the most any sizes need; the items of group g are the row tiles its rows touch, in order,
    group E is the rows past the experts', and the unused items are tile 0 of group E + 1. (Counts of boundaries passed, not
    `jnp.searchsorted`: that fails on manual-axis-typed values inside a shard_map in jax 0.10.2.)"""
    E = sizes_E.shape[0]
    starts_G, ends_G = group_bounds(sizes_E, M)
    first_G = starts_G // tm
    count_G = jnp.where(ends_G > starts_G, (ends_G - 1) // tm - first_G + 1, 0)
    cum_G = jnp.cumsum(count_G)
    item_I = jnp.arange(-(-M // tm) + E, dtype=jnp.int32)
    group_I = jnp.sum(item_I[:, None] >= cum_G[None, :], axis=1).astype(jnp.int32)  # E + 1: unused
    g = jnp.minimum(group_I, E)
    tile_I = jnp.where(group_I <= E, first_G[g] + item_I - (cum_G[g] - count_G[g]), 0)
    return tile_I.astype(jnp.int32), group_I


def _gmm(x_MxC, w_ExCxO, sizes_E, tiles: Tiles, interpret: bool, *, transpose: bool) -> jax.Array:
    """y [M, O] = x · w[group] (or x · w[group]ᵀ with `transpose`, w then [E, O, C])."""
    M, C = x_MxC.shape
    E = w_ExCxO.shape[0]
    O = w_ExCxO.shape[1] if transpose else w_ExCxO.shape[2]
    tm, tn, tk = _tile(tiles.m, M), _tile(tiles.n, O), _tile(tiles.k, C)
    x = _pad(_pad(x_MxC, 0, tm), 1, tk)
    w = _pad(_pad(w_ExCxO, 1, tn if transpose else tk), 2, tk if transpose else tn)
    tile_I, group_I = work_items(sizes_E, M, tm)
    starts_G, ends_G = group_bounds(sizes_E, M)
    starts_G, ends_G = jnp.append(starts_G, 0), jnp.append(ends_G, 0)  # group E + 1: the unused items
    dtype = jnp.result_type(x_MxC.dtype, w_ExCxO.dtype)

    def kernel(ids, accumulate, tile_ref, group_ref, start_ref, end_ref, w_ref, x_ref, y_ref):
        i, n = ids

        # (No `pl.when` for the unused items: they read tile 0 under an empty group, so nothing is
        # multiplied or stored; a `lax.cond` fails in run_state's discharge in jax 0.10.2.)
        tile, group = tile_ref[i], group_ref[i]
        e = jnp.minimum(group, E - 1)
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mine = (rows >= start_ref[group]) & (rows < end_ref[group])

        def step(kk, acc):
            x_bxk = x_ref[pl.ds(tile * tm, tm), pl.ds(kk * tk, tk)]
            if transpose:
                w_nxk = w_ref[e, pl.ds(n * tn, tn), pl.ds(kk * tk, tk)]
                return acc + jnp.dot(x_bxk, w_nxk.T, preferred_element_type=jnp.float32)
            w_kxn = w_ref[e, pl.ds(kk * tk, tk), pl.ds(n * tn, tn)]
            return acc + jnp.dot(x_bxk, w_kxn, preferred_element_type=jnp.float32)

        # The rows past the experts' (group E) store zeros: no product.
        steps = jnp.where(group < E, x_ref.shape[1] // tk, 0)
        acc = accumulate(steps, x_ref.shape[1] // tk, step, (tm, tn), x_ref)
        plgpu.store(y_ref.at[pl.ds(tile * tm, tm), pl.ds(n * tn, tn)], acc.astype(y_ref.dtype), mask=mine)

    y = _launch(kernel, (tile_I.shape[0], -(-O // tn)), (tile_I, group_I, starts_G, ends_G, w, x),
                (x.shape[0], -(-O // tn) * tn), dtype, tiles, interpret, "grouped_gemm_t" if transpose else "grouped_gemm")
    return y[:M, :O]


def tgmm(x_MxC: jax.Array, g_MxO: jax.Array, sizes_E: jax.Array, n_groups: int, *, tiles: Tiles = DEFAULT_TILES,
         interpret: bool | None = None) -> jax.Array:
    """dw [E, C, O], dw[e] = x_eᵀ · g_e over group e's rows (the weight gradient of `gmm`; 0 for
    an empty group; rows past the groups ignored): a grid over (E, C tiles, O tiles), each program
    looping over its group's row tiles."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    M, C = x_MxC.shape
    O = g_MxO.shape[1]
    tm, tc, tn = _tile(tiles.m, M), _tile(tiles.n, C), _tile(tiles.n, O)
    x = _pad(_pad(x_MxC, 0, tm), 1, tc)
    g = _pad(_pad(g_MxO.astype(x_MxC.dtype), 0, tm), 1, tn)
    starts_G, ends_G = group_bounds(sizes_E.astype(jnp.int32), M)

    def kernel(ids, accumulate, start_ref, end_ref, g_ref, x_ref, dw_ref):
        e, c, n = ids
        start, end = start_ref[e], end_ref[e]
        first = start // tm

        def step(t, acc):
            r0 = (first + t) * tm
            rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
            mine = (rows >= start) & (rows < end)
            # (Loaded whole and masked by a select: a masked load's discharge breaks the manual-axis
            # types inside a shard_map in jax 0.10.2; the tiles lie inside the padded operands.)
            x_bxc = jnp.where(mine, x_ref[pl.ds(r0, tm), pl.ds(c * tc, tc)], 0)
            g_bxn = jnp.where(mine, g_ref[pl.ds(r0, tm), pl.ds(n * tn, tn)], 0)
            return acc + jnp.dot(x_bxc.T, g_bxn, preferred_element_type=jnp.float32)

        steps = jnp.where(end > start, (end + tm - 1) // tm - first, 0)
        acc = accumulate(steps, x_ref.shape[0] // tm, step, (tc, tn), x_ref)
        dw_ref[e, pl.ds(c * tc, tc), pl.ds(n * tn, tn)] = acc.astype(dw_ref.dtype)

    dw = _launch(kernel, (n_groups, x.shape[1] // tc, g.shape[1] // tn), (starts_G, ends_G, g, x),
                 (n_groups, x.shape[1], g.shape[1]), jnp.float32, tiles, interpret, "grouped_gemm_dw")
    return dw[:, :C, :O]
