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
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.config import Config

# Every logical dim name the model may use.
# `sp_seq` is the seq dim of activations outside the attention and MLP matmuls (norms, residual
# adds): the regions that sequence parallelism shards over `model`.
LOGICAL_NAMES = ("batch", "seq", "sp_seq", "pos", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab",
                 "layers")

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


def storage_rules(cfg: Config, mesh: Mesh) -> Rules:
    """Where parameters, gradients and optimizer state live (before ZeRO, `jaxpar.parallel.zero`).

    Tensor parallelism splits heads, MLP width and vocabulary over `model` (Megatron: column-
    parallel q/k/v and up/gate, row-parallel output and down projections, vocab-parallel
    embedding and output); the pipeline cuts `layers` over `stage`. Everything else is replicated.
    """
    return Rules({
        "batch": None, "seq": None, "sp_seq": None, "pos": None, "embed": None, "head_dim": None,
        "heads": "model", "kv_heads": _kv_heads_axis(cfg, mesh), "mlp": "model", "vocab": "model",
        "layers": "stage",
    })


def compute_rules(cfg: Config, mesh: Mesh) -> Rules:
    """How activations flow: the batch split over `data`; heads, MLP width and vocab over `model`;
    under sequence parallelism the residual stream's seq dim (`sp_seq`) over `model` too."""
    return Rules({
        "batch": "data", "seq": None, "sp_seq": "model" if cfg.parallel.sequence_parallel else None,
        "pos": None, "embed": None, "head_dim": None,
        "heads": "model", "kv_heads": _kv_heads_axis(cfg, mesh), "mlp": "model", "vocab": "model",
        "layers": None,
    })


def named_shardings(mesh: Mesh, rules: Rules, names_tree: Any) -> Any:
    """Map a pytree of logical-name tuples to a pytree of NamedShardings."""
    return jax.tree.map(lambda names: NamedSharding(mesh, rules.spec(names)), names_tree,
                        is_leaf=lambda x: isinstance(x, tuple))


# --------------------------------------------------------------------------------------------
# Marks the model makes: activations (`constrain`) and parameters about to be used (`use_params`)


# Parameters returned by `use_params` carry this name, so that rematerialization never saves them:
# under ZeRO-3 they are all-gathered copies, gathered again in the backward pass instead.
PARAMS_TAG = "jaxpar_params"

ParamFn = Callable[[jax.Array, tuple[str, ...]], jax.Array]

# Primitives that hand out parameters inside a data-parallel region: a data-axis cast (`pvary`)
# and ZeRO-3's all-gather. Their results are cheap to recompute (or must not be held, for
# ZeRO-3), so no remat policy of jaxpar saves them for the backward pass.
_PARAM_PRIMITIVES = ("pvary", "pcast", "all_gather")


def params_never_saved(policy: Callable[..., bool] | None) -> Callable[..., bool]:
    """A remat policy like `policy` (None: save nothing) that never saves handed-out parameters.

    Per layer, the backward pass re-gathers ZeRO-3 shards instead of holding every layer's
    gathered weights from the forward pass (which would undo ZeRO-3's memory saving)."""
    def saveable(prim, *args, **params) -> bool:
        if prim.name in _PARAM_PRIMITIVES or (prim.name == "name" and params.get("name") == PARAMS_TAG):
            return False
        return policy is not None and policy(prim, *args, **params)
    return saveable


class _Active(NamedTuple):
    mesh: Mesh
    rules: Rules
    param_fn: ParamFn | None


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("jaxpar_rules", default=None)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules, *, param_fn: ParamFn | None = None):
    """Within this context (at trace time) `constrain` pins activations to `rules` on `mesh`, and
    `use_params` passes each parameter and its logical names through `param_fn` (e.g. a data-axis
    `pcast`, whose transpose reduces the gradient exactly where its parameter entered the
    computation, or a ZeRO-3 all-gather, whose transpose reduce-scatters it)."""
    token = _ACTIVE.set(_Active(mesh, rules, param_fn))
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


def use_params(tree: Any, names: Any) -> Any:
    """Mark a tree of parameters (dims named by the matching tree `names`) as about to be used."""
    active = _ACTIVE.get()
    if active is None or active.param_fn is None:
        return tree
    fn = active.param_fn
    return jax.tree.map(lambda x, n: checkpoint_name(fn(x, n), PARAMS_TAG), tree, names,
                        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x))
