"""Muon (`train.optimizer: muon`) as Moonlight and Kimi K2 define it, and the one rule of which
parameters it takes (docs/muon.md).

Muon takes every hidden weight matrix: a leaf whose logical dims (`jaxpar.model.param_names`)
make exactly two matrix sides once the stacking dims (`layers`, `mtp`, `experts`: one matrix per
index) are set aside and the attention head dims (`heads`, `kv_heads`, `head_dim`) are counted as
one side, and that names no `vocab`, `pos` or `router` dim. Everything else, the token and
position embeddings, the output head, norms, biases, the routers' weights, bias and report and
the MTP report, is updated by AdamW with its usual hyperparameters (`takes_muon`).

A Muon leaf's update, per logical matrix (per layer, per expert; a projection with a heads dim
as the matrix [its input dims, its output dims]: wq [D, N*H], wo [N*H, D], MLA's wkv_b
[r, N*(dn+dv)]):

    buf <- muon_momentum * buf + g                       (Nesterov momentum, Moonlight's form)
    u   <- g + muon_momentum * buf
    O   <- NewtonSchulz5(u / (|u|_F + 1e-7))             (quintic 3.4445, -4.7750, 2.0315; in
                                                          train.muon_ns_dtype)
    p   <- p - lr * (0.2 * sqrt(max(m, n)) * O + weight_decay * p)

0.2 * sqrt(max(m, n)) gives O (singular values ~1) the RMS of an AdamW update (Moonlight's
match-AdamW-RMS rule), so AdamW's learning rate, schedule and weight decay carry over. The
Newton-Schulz iteration is optax's (`optax.contrib` Muon: `orthogonalize_via_newton_schulz`, its
dimension numbers flatten and vmap the matrices); AdamW's leaves run optax's `scale_by_adam`.

The state is `MuonState(count, mu, nu)`, `mu` and `nu` shaped like the parameters, so that the
train step lays them out as it does Adam's moments (ZeRO shards them over data; master weights
and optimizer offload wrap them unchanged): `mu` is Muon's momentum on its leaves and Adam's first
moment elsewhere; `nu` is Adam's second moment, and on Muon's leaves an empty array [0, ...]
(one momentum per Muon parameter; checkpoints do not write the empty arrays).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from optax.contrib import MuonDimensionNumbers
from optax.contrib._muon import orthogonalize_via_newton_schulz

# Moonlight's / Kimi K2's Newton-Schulz: five iterations of the quintic with these coefficients.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7  # |u|_F + eps before the iteration (Moonlight's)
RMS_MATCH = 0.2  # the update scaled by RMS_MATCH * sqrt(max(m, n)): AdamW's update RMS

STACK_DIMS = ("layers", "mtp", "experts")  # one matrix per index of these
HEAD_DIMS = ("heads", "kv_heads", "head_dim")  # together one side of a projection
ADAMW_DIMS = ("vocab", "pos", "router")  # embeddings, output head, routers: AdamW


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple)


def matrix_axes(names: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(input axes, output axes) of the logical matrices of a leaf with dim names `names`, or
    None when Muon does not take it (the module's rule). Weights are stored [input, output]."""
    if any(n in ADAMW_DIMS for n in names):
        return None
    sides: list[list[int]] = []
    for i, n in enumerate(names):
        if n in STACK_DIMS:
            continue
        if n in HEAD_DIMS and sides and names[sides[-1][-1]] in HEAD_DIMS:
            sides[-1].append(i)
        else:
            sides.append([i])
    if len(sides) != 2:
        return None
    return tuple(sides[0]), tuple(sides[1])


def takes_muon(names: tuple[str, ...]) -> bool:
    """Whether Muon (not AdamW) updates a leaf with dim names `names`."""
    return matrix_axes(names) is not None


def muon_leaves(names: Any) -> Any:
    """The parameter tree with, at each leaf, whether Muon takes it (from its logical names)."""
    return jax.tree.map(takes_muon, names, is_leaf=_is_names)


def dimension_numbers(names: tuple[str, ...]) -> MuonDimensionNumbers | None:
    axes = matrix_axes(names)
    return None if axes is None else MuonDimensionNumbers(reduction_axis=axes[0], output_axis=axes[1])


