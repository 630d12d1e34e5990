"""Expert parallelism's token exchange (`model.moe_exchange`, docs/moe.md "The exchange"): which
one runs, what it moves (the one rule the executor and the planner both read), and the ragged one.

With the experts split over the data ranks (`moe.experts_parallel`), every routed assignment
travels to its expert's rank and its result travels back. Two exchanges do it:

- `fixed`: a buffer of `buffer_rows` rows per destination rank, the worst case (every token's
  choices on that rank), sent whole by `jax.lax.all_to_all` whatever the routing; the receiver
  groups the rows by local expert. XLA:CPU's path, and the fallback everywhere.
- `ragged`: `jax.lax.ragged_all_to_all`, which moves only the routed rows (XLA:GPU; XLA:CPU
  compiles the op but cannot run it in jaxlib 0.10.2: "HLO opcode ragged-all-to-all is not
  supported by XLA:CPU ThunkEmitter"). Each rank first all-gathers every rank's per-expert counts
  ([ranks, E] int32: `ragged_plan` needs the counts of the senders before it to know where its
  rows land on the receiver, so the E-sized count vectors are all-gathered rather than exchanged
  by an all-to-all as Megatron and torchtitan do, whose all-to-all takes receiver-side offsets).
  From them, without another collective, `ragged_plan` computes both directions' offsets and
  sizes: each rank's rows are sorted by expert (one chunk per expert, E chunks), and each chunk
  lands on its expert's rank at its expert's run, after the chunks of the ranks before it, so
  the receive buffer comes out grouped by local expert (no sort on the receiver). The results go
  back by the reverse exchange, and each direction's transpose is the other (`exchange`'s custom
  VJP), so the backward is one ragged all-to-all each way as well.

`resolve` is what runs (auto: ragged on GPUs, fixed elsewhere); `routed_rows` is the rows of
d_model one token exchange delivers to a device, which `jaxpar.plan.moe` charges.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.sharding import varying_axes, vary

EXCHANGES = ("auto", "fixed", "ragged")
"""`model.moe_exchange`'s values."""


def resolve(choice: str, platform: str) -> str:
    """The exchange that runs for `model.moe_exchange = choice` on `platform` (cpu, gpu, tpu):
    `fixed` or `ragged`; auto is ragged on GPUs only (XLA:CPU cannot run a ragged all-to-all; no
    TPU has run jaxpar's)."""
    if choice not in EXCHANGES:
        raise ValueError(f"model.moe_exchange = {choice!r} is none of {', '.join(EXCHANGES)}")
    if choice == "auto":
        return "ragged" if platform == "gpu" else "fixed"
    return choice


def capacity(cfg, seq_len: int) -> int:
    """Tokens an expert takes per sequence in capacity mode."""
    return math.ceil(cfg.capacity_factor * seq_len * cfg.experts_per_token / cfg.n_experts)


def buffer_rows(cfg, B: int, T: int, shards: int, local_experts: int) -> int:
    """Rows per destination rank of the fixed exchange's send buffer (and per source rank of
    either exchange's receive buffer), for B sequences of T tokens routed on this rank (`shards`
    sequence shards per sequence, over `model` and context ranks): the worst case, every token's
    choices on that rank's `local_experts` experts, or in capacity mode every one of them full in
    every sequence."""
    rows = B * T * min(cfg.experts_per_token, local_experts)
    if cfg.capacity_factor is not None:
        rows = min(rows, local_experts * capacity(cfg, T * shards) * B)
    return rows


def routed_rows(cfg, B: int, T: int, shards: int, local_experts: int, exchange: str) -> float:
    """Rows of d_model that one token exchange (`exchange`: fixed or ragged) delivers to a device
    routing B sequences of T tokens (`buffer_rows`' arguments), with ranks = E / local_experts:
    fixed, the whole buffer from every rank (ranks x `buffer_rows`); ragged, the routed rows, on
    a balanced load B·T·k (x capacity_factor where that drops assignments, below 1). The same rows
    go back, and each backward transpose moves as many."""
    if exchange == "ragged":
        scale = 1.0 if cfg.capacity_factor is None else min(1.0, float(cfg.capacity_factor))
        return B * T * cfg.experts_per_token * scale
    ranks = cfg.n_experts // local_experts
    return float(ranks * buffer_rows(cfg, B, T, shards, local_experts))


