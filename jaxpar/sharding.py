"""Logical dim names -> mesh axes: the parameter-storage rules and the activation-compute rules.

Model code names dims (`batch`, `embed`, `heads`, ...) and never a mesh axis. Two tables map
those names onto axes (DESIGN.md decision 2): *storage* rules say how parameters and optimizer
state live, *compute* rules say how activations flow. A name missing from a table is an error,
never a silent replication. Outside `activation_rules(...)` every activation mark is a no-op,
so the model runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.config import Config

# Every logical dim name the model may use.
# `sp_seq` is the seq dim of activations outside the attention and MLP matmuls (norms, residual
# adds): the regions that sequence parallelism shards over `model`.
# MoE (`jaxpar.model.moe`): `experts` is the expert dim of expert weights, `expert_mlp` an expert's
# hidden width (split over `model` as `mlp` is: Megatron's expert tensor parallelism), `router`
# the expert dim of the router and of its bias and statistics (replicated). `latent` is the width of
# multi-head latent attention's compressed queries and keys/values (replicated, as Megatron keeps
# MLA's down-projections). `fp8` is a block's FP8 amax history (replicated, never ZeRO-sharded).
LOGICAL_NAMES = ("batch", "seq", "sp_seq", "pos", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab",
                 "layers", "experts", "expert_mlp", "router", "latent", "fp8")

Axis = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class Rules:
    """A table `logical name -> mesh axis (or None)`, e.g. `Rules({"batch": "data", ...})`."""

    table: Mapping[str, Axis]

    def __post_init__(self):
        missing = set(LOGICAL_NAMES) - set(self.table)
        if missing:
            raise ValueError(f"rule table lacks logical names {sorted(missing)}")

    def spec(self, names: Sequence[str | None]) -> P:
        """PartitionSpec for a value whose dims are named `names` (None = an unnamed, unsharded dim)."""
        axes = []
        for name in names:
            if name is None:
                axes.append(None)
            elif name not in self.table:
                raise KeyError(f"unknown logical dim name {name!r}; known names: {', '.join(LOGICAL_NAMES)}")
            else:
                axes.append(self.table[name])
        used = [a for ax in axes if ax is not None for a in ((ax,) if isinstance(ax, str) else ax)]
        if len(used) != len(set(used)):
            raise ValueError(f"dims {tuple(names)} would use a mesh axis twice: {tuple(axes)}")
        return P(*axes)

    def without(self, axes: Sequence[str]) -> "Rules":
        """These rules with `axes` dropped: for code inside a shard_map where those axes are manual."""
        def drop(ax: Axis) -> Axis:
            if ax is None:
                return None
            kept = tuple(a for a in ((ax,) if isinstance(ax, str) else ax) if a not in axes)
            return None if not kept else kept[0] if len(kept) == 1 else kept
        return Rules({name: drop(ax) for name, ax in self.table.items()})


def _kv_heads_axis(cfg: Config, mesh: Mesh) -> Axis:
    """kv heads are split over `model` when its size divides them; otherwise (n_kv_heads < t, as
    config validation allows only then) every model rank holds all kv heads: the kv projections
    are replicated, each rank computes them (2·D·K·H extra FLOPs per token, small under GQA) and
    their gradients are all-reduced over `model`."""
    return "model" if cfg.model.kv_heads % mesh.shape["model"] == 0 else None


def expert_replicas(cfg: Config, data: int) -> int:
    """How many data ranks hold each expert under expert parallelism (`parallel.expert_parallel`,
    MoE, data > 1): 1 when the experts split over the data ranks, data / n_experts when there are
    more ranks than experts; 0 without expert parallelism."""
    if not (cfg.model.moe and cfg.parallel.expert_parallel and data > 1):
        return 0
    return max(1, data // cfg.model.n_experts)


def _experts_axis(cfg: Config, mesh: Mesh) -> Axis:
    """Expert parallelism with n_experts divisible by data: each data rank stores n_experts / data
    of every MoE layer's experts (`jaxpar.model.moe`, DESIGN.md §10). (With more data ranks than
    experts, `jaxpar.parallel.zero` stores a slice of every expert on each rank instead.)"""
    return "data" if expert_replicas(cfg, mesh.shape["data"]) == 1 else None


def _expert_mlp_axis(cfg: Config) -> Axis:
    """Each expert's width on `model` (expert tensor parallelism), or whole on every model rank."""
    return "model" if cfg.parallel.expert_tensor_parallel else None


