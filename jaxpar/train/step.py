"""The training program: sharded state initialisation and the jitted, donated train step.

State is built as shapes -> shardings -> `jit(init, out_shardings=...)`, so parameters are born
on their devices and never exist whole on one host. The step is one `jax.jit` program: forward,
backward, gradient reduction over `data` (placed by GSPMD from the batch sharding: one
all-reduce per gradient, per layer inside the backward layer scan), clipping and AdamW.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar import model
from jaxpar.config import Config
from jaxpar.mesh import check_mesh, make_mesh
from jaxpar.sharding import activation_rules, compute_rules, named_shardings, storage_rules
from jaxpar.train.optim import lr_schedule, make_optimizer


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: model.Params
    opt_state: Any


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32."""
    return cross_entropy_sum(logits_BxTxV, targets_BxT) / targets_BxT.size


def cross_entropy_sum(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Summed next-token cross-entropy in float32."""
    logits_BxTxV = logits_BxTxV.astype(jnp.float32)
    logz_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    target_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return jnp.sum(logz_BxT - target_BxT)


def loss_fn(cfg: Config, params: model.Params, batch_BxT1: jax.Array, n_tokens: int | None = None) -> jax.Array:
    """Loss of `params` on token windows [B, T + 1] (inputs and shifted targets), summed and divided
    by `n_tokens` (default: this batch's targets). A data shard passes the global count, so that
    the shards' losses and gradients add up to those of the whole batch."""
    logits = model.apply(cfg.model, params, batch_BxT1[:, :-1], remat=cfg.parallel.remat)
    targets = batch_BxT1[:, 1:]
    return cross_entropy_sum(logits, targets) / (targets.size if n_tokens is None else n_tokens)


def _opt_state_shardings(opt_shapes: Any, param_shardings: Any, replicated: NamedSharding) -> Any:
    """Adam's moments (subtrees shaped like the parameters) live where their parameters live;
    everything else (step counts) is replicated."""
    params_def = jax.tree.structure(param_shardings)
    is_params = lambda x: jax.tree.structure(x) == params_def  # noqa: E731
    return jax.tree.map(lambda x: param_shardings if is_params(x) else replicated, opt_shapes, is_leaf=is_params)


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything compiled for one (config, mesh): shardings, `init(key)` and `step(state, batch)`."""

    cfg: Config
    mesh: Mesh
    optimizer: optax.GradientTransformation
    state_shardings: TrainState
    batch_sharding: NamedSharding
    init: Callable[[jax.Array], TrainState]
    step: Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]
    loss_and_grads: Callable[[model.Params, jax.Array], tuple[jax.Array, model.Params]]

    def abstract_state(self) -> TrainState:
        """The state as ShapeDtypeStructs with their shardings (to lower without allocating)."""
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        shape = (self.cfg.train.global_batch, self.cfg.model.seq_len + 1)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)


def build(cfg: Config, mesh: Mesh | None = None) -> Program:
    """Shardings and jitted functions for `cfg` on `mesh` (default: `make_mesh(cfg)`)."""
    mesh = make_mesh(cfg) if mesh is None else mesh
    check_mesh(mesh)
    names = model.param_names(cfg.model)
    optimizer = make_optimizer(cfg.train, names)
    schedule = lr_schedule(cfg.train)
    param_shardings = named_shardings(mesh, storage_rules(cfg), names)
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, compute_rules(cfg).spec(("batch", None)))

    opt_shapes = jax.eval_shape(optimizer.init, model.param_shapes(cfg.model))
    state_shardings = TrainState(replicated, param_shardings,
                                 _opt_state_shardings(opt_shapes, param_shardings, replicated))

    def init(key: jax.Array) -> TrainState:
        params = model.init_params(cfg.model, key)
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

    grads = data_parallel_grads(cfg, mesh)

    def step(state: TrainState, batch: jax.Array):
        loss, g = grads(state.params, batch)
        updates, opt_state = optimizer.update(g, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(g), "lr": schedule(state.step)}
        return TrainState(state.step + 1, params, opt_state), metrics

    return Program(
        cfg=cfg, mesh=mesh, optimizer=optimizer, state_shardings=state_shardings, batch_sharding=batch_sharding,
        init=jax.jit(init, out_shardings=state_shardings),
        step=jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, replicated), donate_argnums=0),
        loss_and_grads=jax.jit(grads, in_shardings=(param_shardings, batch_sharding),
                               out_shardings=(replicated, param_shardings)),
    )


def data_parallel_grads(cfg: Config, mesh: Mesh) -> Callable:
    """`(params, batch) -> (loss, grads)` of the global batch, each gradient reduced over `data` once.

    A shard_map manual over `data` (`model` and `stage` stay automatic): each data shard computes
    the gradient of its share of the loss, and every parameter is cast to data-varying where it
    enters the computation (`use_params`), so the transpose of that cast (a psum) reduces its
    gradient right there in the backward pass: per layer inside the backward layer scan, and
    once for a parameter used in several places (tied embeddings add up before the reduction).
    Left to GSPMD, the two uses of a tied embedding were reduced separately (measured on CPU).
    """
    manual = ("data",)
    rules = compute_rules(cfg).without(manual)
    n_tokens = cfg.train.global_batch * cfg.model.seq_len

    def to_varying(w: jax.Array) -> jax.Array:
        return jax.lax.pcast(w, manual, to="varying")

    def local(params, batch):
        with activation_rules(mesh, rules, param_fn=to_varying):
            loss, g = jax.value_and_grad(lambda p: loss_fn(cfg, p, batch, n_tokens))(params)
        return jax.lax.psum(loss, manual), g

    batch_spec = P(compute_rules(cfg).spec(("batch",))[0])
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), batch_spec), out_specs=(P(), P()),
                         axis_names=set(manual))


def lower_step(cfg: Config, mesh: Mesh | None = None) -> tuple[jax.stages.Compiled, Mesh]:
    """Compile the train step of `cfg` without allocating state (for `jaxpar.inspect` and tests)."""
    program = build(cfg, mesh)
    compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
    return compiled, program.mesh