# --------------------------------------------------------------------------------------------
# The ragged exchange


# A plan: (input_offsets, send_sizes, output_offsets, recv_sizes), each [E] int32, as
# `jax.lax.ragged_all_to_all` takes them (chunk i goes to rank i // (E / ranks)).
Plan = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def ragged_plan(counts_RxE: jax.Array, me) -> tuple[Plan, Plan, jax.Array]:
    """Both directions of the ragged exchange from every rank's per-expert counts [R ranks, E]
    (rank r's rows for expert e; expert e on rank e // El, El = E / R) as rank `me` sees them:
    (forward plan, return plan, this rank's rows per local expert [El]). Pure integer arithmetic.

    Forward, this rank sends its rows sorted by expert, expert e's chunk (counts[me, e] rows from
    the exclusive cumsum of its counts) to expert e's rank, where it lands at the start of e's
    run plus the rows for e of the ranks before `me`; it receives, in chunk i = src·El + l,
    counts[src, me·El + l] rows. The return plan is the forward's mirror (the transpose)."""
    R, E = counts_RxE.shape
    El = E // R
    counts = counts_RxE.astype(jnp.int32)
    mine = counts[me]  # [E]
    send_offsets = jnp.cumsum(mine) - mine
    # On each expert's rank: its experts' runs one after another, each the ranks' chunks in order.
    per_rank = counts.reshape(R, R, El)  # [src, dst, local expert]
    totals = jnp.sum(per_rank, axis=0)  # [dst, El]: each rank's rows per local expert
    run_start = jnp.cumsum(totals, axis=1) - totals  # [dst, El]
    before = jnp.cumsum(per_rank, axis=0) - per_rank  # [src, dst, El]: rows of the ranks before src
    landing = run_start[None] + before  # [src, dst, El]: where src's chunk starts on dst
    out_offsets = landing[me].reshape(E)
    recv_sizes = per_rank[:, me, :].reshape(E)  # chunk src·El + l
    recv_offsets = landing[:, me, :].reshape(E)  # where those chunks landed here
    # The return: chunk src·El + l back to where src sent it from (src's offset of expert me·El + l).
    src_offsets = (jnp.cumsum(counts, axis=1) - counts).reshape(R, R, El)[:, me, :].reshape(E)
    forward = (send_offsets, mine, out_offsets, recv_sizes)
    back = (recv_offsets, recv_sizes, src_offsets, mine)
    return forward, back, totals[me]


_EMULATE: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxpar_emulate_ragged", default=False)


@contextlib.contextmanager
def emulated():
    """While tracing, the ragged exchange runs as `emulated_ragged_all_to_all` (all-gathers any
    backend runs): the same contract, so that CPU tests run the ragged path's offsets end to end."""
    token = _EMULATE.set(True)
    try:
        yield
    finally:
        _EMULATE.reset(token)


def exchange(rows: jax.Array, out_rows: int, forward: Plan, back: Plan, axis: str,
             groups: list[list[int]] | None) -> jax.Array:
    """`rows` sent by `forward` (`ragged_plan`) into a zero buffer of `out_rows` rows over the
    manual `axis` (within `groups`); differentiable in `rows`: the cotangent goes back by `back`."""
    return _exchange(rows, out_rows, forward, back, axis, _freeze(groups), _EMULATE.get())


def _freeze(groups):
    return None if groups is None else tuple(tuple(g) for g in groups)


def _send(rows, out_rows, plan, axis, groups, emulate):
    zeros = vary(jnp.zeros((out_rows, *rows.shape[1:]), rows.dtype), varying_axes(rows))
    f = emulated_ragged_all_to_all if emulate else jax.lax.ragged_all_to_all
    return f(rows, zeros, *plan, axis_name=axis, axis_index_groups=None if groups is None else [list(g) for g in groups])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 4, 5, 6))