def storage_rules(cfg: Config, mesh: Mesh) -> Rules:
    """Where parameters, gradients and optimizer state live (before ZeRO, `jaxpar.parallel.zero`).

    Tensor parallelism splits heads, MLP width and vocabulary over `model` (Megatron: column-
    parallel q/k/v and up/gate, row-parallel output and down projections, vocab-parallel
    embedding and output); the pipeline cuts `layers` over `stage`. Everything else is replicated.
    """
    return Rules({
        "batch": None, "seq": None, "sp_seq": None, "pos": None, "embed": None, "head_dim": None,
        "heads": "model", "kv_heads": _kv_heads_axis(cfg, mesh), "mlp": "model", "vocab": "model",
        "layers": "stage", "experts": _experts_axis(cfg, mesh), "expert_mlp": _expert_mlp_axis(cfg), "router": None,
        "latent": None, "mtp": None, "mtp_cat": None, "fp8": None,
    })


def compute_rules(cfg: Config, mesh: Mesh) -> Rules:
    """How activations flow: the batch split over `data`; heads, MLP width and vocab over `model`;
    under sequence parallelism the residual stream's seq dim (`sp_seq`) over `model` too."""
    return Rules({
        "batch": "data", "seq": None, "sp_seq": "model" if cfg.parallel.sequence_parallel else None,
        "pos": None, "embed": None, "head_dim": None,
        "heads": "model", "kv_heads": _kv_heads_axis(cfg, mesh), "mlp": "model", "vocab": "model",
        "layers": None, "experts": None, "expert_mlp": _expert_mlp_axis(cfg), "router": None,
        "latent": None, "mtp": None, "mtp_cat": None, "fp8": None,
    })


def varying_axes(x: jax.Array) -> tuple[str, ...]:
    """The manual mesh axes over which `x` (inside a shard_map) may differ."""
    return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval) -> tuple[str, ...]:
    """The manual mesh axes over which values of the abstract value `aval` may differ."""
    if hasattr(aval, "manual_axis_type"):  # jax 0.10
        return tuple(sorted(aval.manual_axis_type.varying))
    return tuple(sorted(getattr(aval, "vma", ())))  # the jax 0.7 - 0.9 spelling


def vary(x: jax.Array, axes: str | Sequence[str]) -> jax.Array:
    """x cast to varying over the manual `axes` it does not vary over yet (a cast of an axis it
    already varies over is an error in jax)."""
    missing = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def zeros_like_varying(x: jax.Array) -> jax.Array:
    """Zeros of x's shape, dtype and manual-axis variance (branches of a `lax.cond` must agree)."""
    axes = varying_axes(x)
    zeros = jnp.zeros(x.shape, x.dtype)
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


# --------------------------------------------------------------------------------------------
# Marks the model makes: activations (`constrain`) and parameters about to be used (`use_params`)


# Parameters returned by `use_params` carry this name, so that rematerialization never saves them:
# under ZeRO-3 they are all-gathered copies, gathered again in the backward pass instead; with a
# compute dtype narrower than the stored one they are casts, cast again instead.
PARAMS_TAG = "jaxpar_params"
# The output of a weight matmul (`jaxpar.model.layers.linear`): saved by the `dots` remat policy.
DOT_TAG = "jaxpar_dot"
# The attention projections' outputs (q, k, v as projected, and the output projection after its
# `exit_tp`): what the `dots_except_mlp` remat policy saves (MaxText's `save_dot_except_mlp`).
ATTN_TAG = "jaxpar_attn_proj"

