"""Naive data parallelism (`parallel.data_mode = naive`): torch.nn.DataParallel's pattern, for comparison.

The batch is split over `data` as in DDP; after that, everything funnels through device 0 (rank 0
of `data`, `ROOT`):

1. every device computes the gradient of its batch shard (accumulated in float32 over
   microbatches), unreduced;
2. reduce to the root: each other rank sends its gradient (and its partial loss) to rank 0, which
   adds them up. XLA has no reduce-to-root collective (and `lax` none), so this is the linear gather
   of DataParallel's backward: d - 1 collective-permutes, permute r with the single pair
   {r -> 0}; rank 0 receives (d - 1) gradients, every other rank sends one;
3. the update on the root only: AdamW runs inside a `lax.cond` on `axis_index(data) == 0`, so the
   other ranks skip it; the optimizer state has one slot per rank (a leading dim of size d,
   sharded over `data`) and only slot 0 is ever read or written: the others stay zeros;
4. broadcast from the root: d - 1 collective-permutes {0 -> r} carry the new parameters (with the
   loss and the gradient norm) to every other rank; rank 0 sends d - 1 copies.

In the compiled step this is 2(d - 1) collective-permutes over `data` and no all-reduce over
`data` at all. A ring-pipelined reduce or broadcast (NCCL's) would move only one copy through rank
0; XLA's CPU runtime has no broadcast (`lax.pbroadcast` has no CPU lowering), and a star is what
DataParallel does when it gathers onto device 0, so the star is what is built, and measured
(benchmarks/naive_dp.py).

Memory: one SPMD program allocates the same buffers on every device, so every rank holds a slot
of optimizer state as large as rank 0's (dead zeros) and receive buffers for the permutes:
per-device memory is DDP's. What differs between rank 0 and the others is what is live, the bytes
through their links, and who computes the update.

Checkpoints hold the canonical layout (slot 0 of the optimizer state, shaped like DDP's): a naive
run resumes onto DDP or ZeRO and back (`canonical_opt_state`, `from_canonical_opt_state`).

The shard_map runs with `check_vma=False`: the broadcast makes the parameters equal on every rank,
but a collective-permute's result is data-varying to JAX's type system and nothing in `lax` casts
it back to invariant without an all-reduce; the gradients are taken of explicitly data-varying
copies of the parameters, so no reduction is inserted by autodiff either way.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.config import Config
from jaxpar.parallel import microbatches
from jaxpar.parallel.zero import Layout
from jaxpar.sharding import activation_rules, compute_rules

DATA = "data"
ROOT = 0


def describe(cfg: Config) -> str:
    """Where gradients go in naive mode, in words (for the CLI)."""
    m = cfg.parallel.microbatches
    return (f"naive: accumulated over {m} microbatch(es), gathered onto device 0 (d - 1 collective-permutes), "
            "AdamW on device 0 only, new parameters sent from it (d - 1 collective-permutes)")


def root_optimizer(inner: optax.GradientTransformation, d: int) -> optax.GradientTransformation:
    """`inner` with its state held in slot ROOT of a leading dim of size `d` (sharded over `data`:
    one slot per rank), the other slots zeros. Its `update` updates slot ROOT (the train step does
    this inside the shard_map, on the root only)."""

    def init(params):
        return jax.tree.map(lambda x: jnp.zeros((d,) + x.shape, x.dtype).at[ROOT].set(x), inner.init(params))

    def update(updates, state, params=None):
        updates, new = inner.update(updates, canonical_opt_state(state), params)
        return updates, jax.tree.map(lambda s, x: s.at[ROOT].set(x), state, new)

    return optax.GradientTransformation(init, update)


def canonical_opt_state(state: Any) -> Any:
    """The optimizer state as DDP holds it (shaped like the parameters): slot ROOT."""
    return jax.tree.map(lambda x: x[ROOT], state)


def canonical_opt_state_on(state: Any, mesh: Mesh) -> Any:
    """`canonical_opt_state` as arrays replicated over `mesh` (what a checkpoint saves)."""
    return jax.jit(canonical_opt_state, out_shardings=NamedSharding(mesh, P()))(state)


def from_canonical_opt_state(program, canonical: Any) -> Any:
    """A canonical optimizer state (from a checkpoint of any mode) in `program`'s rooted layout."""
    d = program.mesh.shape[DATA]
    expand = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jnp.zeros((d,) + x.shape, x.dtype).at[ROOT].set(x), t)
    return jax.jit(expand, out_shardings=program.state_shardings.opt_state)(canonical)


def canonical_abstract_opt_state(program) -> Any:
    """ShapeDtypeStructs of the canonical optimizer state, replicated over `program`'s mesh."""
    replicated = NamedSharding(program.mesh, P())
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype, sharding=replicated),
                        program.abstract_state().opt_state)


def reduce_to_root(tree: Any, d: int) -> Any:
    """Sum of `tree` over the `data` ranks, on ROOT only (the other ranks get garbage): d - 1
    collective-permutes r -> ROOT, each added as it arrives (DataParallel's gather onto device 0)."""
    acc = tree
    for r in range(d):
        if r != ROOT:
            acc = jax.tree.map(jnp.add, acc, jax.lax.ppermute(tree, DATA, [(r, ROOT)]))
    return acc