def rms_scale(shape: tuple[int, ...], names: tuple[str, ...]) -> float:
    """0.2 * sqrt(max(m, n)) of the logical matrices [m, n] of a Muon leaf."""
    ins, outs = matrix_axes(names)
    m, n = math.prod(shape[i] for i in ins), math.prod(shape[i] for i in outs)
    return RMS_MATCH * math.sqrt(max(m, n))


def orthogonalize(u: jax.Array, names: tuple[str, ...], ns_dtype: Any = jnp.float32) -> jax.Array:
    """Newton-Schulz (5 quintic iterations) of each logical matrix of `u`, computed in `ns_dtype`,
    scaled by 0.2 * sqrt(max(m, n)); returned in `u`'s dtype."""
    o = orthogonalize_via_newton_schulz(u.astype(ns_dtype), jnp.asarray(NS_COEFFS), NS_STEPS, "frobenius", NS_EPS,
                                        dimension_numbers(names))
    return (o.astype(jnp.float32) * rms_scale(u.shape, names)).astype(u.dtype)


def owner_axes(mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes over which whole matrices are dealt out to owning ranks (every axis of size
    more than 1); () without a mesh, on one device, or inside a shard_map manual over an axis
    (the constraint is then not expressible): Newton-Schulz then runs as XLA partitions it."""
    if mesh is None:
        return ()
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return ()
    return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)


def ns_flops(a: int, b: int) -> int:
    """FLOPs of the Newton-Schulz iterations of one matrix [a, b], a <= b: per iteration A = X Xᵀ
    (2a²b), A·A (2a³) and (bA + cA²)·X (2a²b)."""
    return NS_STEPS * (4 * a * a * b + 2 * a ** 3)


class Deal(NamedTuple):
    """How `orthogonalize_owned` deals a model's Muon matrices over `ranks` owners: per rank, its
    Newton-Schulz FLOPs (`flops`: the busiest rank's, padding included) and the elements of the
    padded stacks it owns (`owned`: what it receives, and sends back, of the momentum)."""

    ranks: int
    flops: int
    owned: int


def deal(shapes: Any, names: Any, ranks: int, stages: int = 1) -> Deal:
    """The deal of `orthogonalize_owned` from the parameters' shapes and logical names, over
    `ranks` owners of which `stages` pipeline stages each hold their share of the `layers`-stacked
    leaves (dealt within the stage, over ranks / stages owners); the rest over all ranks. The
    planner reads the same deal (`jaxpar.plan`)."""
    groups: dict[tuple, int] = {}
    leaves = jax.tree.leaves(names, is_leaf=_is_names)
    for shape, n in zip(jax.tree.leaves(shapes), leaves):
        axes = matrix_axes(n)
        if axes is None:
            continue
        shape = getattr(shape, "shape", shape)
        m, k = math.prod(shape[i] for i in axes[0]), math.prod(shape[i] for i in axes[1])
        count = math.prod(shape[i] for i in range(len(shape)) if i not in axes[0] + axes[1])
        staged = stages > 1 and "layers" in n and count % stages == 0
        key = (min(m, k), max(m, k), staged)
        groups[key] = groups.get(key, 0) + (count // stages if staged else count)
    flops = owned = 0
    for (a, b, staged), count in groups.items():
        owners = ranks // stages if staged else ranks
        per_rank = -(-count // owners)
        flops += per_rank * ns_flops(a, b)
        owned += per_rank * a * b
    return Deal(ranks, flops, owned)


def _spec_axes(spec: P) -> tuple[str, ...]:
    return tuple(a for ax in spec for a in ((ax,) if isinstance(ax, str) else ax or ()))


def _as_matrices(u: jax.Array, names: tuple[str, ...]) -> tuple[jax.Array, tuple]:
    """`u` as its logical matrices [M, a, b] with a <= b (transposed where m > n), and what
    `_from_matrices` needs to put them back."""
    ins, outs = matrix_axes(names)
    stack = tuple(i for i in range(u.ndim) if i not in ins + outs)
    perm = stack + ins + outs
    x = jnp.transpose(u, perm)
    m, n = math.prod(u.shape[i] for i in ins), math.prod(u.shape[i] for i in outs)
    x = x.reshape(-1, m, n)
    if m > n:
        x = jnp.swapaxes(x, 1, 2)
    return x, (perm, tuple(u.shape[i] for i in perm), m > n)


def _from_matrices(x: jax.Array, how: tuple) -> jax.Array:
    perm, shape, transposed = how
    if transposed:
        x = jnp.swapaxes(x, 1, 2)
    return jnp.transpose(x.reshape(shape), tuple(perm.index(i) for i in range(len(perm))))


def _matrix_spec(spec: P, ndim: int, names: tuple[str, ...], transposed: bool) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of the dims [M, a, b] of `_as_matrices`'s matrices of a leaf laid out by
    `spec`: each merged dim's axes in order (the stack dims', the input dims', the output dims')."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    ins, outs = matrix_axes(names)
    stack = tuple(i for i in range(ndim) if i not in ins + outs)

    def merged(dims):
        return tuple(a for i in dims for a in _spec_axes(P(entries[i])))

    m, a, b = merged(stack), merged(ins), merged(outs)
    return (m, b, a) if transposed else (m, a, b)


def _one_axis_at_a_time(lead: tuple, owners: tuple[str, ...], layout: tuple[tuple[str, ...], ...]) -> list[P]:
    """The layouts a stack [*lead, M, a, b] stored with (a, b) over `layout`'s axes passes through
    on its way to M sharded over `owners`: each owner axis moved from a or b onto M in turn, or
    sliced there where the stack is replicated over it (XLA's partitioner moves one axis between
    two dims with one all-to-all, but replicates a stack whose dims change over two axes at once).
    The owners' layout itself is left out."""
    a, b = list(layout[0]), list(layout[1])
    m: list[str] = []
    out = []
    for ax in owners:
        moved = ax in a or ax in b
        a, b = [x for x in a if x != ax], [x for x in b if x != ax]
        m.append(ax)
        out.append(P(*lead, tuple(m), tuple(a) or None, tuple(b) or None))
    return out[:-1] if out and not a and not b else out


def orthogonalize_owned(us: list[jax.Array], names: list[tuple[str, ...]], mesh: Mesh, axes: tuple[str, ...],
                        ns_dtype: Any = jnp.float32, specs: list[P] | None = None) -> list[jax.Array]:
    """`orthogonalize` of each of `us` (Muon's leaves, names `names`), with each logical matrix
    computed whole on one owning rank (Megatron-Core's layer-wise distributed optimizer, torchtitan's
    DistMuon, in SPMD): the matrices of every leaf, as [M, a, b] with a <= b, are stacked with those
    of the same shape from the other leaves, padded with zero matrices (Newton-Schulz maps them to
    zeros) to a multiple of the ranks of `axes`, and constrained sharded over `axes` on their first
    dim: each rank runs its M / ranks whole matrices, with no collective inside the iterations, and
    XLA moves each momentum there and the result back once each way: to `specs` (the leaves'
    PartitionSpecs in the state's layout: a group whose leaves are all replicated over `axes`,
    ZeRO-0, is all-gathered whole, one collective) or, without them, to the layout the step
    constrains the updates to.

    With `specs`, the stack is built without moving a matrix across the mesh first: a leaf whose
    matrices are stored sharded over `stage` (a pipeline's layers) is dealt within its stage (its
    matrices [stage, M / stage, a, b], stacked and padded per stage, owned by the stage's ranks of
    the other axes); the members of a stack share one layout of (a, b) (a square matrix laid out
    the other way round is stacked transposed: Newton-Schulz commutes with the transpose; any
    other is moved to the first member's layout before it is stacked)."""
    ranks = math.prod(mesh.shape[a] for a in axes)
    p = mesh.shape["stage"] if "stage" in axes else 1
    inner = tuple(a for a in axes if a != "stage")
    groups: dict[tuple, list[int]] = {}
    mats, hows, mspecs, flips = [], [], [], []
    for i, (u, n) in enumerate(zip(us, names)):
        if specs is not None:  # the momentum where the state keeps it (not its owners' layout propagated back)
            u = jax.lax.with_sharding_constraint(u, NamedSharding(mesh, specs[i]))
        x, how = _as_matrices(u.astype(ns_dtype), n)
        ms = None if specs is None else _matrix_spec(specs[i], u.ndim, n, how[2])
        staged = ms is not None and p > 1 and ms[0][:1] == ("stage",) and x.shape[0] % p == 0
        mats.append(x)
        hows.append(how)
        mspecs.append(ms)
        flips.append(False)
        # (Stacked with the matrices of its shape, stage and sharding of M: expert parallelism's.)
        spread = () if ms is None else tuple(a for a in ms[0] if a != "stage")
        groups.setdefault((x.shape[1:], staged, spread), []).append(i)
    out: list[Any] = [None] * len(us)
    dims = MuonDimensionNumbers(reduction_axis=(1,), output_axis=(2,))
    for (_, staged, _), members in groups.items():
        lead = (p,) if staged else ()
        if specs is not None:  # one (a, b) layout for the stack: the first member's
            layout = mspecs[members[0]][1:]
            for i in members[1:]:
                if mspecs[i][1:] == layout:
                    continue
                x = mats[i]
                if x.shape[1] == x.shape[2] and mspecs[i][2:0:-1] == layout:
                    mats[i], flips[i] = jnp.swapaxes(x, 1, 2), True
                else:
                    mats[i] = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(mspecs[i][0] or None,
                                                                                       *(s or None for s in layout))))
        parts = [mats[i].reshape(lead + (-1,) + mats[i].shape[1:]) for i in members]
        x = jnp.concatenate(parts, axis=len(lead)) if len(parts) > 1 else parts[0]
        total = x.shape[len(lead)]
        pad = -total % (ranks // p if staged else ranks)
        if pad:
            x = jnp.concatenate([x, jnp.zeros(lead + (pad,) + x.shape[len(lead) + 1:], x.dtype)], axis=len(lead))
        # Owners: the stage's ranks (a staged stack) or every rank, each M / ranks whole matrices.
        owned = NamedSharding(mesh, P("stage", inner, None, None) if staged else P(axes, None, None))
        whole = NamedSharding(mesh, P("stage") if staged else P())
        replicated = specs is not None and not any(set(_spec_axes(specs[i])) & set(inner if staged else axes)
                                                    for i in members)
        steps = [] if specs is None or replicated else _one_axis_at_a_time(
            ("stage",) if staged else (), inner if staged else axes, mspecs[members[0]][1:])
        if replicated:  # ZeRO-0: every rank slices its own matrices out of the whole stack
            x = jax.lax.with_sharding_constraint(x, whole)
        for spec in steps:  # to the owners, one axis at a time (one all-to-all over each)
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        x = jax.lax.with_sharding_constraint(x, owned)
        flat = x.reshape((-1,) + x.shape[-2:])
        o = orthogonalize_via_newton_schulz(flat, jnp.asarray(NS_COEFFS), NS_STEPS, "frobenius", NS_EPS, dims)
        o = jax.lax.with_sharding_constraint(o.reshape(x.shape), owned)
        if replicated:
            o = jax.lax.with_sharding_constraint(o, whole)  # replicated leaves: one gather
        for spec in reversed(steps):  # and back, the same way
            o = jax.lax.with_sharding_constraint(o, NamedSharding(mesh, spec))
        start = 0
        for i in members:
            count = mats[i].shape[0] // (p if staged else 1)
            u, n = us[i], names[i]
            o_i = o[:, start:start + count] if staged else o[start:start + count]
            o_i = o_i.reshape(mats[i].shape)
            if flips[i]:
                o_i = jnp.swapaxes(o_i, 1, 2)
            o_i = _from_matrices(o_i, hows[i])
            o_i = (o_i.astype(jnp.float32) * rms_scale(u.shape, n)).astype(u.dtype)
            out[i] = o_i if specs is None else jax.lax.with_sharding_constraint(o_i, NamedSharding(mesh, specs[i]))
            start += count
    return out


class MuonState(NamedTuple):
    """Muon's and AdamW's state, `mu` and `nu` shaped like the parameters (module docstring)."""

    count: jax.Array  # int32 scalar: steps taken
    mu: Any  # Muon's momentum (its leaves), Adam's first moment (the rest)
    nu: Any  # Adam's second moment (AdamW's leaves); an empty [0, ...] array on Muon's leaves


def _empty(x) -> jax.Array:
    return jnp.zeros((0,) * x.ndim, x.dtype)


def muon(learning_rate: optax.ScalarOrSchedule, names: Any, *, momentum: float = 0.95, b1: float = 0.9,
         b2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0, decay_mask: Any = None,
         ns_dtype: Any = jnp.float32, mesh: Mesh | None = None, specs: Any = None
         ) -> optax.GradientTransformation:
    """Muon on the leaves `takes_muon` picks from `names` (the parameters' logical dim names),
    AdamW (`optax.adamw`'s update, b1, b2, eps) on the others; decoupled weight decay
    `weight_decay` on the leaves `decay_mask` marks (every leaf when None), both scaled by
    `learning_rate`. With the train step's `mesh` (more than one device), each logical matrix's
    Newton-Schulz runs whole on one owning rank (`orthogonalize_owned`), its result laid out by
    `specs` (PartitionSpecs like `names`: the step's optimizer-state layout) where given; without
    a mesh, or on one device, as XLA partitions it (the same program as without a mesh)."""
    takes = muon_leaves(names)
    mask = jax.tree.map(lambda _: True, takes) if decay_mask is None else decay_mask
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    trace = optax.trace(decay=momentum, nesterov=True)
    schedule = learning_rate if callable(learning_rate) else (lambda _: learning_rate)
    hole = lambda t, x: None if t else x  # noqa: E731  (AdamW's part: Muon's leaves left out)
    part = lambda t, x: x if t else None  # noqa: E731  (Muon's part)

    def split(tree, keep):
        return jax.tree.map(keep, takes, tree)

    def init(params):
        mu = jax.tree.map(jnp.zeros_like, params)
        nu = jax.tree.map(lambda t, p: _empty(p) if t else jnp.zeros_like(p), takes, params)
        return MuonState(jnp.zeros((), jnp.int32), mu, nu)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("muon needs the parameters (decoupled weight decay)")
        # AdamW's leaves: optax's Adam scaling, its state the AdamW leaves of mu and nu.
        adam_u, adam_state = adam.update(split(updates, hole), optax.ScaleByAdamState(
            state.count, split(state.mu, hole), split(state.nu, hole)))
        # Muon's leaves: Nesterov momentum (buf = m buf + g; g + m buf), then Newton-Schulz.
        muon_u, trace_state = trace.update(split(updates, part), optax.TraceState(split(state.mu, part)))
        axes = owner_axes(mesh)
        if axes:
            flat, tree = jax.tree.flatten(muon_u)  # (None, AdamW's leaves, is not a leaf)
            flat_names = [n for t, n in zip(jax.tree.leaves(takes), jax.tree.leaves(names, is_leaf=_is_names)) if t]
            flat_specs = None if specs is None else [
                sp for t, sp in zip(jax.tree.leaves(takes), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
                if t]
            muon_u = jax.tree.unflatten(tree, orthogonalize_owned(flat, flat_names, mesh, axes, ns_dtype, flat_specs))
        else:
            muon_u = jax.tree.map(lambda t, u, n: orthogonalize(u, n, ns_dtype) if t else None, takes, muon_u, names,
                                  is_leaf=lambda x: x is None or _is_names(x))
        step_size = -schedule(state.count)
        new = jax.tree.map(lambda t, a, m: m if t else a, takes, adam_u, muon_u, is_leaf=lambda x: x is None)
        new = jax.tree.map(lambda u, p, d: u + weight_decay * p if d and weight_decay else u, new, params, mask)
        new = jax.tree.map(lambda u: u * jnp.asarray(step_size).astype(u.dtype), new)
        mu = jax.tree.map(lambda t, a, m: m if t else a, takes, adam_state.mu, trace_state.trace,
                          is_leaf=lambda x: x is None)
        nu = jax.tree.map(lambda t, a, old: old if t else a, takes, adam_state.nu, state.nu,
                          is_leaf=lambda x: x is None)
        return new, MuonState(adam_state.count, mu, nu)

    return optax.GradientTransformation(init, update)