# A hook that hands a parameter to the model: `(x, logical names, dtype) -> value`, where dtype is
# the compute dtype the value must come out in (None: as stored). `x` is an array, a `Handout` or a `Shard`.
ParamFn = Callable[[Any, tuple[str, ...], Any], jax.Array]

# Primitives that hand out parameters inside a data-parallel region: a data-axis cast (`pvary`)
# and ZeRO-3's all-gather over `data`. Their results are cheap to recompute (or must not be held,
# for ZeRO-3), so no remat policy of jaxpar saves them for the backward pass.
_PARAM_CASTS = ("pvary", "pcast")


def _hands_out_params(prim, params: dict) -> bool:
    if prim.name in _PARAM_CASTS:
        return True
    if prim.name == "all_gather":  # ZeRO-3's gathers are over `data`; sequence parallelism's over `model`
        axes = params.get("axis_name", ())
        return "data" in ((axes,) if isinstance(axes, str) else tuple(axes))
    if prim.name.startswith("custom_vjp_call"):  # jaxpar's hand-out rules (ZeRO-1/2 scatter, ZeRO-3 gather)
        jaxpr = params.get("call_jaxpr") or params.get("fun_jaxpr")
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        return jaxpr is not None and any(_hands_out_params(e.primitive, e.params) for e in jaxpr.eqns)
    return prim.name == "name" and params.get("name") == PARAMS_TAG


def params_never_saved(policy: Callable[..., bool] | None) -> Callable[..., bool]:
    """A remat policy like `policy` (None: save nothing) that never saves handed-out parameters.

    Per layer, the backward pass re-gathers ZeRO-3 shards (and recasts weights to the compute
    dtype) instead of holding every layer's handed-out weights from the forward pass (which
    would undo ZeRO-3's memory saving, or add the weights' bytes in the compute dtype)."""
    def saveable(prim, *args, **params) -> bool:
        if _hands_out_params(prim, params):
            return False
        return policy is not None and policy(prim, *args, **params)
    return saveable


@jax.tree_util.register_pytree_node_class
class Handout:
    """A parameter as ZeRO-1/2 hand it to the model when they reduce at use: the replicated value
    `full` and a zero `seed` shaped like its data shard along `dim`. The model sees `full`; the
    gradient comes out as the seed's, reduce-scattered over `data` where the parameter was used
    (`jaxpar.parallel.gradients.hand_out`). A pytree of both, so that the layer scan slices them
    together; `dim` counts from the end, so it holds for a stack and for each of its layers."""

    def __init__(self, full: jax.Array, seed: jax.Array, dim: int):
        self.full, self.seed, self.dim = full, seed, dim

    @property
    def shape(self):
        return self.full.shape

    @property
    def dtype(self):
        return self.full.dtype

    def tree_flatten(self):
        return (self.full, self.seed), self.dim

    @classmethod
    def tree_unflatten(cls, dim, children):
        return cls(*children, dim)


@jax.tree_util.register_pytree_node_class
class Shard:
    """A parameter as ZeRO-3 hands it to the model when it gathers at use: its data shard along
    `dim` (counted from the end, as `Handout`'s), all-gathered over `data` by the hook where the
    model uses it (`jaxpar.parallel.gradients.hand_out`). Marking the leaf, rather than
    recognising a shard by its names and shape, leaves nothing for the hook to guess."""

    def __init__(self, value: jax.Array, dim: int):
        self.value, self.dim = value, dim

    @property
    def shape(self):
        return self.value.shape

    @property
    def dtype(self):
        return self.value.dtype

    def tree_flatten(self):
        return (self.value,), self.dim

    @classmethod
    def tree_unflatten(cls, dim, children):
        return cls(*children, dim)


def compute_cast(names: Sequence[str]) -> bool:
    """Does the model consume a parameter with these logical names in the compute dtype? Matrices
    and embeddings (two or more dims besides `layers`) yes; norm scales and biases are read in
    float32 or cast by the layer itself. (A registered block must keep to this: its matrices
    reach it already in `model.dtype`.)"""
    return sum(n != "layers" for n in names) >= 2