def _exchange(rows, out_rows, forward, back, axis, groups, emulate):
    return _send(rows, out_rows, forward, axis, groups, emulate)


def _exchange_fwd(rows, out_rows, forward, back, axis, groups, emulate):
    return _send(rows, out_rows, forward, axis, groups, emulate), (rows.shape[0], forward, back)


def _exchange_bwd(out_rows, axis, groups, emulate, res, g):
    in_rows, forward, back = res
    # The transpose of a ragged exchange is the reverse one: each received row's cotangent goes
    # back to the row it came from (rows never sent get 0).
    return _send(g, in_rows, back, axis, groups, emulate), None, None  # (the plans: integers)


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """`jax.lax.ragged_all_to_all`'s documented contract built from all-gathers (for CPU tests;
    every rank gathers every rank's operand: R times the bytes). Chunk i of a sender goes to
    rank i // (chunks / ranks), at that rank's output row output_offsets[i]; `recv_sizes` is
    not needed to place the rows (it must match what the senders send)."""
    del recv_sizes
    gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, axis_index_groups=axis_index_groups)
    ops, starts, sizes, lands = gather(operand), gather(input_offsets), gather(send_sizes), gather(output_offsets)
    R, M = ops.shape[:2]
    per = starts.shape[1] // R
    me = rank_in_group(axis_name, axis_index_groups)
    chunks = jnp.arange(starts.shape[1]) // per == me  # [chunks]: the senders' chunks for me
    row = jnp.arange(M)[None, :, None]  # [1, M, 1]
    inside = (row >= starts[:, None, :]) & (row < starts[:, None, :] + sizes[:, None, :]) & chunks  # [R, M, chunks]
    target = jnp.sum(jnp.where(inside, lands[:, None, :] + row - starts[:, None, :], 0), axis=2)
    target = jnp.where(jnp.any(inside, axis=2), target, output.shape[0])  # out of bounds: dropped
    return output.at[target.reshape(-1)].set(ops.reshape(R * M, *ops.shape[2:]), mode="drop")


def _positions(groups) -> list[int]:
    """Each rank's index within its group."""
    out = [0] * sum(len(g) for g in groups)
    for g in groups:
        for i, rank in enumerate(g):
            out[rank] = i
    return out


def rank_in_group(axis: str, groups: list[list[int]] | None):
    """This rank's index on `axis`, or within its group of `groups`."""
    index = jax.lax.axis_index(axis)
    return index if groups is None else jnp.array(_positions(groups), jnp.int32)[index]


def experts_ragged(x_NxD, flat, valid, experts: Callable[[jax.Array, jax.Array], jax.Array], *, n_experts: int,
                   recv_rows: int, groups: list[list[int]] | None) -> jax.Array:
    """The rows of each of the N assignments' results ([N·k, D] in assignment order; 0 where not
    `valid`), by the ragged exchange: `flat` [N·k] each assignment's expert, `experts(xs, sizes)`
    the local experts' SwiGLU over rows grouped by local expert, `recv_rows` the receive buffer
    (ranks x the worst case from one rank: dropless)."""
    NK = flat.shape[0]
    token = jnp.arange(NK) // (NK // x_NxD.shape[0])
    key = jnp.where(valid, flat, n_experts)
    order = jnp.argsort(key, stable=True)  # by expert, the assignments not sent last: the one sort
    counts = jnp.sum(jax.nn.one_hot(key, n_experts, dtype=jnp.int32), axis=0)  # [E] (none for key E)
    every = jax.lax.all_gather(counts, "data", axis_index_groups=groups)  # [ranks, E]
    forward, back, sizes = ragged_plan(every, rank_in_group("data", groups))
    recv = exchange(x_NxD[token[order]], recv_rows, forward, back, "data", groups)
    ys = experts(recv, sizes)
    sent = exchange(ys, NK, back, forward, "data", groups)  # [N·k] in sorted order; unsent rows 0
    return jnp.zeros_like(sent).at[order].set(sent, unique_indices=True)
