"""The pipeline executor's stash, buffers and layer slots: reading and writing a stash row in
place, ordering a write after the reads of the same buffer (`after`), packing I's outputs for W
into a stash slot, and handing each stage its layer slots of a stack stored over `stage` (and the
gradients back).

Each function is a pure function of arrays and the executor's static layout; the actions, the
tick and the step call them (DESIGN.md §5.4, "Stash, buffers and their slots"; §5.5, hops and chunk
layouts)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.sharding import vary, varying_axes

STAGE = "stage"
MODEL = "model"


def get_row(buf: jax.Array, i: jax.Array) -> jax.Array:
    """`buf[i]` along the leading dim, `i` traced and in bounds."""
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def set_row(buf: jax.Array, x: jax.Array, i: jax.Array) -> jax.Array:
    """`buf.at[i].set(x)` as one dynamic-update-slice, in place (`.at[i].set` with a traced index is
    a scatter, which XLA:CPU runs as a select over the row that reads it as well)."""
    return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)


def after(*read_results: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """`write -> write` made to depend on what a read of the same buffer computed (adding an exact
    -0.0): a tick reads a stash slot (B, W) and writes another (F, I), and unless the write waits
    for the read's consumer XLA keeps a second copy of the whole buffer, every tick (measured:
    twice the stash's temp bytes). Integer writes are left as they are (small: token ids).

    A leaf that does not vary over `model` where the reads' results do (under tensor parallelism:
    a replicated matmul input, a norm's output) cannot take a value that varies (its type would
    change), so it depends on their sum over `model` instead: one scalar all-reduce over `model`
    per call (at most two a tick), where without the dependency XLA kept copies of those leaves
    (measured at (1, 4, 2), 8 layers, 1f1b, `remat: none`: 24.80 MB of temp memory, 18.24 with it)."""
    z = sum(jnp.ravel(r)[0].astype(jnp.float32) for r in read_results) if read_results else None
    # (Stash leaves vary over `data` and `stage` whatever they hold, `tick.initial_carry`: only
    # `model` may be one the reads vary over and a leaf does not.)
    z_model = jax.lax.psum(z, MODEL) if z is not None and MODEL in varying_axes(z) else z

    def dep(x: jax.Array) -> jax.Array:
        if z is None or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        zz = z if set(varying_axes(z)) <= set(varying_axes(x)) else z_model
        if not set(varying_axes(zz)) <= set(varying_axes(x)):
            return x
        zero = jnp.where(jnp.isfinite(zz), -jnp.abs(zz) * 0.0, -0.0)  # -0.0, never NaN: x + -0.0 == x
        return x + vary(zero, varying_axes(x)).astype(x.dtype)
    return dep


def pack(items: dict, bins: list) -> dict:
    """Where each of I's outputs for W goes in its stash slot: `items` key -> (shape, dtype, manual
    axes), `bins` the stash leaves' (shape of one slot, dtype, axes); returns key -> (leaf, offset in
    the leaf's flat slot, the item's shape) for the items that fit: largest first, each into the
    leaf of the same dtype and manual-axis type with the least room that holds it (best fit: an
    item lands in a residual of its own size where there is one, e.g. an output cotangent over the
    matmul output it differentiates; measured, first fit into the attention probabilities held
    19% more temp memory). With `remat: none` a slot's residuals hold everything W needs, so the
    wstash stays empty; with `dots` or `full` the slot is smaller and the rest goes there."""
    free = [int(np.prod(shape)) for shape, _, _ in bins]
    out = {}
    for key in sorted(items, key=lambda k: -int(np.prod(items[k][0]))):
        shape, dtype, axes = items[key]
        n = int(np.prod(shape))
        fits = [i for i, (_, bdtype, baxes) in enumerate(bins)
                if bdtype == dtype and tuple(sorted(baxes)) == tuple(sorted(axes)) and free[i] >= n]
        if fits:
            i = min(fits, key=lambda j: free[j])  # best fit
            out[key] = (i, int(np.prod(bins[i][0])) - free[i], tuple(shape))
            free[i] -= n
    return out


def read_items(stash, wstash, packing, slot, wslot) -> dict:
    """W's inputs of one (microbatch, chunk), [layers, ...] per item: from its stash slot where
    `pack` put them (per layer, in that layer's row), the rest from its wstash slot."""
    out = {key: buf[wslot] for key, buf in wstash.items()}
    for key, (kind, i, off, shape) in packing.items():
        buf = stash["layers"][kind][i]
        out[key] = jax.lax.dynamic_slice(buf, (slot, 0, off), (1, buf.shape[1], int(np.prod(shape)))).reshape(
            buf.shape[1], *shape)
    return out


def write_now(bufs, packing, new, slot, wslot, after):
    """I's outputs for W ([layers, ...] each) written into its stash slot (where `pack` put them)
    and its wstash slot: `bufs` = (stash, wstash) -> the same, updated in place."""
    stash, wstash = bufs
    layers = {kind: list(b) for kind, b in stash["layers"].items()}
    for key, (kind, i, off, _) in packing.items():
        b = layers[kind][i]
        layers[kind][i] = jax.lax.dynamic_update_slice(b, after(new[key]).reshape(1, b.shape[1], -1), (slot, 0, off))
    wstash = {key: set_row(buf, after(new[key]), wslot) for key, buf in wstash.items()}
    return {**stash, "layers": {kind: tuple(b) for kind, b in layers.items()}}, wstash


def write_items(stash, wstash, packing, new, valid, slot, wslot, after):
    """`write_now` under a cond on `valid`. (Not as a select with the slot's old contents:
    reading those, XLA copied every packed stash buffer twice per tick.)"""
    return jax.lax.cond(valid, lambda bufs: write_now(bufs, packing, new, slot, wslot, after), lambda bufs: bufs,
                        (stash, wstash))


def gather_stage(w: jax.Array, dim: int | None) -> jax.Array:
    """A shared leaf stored sharded over `stage` all-gathered along its stage dim (else as is)."""
    return w if dim is None else jax.lax.all_gather(w, STAGE, axis=dim, tiled=True)


def reduce_stage(g: jax.Array, dim: int | None) -> jax.Array:
    """A shared leaf's gradient summed over `stage` (only the end stages contribute): reduce-scattered
    along its stage dim where it is stored sharded over `stage`, else all-reduced."""
    return jax.lax.psum(g, STAGE) if dim is None else jax.lax.psum_scatter(g, STAGE, scatter_dimension=dim, tiled=True)


def param_leaves(*trees) -> list:
    """The leaves of parameter trees, in order: F matches its residuals against them by identity."""
    return [w for tree in trees for w in jax.tree.leaves(tree)]


def by_kind(slots, blocks, dims, fn):
    """`fn(leaf, kind, dim)` on every leaf of a `blocks` tree, with its stack's kind (the kinds of
    `slots`, a `StageLayout`: "" for one stack, "dense" and "moe" for two) and its leaf of `dims`
    (a tree of ints or None alike)."""
    is_dim = lambda x: x is None or isinstance(x, int)  # noqa: E731
    if list(slots.width) == [""]:
        return jax.tree.map(lambda w, sd: fn(w, "", sd), blocks, dims, is_leaf=is_dim)
    return {kind: jax.tree.map(lambda w, sd, kind=kind: fn(w, kind, sd), blocks[kind], dims[kind], is_leaf=is_dim)
            for kind in slots.width}


def to_slots(w: jax.Array, dim: int | None, slots: np.ndarray, p: int, stage: jax.Array) -> jax.Array:
    """A stack stored with its `layers` dim whole and `stage` on `dim` (None: replicated over
    `stage`) -> this stage's [v·width, ...] layer slots (`jaxpar.parallel.stages`): every stage
    picks all stages' slots from its slice, and one all-to-all over `stage` hands each stage its own
    with `dim` whole (the bytes of its slots, once). Replicated: a local pick."""
    if dim is None:
        return jnp.take(w, jnp.asarray(slots.reshape(p, -1))[stage], axis=0)
    return jax.lax.all_to_all(jnp.take(w, jnp.asarray(slots), axis=0), STAGE, 0, dim, tiled=True)


def from_slots(g: jax.Array, dim: int | None, layer_slot: np.ndarray, p: int, stage: jax.Array) -> jax.Array:
    """The transpose of `to_slots` for a gradient: this stage's slots back to the stack's storage,
    each layer's gradient from its one slot (padding slots' dropped)."""
    if dim is None:  # every stage's slots summed over `stage` (each layer has one slot)
        every = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((p * g.shape[0], *g.shape[1:]), g.dtype), g,
                                                   stage * g.shape[0], 0)
        return jnp.take(jax.lax.psum(every, STAGE), jnp.asarray(layer_slot), axis=0)
    return jnp.take(jax.lax.all_to_all(g, STAGE, dim, 0, tiled=True), jnp.asarray(layer_slot), axis=0)