class TensorParallel(NamedTuple):
    """Manual Megatron tensor parallelism over `model` (inside a shard_map where it is manual)."""

    t: int
    sequence_parallel: bool
    n_heads: int
    n_kv_heads: int
    axis: str = "model"

    @property
    def kv_replicated(self) -> bool:
        return self.n_kv_heads % self.t != 0


class _Active(NamedTuple):
    mesh: Mesh
    rules: Rules
    param_fn: ParamFn | None
    tp: TensorParallel | None
    compute_dtype: Any
    serial_gathers: bool = False


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("jaxpar_rules", default=None)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules, *, param_fn: ParamFn | None = None,
                     tp: TensorParallel | None = None, compute_dtype: Any = None, serial_gathers: bool = False):
    """Within this context (at trace time) `constrain` pins activations to `rules` on `mesh`,
    `use_params` passes each parameter and its logical names through `param_fn` (e.g. a data-axis
    `pcast`, whose transpose reduces the gradient exactly where its parameter entered the
    computation, or a ZeRO-3 all-gather, whose transpose reduce-scatters it), and with `tp` the
    tensor-parallel marks (`enter_tp`, `exit_tp`, ...) run Megatron's explicit collectives. With
    `compute_dtype`, matrices are handed out already cast to it (`compute_cast`), after their
    data-axis cast (so gradients are reduced in the stored dtype) or, for ZeRO-3, before their
    gather (half the bytes in bf16), and under the parameters' name: no remat policy saves a cast.
    """
    if compute_dtype is not None:
        compute_dtype = jnp.dtype(compute_dtype)
    token = _ACTIVE.set(_Active(mesh, rules, param_fn, tp, compute_dtype, serial_gathers))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Mark activation `x` (dims named `names`) with the active compute rules; a no-op without rules."""
    active = _ACTIVE.get()
    if active is None:
        return x
    if x.ndim != len(names):
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
    # Inside a shard_map the context mesh is abstract, with the manual axes marked as such; a
    # constraint must be expressed on that mesh (and the rules must not name the manual axes).
    mesh = jax.sharding.get_abstract_mesh()
    mesh = active.mesh if mesh.empty else mesh
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, active.rules.spec(names)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def recast(x: jax.Array, dtype) -> jax.Array:
    """`x` cast to the compute `dtype` as an opaque step that jaxpar's remat policies never save
    (its output is a named parameter): the backward pass casts again rather than holding a
    narrow copy of every weight from the forward pass. Its gradient is cast back to x's dtype."""
    return checkpoint_name(x.astype(dtype), PARAMS_TAG)


def _recast_fwd(x, dtype):
    return recast(x, dtype), jnp.zeros((0,), x.dtype)  # the residual only carries x's dtype


def _recast_bwd(dtype, res, ct):
    return (ct.astype(res.dtype),)


recast.defvjp(_recast_fwd, _recast_bwd)


def use_params(tree: Any, names: Any) -> Any:
    """Mark a tree of parameters (dims named by the matching tree `names`) as about to be used:
    each leaf passes through the active `param_fn` and, for a matrix, the cast to the compute
    dtype, and comes out under the name `PARAMS_TAG` (never saved by jaxpar's remat policies)."""
    active = _ACTIVE.get()
    if active is None or (active.param_fn is None and active.compute_dtype is None):
        return tree
    fn, dt = active.param_fn, active.compute_dtype
    serial = active.serial_gathers and _simulated(active.mesh)
    last = []  # the previous ZeRO-3 gather's output, on simulated devices (`_after`)

    def hand_out(x, n):
        cast = dt if dt is not None and compute_cast(n) and dt != x.dtype else None
        gathered = isinstance(x, Shard)
        if serial and gathered and last and varying_axes(last[-1]) == varying_axes(x.value):
            x = Shard(_after(x.value, last[-1], last[-1].shape), x.dim)
        if fn is not None:
            y = fn(x, n, cast)
        else:
            y = x if cast is None else recast(x, cast)
        if serial and gathered:
            last.append(y)
        return checkpoint_name(y, PARAMS_TAG)

    return jax.tree.map(hand_out, tree, names,
                        is_leaf=lambda x: isinstance(x, (Handout, Shard))
                        or (isinstance(x, tuple) and all(isinstance(a, str) for a in x)))