def broadcast_from_root(tree: Any, d: int) -> Any:
    """ROOT's `tree` on every rank: d - 1 collective-permutes ROOT -> r. A rank that is not a
    permute's target receives zeros from it, so each rank's value is the sum of what it received
    (exact: one term is the root's value, the others are zeros); the root keeps its own."""
    if d == 1:
        return tree
    received = [jax.lax.ppermute(tree, DATA, [(ROOT, r)]) for r in range(d) if r != ROOT]
    total = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *received)
    is_root = jax.lax.axis_index(DATA) == ROOT
    return jax.tree.map(lambda own, got: jnp.where(is_root, own, got), tree, total)


def _shard_grads(cfg: Config, mesh: Mesh, loss_fn: Callable) -> Callable:
    """`(params, rows) -> (loss, grads)` of this rank's rows, unreduced (inside the shard_map)."""
    m = cfg.parallel.microbatches
    n_tokens = microbatches.loss_tokens(cfg)
    rules = compute_rules(cfg, mesh).without((DATA,))  # the shard_map is manual over data, even of size 1

    def grads_of(params, rows):
        with activation_rules(mesh, rules):
            return jax.value_and_grad(lambda p: loss_fn(p, rows, n_tokens))(params)

    def local(params, rows):  # the accumulation of DDP and ZeRO, on this rank's rows
        return microbatches.accumulate(lambda r: grads_of(params, r), params, rows, m)

    return local


def make_loss_and_grads(cfg: Config, mesh: Mesh, layout: Layout, loss_fn: Callable) -> Callable:
    """`(params, batch) -> (loss, grads)` as the naive step computes them (reduced onto the root),
    then broadcast so that they come out replicated (for tests and inspection; the step itself never
    sends gradients back)."""
    d, local = mesh.shape[DATA], _shard_grads(cfg, mesh, loss_fn)

    def body(params, rows):
        return broadcast_from_root(reduce_to_root(local(params, rows), d), d)

    return jax.shard_map(body, mesh=mesh, in_specs=(layout.manual_specs("params", {DATA}), P(DATA)),
                         out_specs=(P(), layout.manual_specs("grads", {DATA})), axis_names={DATA},
                         check_vma=False)


def make_step(cfg: Config, mesh: Mesh, layout: Layout, inner: optax.GradientTransformation,
              schedule: optax.Schedule, loss_fn: Callable, state_type: type) -> Callable:
    """The naive train step `(state, batch) -> (state, metrics)`, with the semantics of
    `jaxpar.train.step.build`'s step (clipping and AdamW by `inner`; train.on_nan by
    `microbatches.guard_non_finite`, decided on the root and again, identically, from the
    broadcast loss and norm)."""
    d, local = mesh.shape[DATA], _shard_grads(cfg, mesh, loss_fn)
    on_nan = cfg.train.on_nan
    param_specs = layout.manual_specs("params", {DATA})

    def body(params, opt_slots, step, skipped, rows):
        loss, g = reduce_to_root(local(params, rows), d)
        opt = canonical_opt_state(opt_slots)  # this rank's slot: [1, ...] -> [...]

        def update(_):
            grad_norm = optax.tree.norm(g)
            ok = microbatches.guard_non_finite(on_nan, loss, grad_norm, step, skipped)[0]
            updates, new_opt = inner.update(g, opt, params)
            new_params = optax.apply_updates(params, updates)
            new_params, new_opt = jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                               (new_params, new_opt), (params, opt))
            return new_params, new_opt, grad_norm.astype(jnp.float32)

        def idle(_):  # every rank but the root: no optimizer work at all
            return params, opt, jnp.zeros((), jnp.float32)

        new_params, new_opt, grad_norm = jax.lax.cond(jax.lax.axis_index(DATA) == ROOT, update, idle, None)
        new_params, loss, grad_norm = broadcast_from_root((new_params, loss, grad_norm), d)
        return new_params, jax.tree.map(lambda x: x[None], new_opt), loss, grad_norm

    def run(params, opt_slots, step, skipped, batch):
        opt_specs = jax.tree.map(lambda _: P(DATA), opt_slots)
        return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, opt_specs, P(), P(), P(DATA)),
                             out_specs=(param_specs, opt_specs, P(), P()), axis_names={DATA},
                             check_vma=False)(params, opt_slots, step, skipped, batch)

    def step(state, batch):
        params, opt_state, loss, grad_norm = run(state.params, state.opt_state, state.step, state.skipped, batch)
        _, next_step, skipped = microbatches.guard_non_finite(on_nan, loss, grad_norm, state.step, state.skipped)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "skipped_steps": skipped}
        return state_type(next_step, params, opt_state, skipped), metrics

    return step


def opt_state_shardings(optimizer: optax.GradientTransformation, shapes: Any, mesh: Mesh) -> Any:
    """The rooted optimizer state's shardings: one slot per `data` rank."""
    return jax.tree.map(lambda _: NamedSharding(mesh, P(DATA)), jax.eval_shape(optimizer.init, shapes))