def v_chunks(w: jax.Array, p: int, stage: jax.Array, back: bool = False) -> jax.Array:
    """Inside the shard_map: this stage's `layers` slice, stored in model order (chunks 2s and 2s+1
    of stage s), exchanged for the chunks the V places on it (s and 2p-1-s, `placement`), or with
    `back` the reverse (gradients to their storage). Two chunks of opposite parity sit on every
    stage in both orders, so the even chunks move by one collective-permute over `stage` and the
    odd by another: each stage sends and receives its own bytes once (a stage keeps what is
    already its own). A select by the stage's parity puts them in local order.

    (Not the model-order slices concatenated in V order outside the shard_map: GSPMD moved that
    as dozens of all-to-alls and collective-permutes, 8x these bytes at p = 4, measured.)"""
    from jaxpar.parallel.pipeline.placement import stage_of
    n = w.shape[0] // 2
    odd_here = stage % 2 == 1  # stage s's first V chunk, s, is odd
    even_to = [stage_of(2 * s, p, "v") for s in range(p)]  # chunk 2s's V stage
    odd_to = [stage_of(2 * s + 1, p, "v") for s in range(p)]
    if not back:
        even = jax.lax.ppermute(w[:n], STAGE, list(enumerate(even_to)))
        odd = jax.lax.ppermute(w[n:], STAGE, list(enumerate(odd_to)))
        return jnp.concatenate([jnp.where(odd_here, odd, even), jnp.where(odd_here, even, odd)])
    even, odd = jnp.where(odd_here, w[n:], w[:n]), jnp.where(odd_here, w[:n], w[n:])
    return jnp.concatenate([jax.lax.ppermute(even, STAGE, [(t, s) for s, t in enumerate(even_to)]),
                            jax.lax.ppermute(odd, STAGE, [(t, s) for s, t in enumerate(odd_to)])])


def reorder(w: jax.Array, outer: int, inner: int) -> jax.Array:
    """[outer, inner, chunk layers, ...] -> [inner, outer, ...] along the leading `layers` dim."""
    chunk = w.shape[0] // (outer * inner)
    w = w.reshape(outer, inner, chunk, *w.shape[1:]).swapaxes(0, 1)
    return w.reshape(outer * inner * chunk, *w.shape[3:])