def _simulated(mesh) -> bool:
    """Simulated CPU devices (more than one): XLA:CPU runs a device's independent collectives side
    by side, and with JAX's one channel id for all of them two all-gathers over one group in
    flight at once can take each other's participants (an abort, `Check failed:
    id < num_threads`, or mixed results). README, "Simulated devices run one collective per group
    at a time"."""
    return mesh is not None and mesh.size > 1 and mesh.devices.flat[0].platform == "cpu"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _after(x: jax.Array, prev: jax.Array, prev_shape) -> jax.Array:
    """x + 0 x one element of `prev`: x itself for finite values, computed after `prev` (XLA does
    not fold a float x * 0). `use_params` passes each ZeRO-3 shard through it with the previous
    leaf's gathered value on simulated devices (one call chains its leaves: a layer's, or the
    embedding's and the head's), so each gather waits for the one before; the transpose adds 0 x
    its cotangent's sum to prev's, so the backward reduce-scatters wait for each other in reverse.
    Named as a parameter, so no remat policy saves it: the backward pass recomputes it from the
    re-gathered `prev`, and the re-gathers stay in order too. (XLA's optimization barrier orders
    the schedule only, not XLA:CPU's runtime, which follows buffers.) Only where x and prev vary
    over the same manual axes, since the sum would otherwise change x's type."""
    return checkpoint_name(x + (prev.reshape(-1)[0] * 0).astype(x.dtype), PARAMS_TAG)


def _after_fwd(x, prev, prev_shape):
    return _after(x, prev, prev_shape), jnp.zeros((0,), prev.dtype)


def _after_bwd(prev_shape, res, ct):
    # prev's cotangent: 0 x the sum of x's, so the previous leaf's reduce-scatter waits for this one.
    return ct, jnp.broadcast_to((ct.sum() * 0).astype(res.dtype), prev_shape)


_after.defvjp(_after_fwd, _after_bwd)


# --------------------------------------------------------------------------------------------
# Tensor-parallel marks. Without manual tensor parallelism they are sharding constraints (GSPMD
# places the collectives); with it (`tp` active, `model` manual) they are Megatron's collectives.


def _tp() -> TensorParallel | None:
    active = _ACTIVE.get()
    return None if active is None else active.tp


def tensor_parallel() -> bool:
    """Is the model being traced tensor-parallel (inside a shard_map manual over `model`)?"""
    return _tp() is not None


def tensor_parallel_size() -> int:
    """The number of model ranks the traced model is split over (1 without manual tensor parallelism)."""
    tp = _tp()
    return 1 if tp is None else tp.t


def sequence_shards() -> int:
    """How many model ranks split the sequence of the residual stream (sequence parallelism), else 1."""
    tp = _tp()
    return tp.t if tp is not None and tp.sequence_parallel else 1


def gather_sequence_shards(x: jax.Array) -> jax.Array:
    """`x` of every sequence shard, stacked in sequence order [shards, ...] (an all-gather over
    `model` under sequence parallelism; [1, ...] without it)."""
    if sequence_shards() == 1:
        return x[None]
    return jax.lax.all_gather(x, _tp().axis)


def sequence_shard_index() -> jax.Array | int:
    """This rank's place in the sequence (0 without sequence parallelism)."""
    return 0 if sequence_shards() == 1 else jax.lax.axis_index(_tp().axis)


def exchange_experts(rows: jax.Array, groups: list[list[int]] | None = None) -> jax.Array:
    """MoE expert parallelism (the layer's experts split over the manual `data` axis, d ranks):
    rows [d·R, ...] in d blocks, block j for rank j, come back as d blocks, block i from rank i
    (an all-to-all over `data`; its transpose is another). With `groups` (lists of data ranks),
    within this rank's group: block j for its j-th member."""
    return jax.lax.all_to_all(rows, "data", 0, 0, tiled=True, axis_index_groups=groups)


def enter_tp(x_BxTxD: jax.Array) -> jax.Array:
    """Input of column-parallel matmuls (q/k/v, up/gate, output head): the whole sequence, the
    same on every model rank. Megatron's `f`: identity forward, all-reduce of the gradient
    backward (the transpose of the data-varying cast); with sequence parallelism an all-gather
    along seq forward, a reduce-scatter backward. One collective however many matmuls follow."""
    tp = _tp()
    if tp is None:
        return constrain(x_BxTxD, ("batch", "seq", "embed"))
    if tp.sequence_parallel:
        return jax.lax.all_gather(x_BxTxD, tp.axis, axis=1, tiled=True)
    return jax.lax.pcast(x_BxTxD, tp.axis, to="varying")


def exit_tp(partial_BxTxD: jax.Array) -> jax.Array:
    """Output of a row-parallel matmul (attention output, MLP down): each model rank holds a
    partial sum. Megatron's `g`: all-reduce forward (identity backward); with sequence
    parallelism a reduce-scatter along seq onto the residual stream (all-gather backward)."""
    tp = _tp()
    if tp is None:
        return constrain(partial_BxTxD, ("batch", "sp_seq", "embed"))
    if tp.sequence_parallel:
        return jax.lax.psum_scatter(partial_BxTxD, tp.axis, scatter_dimension=1, tiled=True)
    return jax.lax.psum(partial_BxTxD, tp.axis)


def local_kv_heads(kv_BxTxKxH: jax.Array) -> jax.Array:
    """The kv heads that serve this rank's query heads. With n_kv_heads < t the kv projections
    are replicated (all K heads computed on every rank) and each rank keeps the one head its
    N/t query heads share; otherwise kv heads are already split like the query heads."""
    tp = _tp()
    if tp is None or not tp.kv_replicated:
        return kv_BxTxKxH
    ranks_per_kv_head = tp.t // tp.n_kv_heads
    head = jax.lax.axis_index(tp.axis) // ranks_per_kv_head
    return jax.lax.dynamic_slice_in_dim(kv_BxTxKxH, head, 1, axis=2)


def local_seq(x_TxD: jax.Array, axis: int = 0) -> jax.Array:
    """This rank's rows (along the sequence dim `axis`) of a per-position table under sequence
    parallelism (else all of them)."""
    tp = _tp()
    if tp is None or not tp.sequence_parallel:
        return x_TxD
    n = x_TxD.shape[axis] // tp.t
    return jax.lax.dynamic_slice_in_dim(x_TxD, jax.lax.axis_index(tp.axis) * n, n, axis=axis)


def embed_lookup(table_VxD: jax.Array, ids_BxT: jax.Array) -> jax.Array:
    """Rows of an embedding table for token ids, onto the residual stream [B, T, D] (`sp_seq`).

    With the vocab split over `model` (Megatron's vocab-parallel embedding): each rank looks up
    the ids its slice holds, zeros the rest, and the ranks' results are summed (reduce-scattered
    along seq under sequence parallelism)."""
    tp = _tp()
    if tp is None:
        return constrain(jnp.take(table_VxD, ids_BxT, axis=0), ("batch", "sp_seq", "embed"))
    local = ids_BxT - vocab_offset(table_VxD.shape[0])
    inside = (local >= 0) & (local < table_VxD.shape[0])
    rows = jnp.take(table_VxD, jnp.where(inside, local, 0), axis=0)
    return exit_tp(jnp.where(inside[..., None], rows, jnp.zeros((), rows.dtype)))


def vocab_offset(local_vocab: int) -> jax.Array | int:
    """The first vocabulary id of this rank's slice (0 without tensor parallelism)."""
    tp = _tp()
    return 0 if tp is None else jax.lax.axis_index(tp.axis) * local_vocab


def vocab_reduce(x: jax.Array, op: str) -> jax.Array:
    """Finish a reduction over the vocabulary ("max" or "sum") across model ranks' slices."""
    tp = _tp()
    if tp is None:
        return x
    return jax.lax.pmax(x, tp.axis) if op == "max" else jax.lax.psum(x, tp.axis)
