"""Shared test helpers: run a few steps of a config on a mesh and collect what parity compares,
`assert_parity`, the one comparison every parity test of the suite makes, and `pairwise`, the
covering array the slow parity matrices are drawn from."""

from __future__ import annotations

import collections
import itertools
import json
import os
import shutil
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax

from jaxpar.config import Config
from jaxpar.mesh import make_mesh
from jaxpar.train.data import batch_at, make_source
from jaxpar.train.step import build

# Tolerances of every parity test, all float32 rounding: a parallel run sums the same per-example
# terms in another order (per-device partial sums over data shards, stages and model ranks, then
# collectives). A missing or doubled reduction moves a gradient, and the gradient norm, by a
# factor of 2 (relative error 0.5 or 1), far outside every figure here.
LOSS_RTOL = 1e-5       # a mean of ~100 log-probabilities of size ~4: observed <= 9e-7 relative
# The global norm of the gradient (the step's `grad_norm`, before clipping) at every step: a sum of
# ~1e4 squares in another order, observed <= 2.5e-7 relative. A reduction done twice over data
# doubles it, one left out divides it by up to d.
GRAD_NORM_RTOL = 1e-5
# Gradients of size 1e-3..0.34, leaf by leaf: observed diffs <= 1e-7. They are read back from the
# step's own first Adam moment (see run_steps): two float32 roundings more on each side, <= 2.4e-7
# at |g| = 1, the same on both runs up to one ulp.
GRAD_ATOL = 1e-6
# After 3 AdamW steps at lr 1e-2: Adam divides by sqrt(v) + eps, so a rounding difference in a
# gradient element that is itself near zero moves that element's update by up to ~lr x its
# relative difference. Observed <= 4.3e-6; 5e-5 is 0.5% of one step of size lr. (It cannot see a
# doubled reduction: Adam and global-norm clipping are invariant to the gradient's scale, which
# is why the gradients and their norms are compared too.)
PARAM_ATOL = 5e-5
# MoE router metrics (aux loss ~1, z-loss ~2, loads ~1, dropped fraction): float32 means over the
# step's tokens, summed in another order per mesh; 1e-5 is ~80 float32 ulps at 1. A sequence
# routed on the wrong rank, or a report summed twice, moves them by far more.
MOE_ATOL = 1e-5

# The parity runs compile with LLVM's optimizations off. Parity is a property of the partitioned
# HLO program (every pass that shards, partitions and places collectives still runs); the backend
# level only changes how each fused kernel is emitted, not what it computes (float32 rounding,
# within the figures above), and halves the compile time that dominates these tests (step 6.0 ->
# 3.5 s, init 3.5 -> 0.9 s of CPU per case). `conftest.py` sets the same level in XLA_FLAGS for
# every other program the suite compiles (structure and memory tests, CLI runs): the compiled
# HLO text and the memory analysis are the same at either level (measured).
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def single_device(cfg: Config) -> Config:
    """The same run on one device: mesh (1, 1, 1), no parallelism."""
    return cfg.replace(mesh={"data": 1, "stage": 1, "model": 1})


def run_steps(cfg: Config, devices=None) -> dict:
    """Run `cfg.train.steps` steps of the compiled train step from `program.init`.

    Returns the loss and the gradient norm (before clipping) of every step, the gradients at the
    initial parameters on the first batch (as the step computed them), the initial and final
    parameters, the count of skipped steps, and the MoE, MTP and QK-clip (`maxima`) metrics. Runs on the first data x stage x model devices
    unless `devices` is given.

    The gradients cost no extra program: Adam's first moment after step 0 is (1 - b1) x the
    clipped gradient of step 0, and clipping scaled it by grad_clip / grad_norm when the norm
    exceeded grad_clip. So they are the gradients of the very program that trains, per leaf.
    """
    if devices is None:
        devices = jax.devices()[:cfg.mesh.data * cfg.mesh.stage * cfg.mesh.model]
    mesh = make_mesh(cfg, devices)
    program = build(cfg, mesh)
    source = make_source(cfg)
    key = jax.random.key(cfg.train.seed)
    state = program.init.lower(key).compile(COMPILER_OPTIONS)(key)
    init = jax.device_get(state.params)
    batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(cfg.train.steps)]
    step = program.step.lower(state, batches[0]).compile(COMPILER_OPTIONS)
    losses, norms, grads, moe, mtp, maxima = [], [], None, [], [], []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        moe.append([float(metrics[k]) for k in sorted(metrics) if k.startswith("moe_")])
        mtp.append([float(metrics[k]) for k in sorted(metrics) if k.startswith("mtp_")])
        if "max_logit" in metrics:  # train.qk_clip: the largest logit, then each layer's in order
            maxima.append([float(metrics["max_logit"])] + [float(metrics[f"max_logit_{n}"])
                                                           for n in range(cfg.model.n_layers)]
                          + [float(metrics[f"max_logit_mtp_{k}"]) for k in range(1, cfg.model.mtp_depth + 1)])
        if grads is None:
            grads = _first_gradient(cfg, state.opt_state, norms[0])
    return {"losses": np.array(losses), "grad_norms": np.array(norms), "grads": grads, "init": init,
            "params": jax.device_get(state.params), "skipped": int(metrics["skipped_steps"]),
            "moe": np.array(moe), "mtp": np.array(mtp), "maxima": np.array(maxima)}


def _first_gradient(cfg: Config, opt_state, grad_norm: float):
    """The unclipped gradient of step 0, in float64, from Adam's first moment after it."""
    tr = cfg.train
    mu = jax.device_get(optax.tree.get(opt_state, "mu"))  # after one step from zero: (1 - b1) x clipped g
    scale = (grad_norm / tr.grad_clip if tr.grad_clip > 0 and grad_norm >= tr.grad_clip else 1.0) / (1 - tr.b1)
    return jax.tree.map(lambda m: np.asarray(m, np.float64) * scale, mu)


def run_reference(cfg: Config) -> dict:
    return run_steps(single_device(cfg).replace(parallel={"zero": 0, "microbatches": 1}), devices=jax.devices()[:1])


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def parity_failures(out: dict, ref: dict) -> dict[str, str]:
    """Which of the parity checks `out` fails against the single-device `ref`, with the figures:
    losses at every step, gradient norms at every step, gradients at the initial parameters leaf
    by leaf, final parameters. Empty when all pass."""
    failed = {}
    loss_err = np.max(np.abs(out["losses"] - ref["losses"]) / np.abs(ref["losses"]))
    if not loss_err <= LOSS_RTOL:
        failed["losses"] = f"relative diff {loss_err:.3g} > {LOSS_RTOL}: {out['losses']} vs {ref['losses']}"
    norm_err = np.max(np.abs(out["grad_norms"] - ref["grad_norms"]) / ref["grad_norms"])
    if not norm_err <= GRAD_NORM_RTOL:
        failed["grad_norms"] = (f"relative diff {norm_err:.3g} > {GRAD_NORM_RTOL}: "
                                f"{out['grad_norms']} vs {ref['grad_norms']}")
    # MoE: what the routers reported at every step (losses, extreme loads, dropped fraction): sums
    # over the same tokens in another order, as the loss is.
    moe_err = np.max(np.abs(out["moe"] - ref["moe"]), initial=0.0) if "moe" in out and "moe" in ref else 0.0
    if not moe_err <= MOE_ATOL:
        failed["moe"] = f"router metrics differ by {moe_err:.3g} > {MOE_ATOL}: {out['moe']} vs {ref['moe']}"
    # Multi-token prediction: each depth's loss at every step (`loss` is the main loss), as the loss.
    if "mtp" in out and "mtp" in ref and out["mtp"].size + ref["mtp"].size:
        mtp_err = (np.max(np.abs(out["mtp"] - ref["mtp"]) / np.abs(ref["mtp"])) if out["mtp"].shape == ref["mtp"].shape
                   else np.inf)
        if not mtp_err <= LOSS_RTOL:
            failed["mtp"] = f"MTP losses differ by {mtp_err:.3g} relative > {LOSS_RTOL}: {out['mtp']} vs {ref['mtp']}"
    leaves = jax.tree_util.tree_leaves_with_path(out["grads"])
    want = jax.tree.leaves(ref["grads"])
    assert jax.tree.structure(out["grads"]) == jax.tree.structure(ref["grads"])
    bad = [(jax.tree_util.keystr(p), float(np.max(np.abs(g - w)))) for (p, g), w in zip(leaves, want)]
    bad = [(k, d) for k, d in bad if not d < GRAD_ATOL]
    if bad:
        failed["grads"] = f"{len(bad)} of {len(want)} leaves differ by >= {GRAD_ATOL}: " + ", ".join(
            f"{k} {d:.3g}" for k, d in bad[:6])
    param_err = max_abs_diff(out["params"], ref["params"])
    if not param_err < PARAM_ATOL:
        failed["params"] = f"max abs diff {param_err:.3g} >= {PARAM_ATOL}"
    if out["skipped"] or ref["skipped"]:
        failed["skipped"] = f"steps skipped as non-finite: {out['skipped']} (run), {ref['skipped']} (reference)"
    return failed


def assert_parity(out: dict, ref: dict) -> None:
    """`out` computes the single-device function `ref`: losses and gradient norms at every step,
    gradients at the initial parameters leaf by leaf, final parameters (tolerances above)."""
    # The reference must actually have moved its parameters, or the comparison proves nothing.
    assert max_abs_diff(ref["params"], ref["init"]) > 1e-3
    failed = parity_failures(out, ref)
    assert not failed, "parity fails on " + "; ".join(f"{k}: {v}" for k, v in failed.items())


def run_with_loss_and_grads(cfg: Config) -> dict:
    """Like `run_steps`, for a step whose optimizer state is not plain Adam (naive data
    parallelism's per-rank slots, master weights): the gradients at the initial parameters come
    from `program.loss_and_grads` (one more compile) instead of Adam's first moment. Returns the
    losses and gradient norms of every step, those gradients, the final state (on the host) and
    its parameters."""
    program = build(cfg, make_mesh(cfg, jax.devices()[:cfg.mesh.data * cfg.mesh.stage * cfg.mesh.model]))
    source = make_source(cfg)
    state = program.init(jax.random.key(cfg.train.seed))
    batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(cfg.train.steps)]
    grads = jax.device_get(program.loss_and_grads(state.params, batches[0])[1])
    losses, norms = [], []
    for batch in batches:
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    state = jax.device_get(state)
    return {"losses": np.array(losses), "grad_norms": np.array(norms), "grads": grads, "state": state,
            "params": state.params}


def run_with_loss_and_grads_compiled(cfg: Config, options=COMPILER_OPTIONS) -> dict:
    """`run_with_loss_and_grads`, each of its three programs (init, step, loss_and_grads) compiled
    once with `options` (by default LLVM's optimizations off, as `run_steps`): the same figures."""
    program = build(cfg, make_mesh(cfg, jax.devices()[:cfg.mesh.data * cfg.mesh.stage * cfg.mesh.model]))
    source = make_source(cfg)
    key = jax.random.key(cfg.train.seed)
    state = program.init.lower(key).compile(options)(key)
    batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(cfg.train.steps)]
    loss_and_grads = program.loss_and_grads.lower(state.params, batches[0]).compile(options)
    grads = jax.device_get(loss_and_grads(state.params, batches[0])[1])
    step = program.step.lower(state, batches[0]).compile(options)
    losses, norms = [], []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    state = jax.device_get(state)
    return {"losses": np.array(losses), "grad_norms": np.array(norms), "grads": grads, "state": state,
            "params": state.params}


def write_hf_config(folder, **changes) -> None:
    """Change keys of a Hugging Face folder's config.json in place."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        c = json.load(f)
    c.update(changes)
    with open(path, "w") as f:
        json.dump(c, f)


def copy_folder(src, dst) -> str:
    """A copy of folder `src` at `dst` (its path, as a str)."""
    shutil.copytree(src, dst)
    return str(dst)


def pairwise(options: dict[str, Sequence], must: Sequence[dict] = (),
             valid: Callable[[dict], bool] | None = None) -> list[dict]:
    """A covering array of strength 2 over `options` (name -> its values): rows (name -> value)
    such that every pair of values of two options that occur together in some valid row of the
    full product occur together in some row. Starts from the rows `must` (returned first, as
    given: the cases a test already runs), then adds, until every such pair is covered, the valid
    row of the product that covers the most pairs still uncovered (on a tie, the one whose values
    the rows so far hold least often, then the first in product order): deterministic, no
    randomness. `valid(row)` rules out combinations that cannot run; no row it refuses is ever
    added. Enumerates the product, which is fine up to some 10^5 rows."""
    names = list(options)

    def index(row):
        return tuple(options[n].index(row[n]) for n in names)

    def pairs(combo):
        return frozenset((i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(combo), 2))

    candidates = [c for c in itertools.product(*(range(len(options[n])) for n in names))
                  if valid is None or valid({n: options[n][k] for n, k in zip(names, c)})]
    covers = [pairs(c) for c in candidates]
    needed = frozenset().union(*covers)
    rows, covered, used = [dict(r) for r in must], set(), collections.Counter()
    for row in rows:
        if set(row) != set(names) or (valid is not None and not valid(row)):
            raise ValueError(f"a required row is not a valid row of {names}: {row}")
        covered |= pairs(index(row))
        used.update(enumerate(index(row)))
    while not needed <= covered:
        best = max(range(len(candidates)), key=lambda k: (len(covers[k] - covered),
                                                          -sum(used[v] for v in enumerate(candidates[k]))))
        rows.append({n: options[n][k] for n, k in zip(names, candidates[best])})
        covered |= covers[best]
        used.update(enumerate(candidates[best]))
    return rows


def assert_kv_cache_equals_recomputation(cfg, params, vocab: int, seed: int | None = None) -> list[int]:
    """Prefill and one cached step give the full forward's logits, and greedy decoding with the KV
    cache gives the tokens of greedy decoding by full recomputation (12 new tokens after a random
    7-token prompt of ids below `vocab`). Returns the generated tokens."""
    import jax.numpy as jnp

    from jaxpar import model
    from jaxpar.generate import generate
    from jaxpar.model.decode import extend, init_cache

    prompt = [int(i) for i in np.random.default_rng(seed).integers(0, vocab, 7)]
    full = np.asarray(model.apply(cfg, params, jnp.asarray([prompt])))
    cache = init_cache(cfg, 1, 12)
    pre, cache = extend(cfg, params, jnp.asarray([prompt[:6]]), cache, jnp.int32(0))
    one, cache = extend(cfg, params, jnp.asarray([prompt[6:]]), cache, jnp.int32(6))
    # Different matmul shapes and a masked softmax over the cache: float32 rounding only (~1e-7).
    np.testing.assert_allclose(np.asarray(pre)[0], full[0, :6], atol=1e-5)
    np.testing.assert_allclose(np.asarray(one)[0, 0], full[0, 6], atol=1e-5)
    new = generate(cfg, params, prompt, 12)
    # Full recomputation over a fixed-length window (one compile): positions after the last
    # token cannot change its logits (causal attention).
    toks = np.zeros((1, len(prompt) + 12), np.int32)
    toks[0, :len(prompt)] = prompt
    forward = jax.jit(lambda p, t: model.apply(cfg, p, t))
    for n in range(len(prompt), len(prompt) + 12):
        toks[0, n] = int(jnp.argmax(forward(params, toks)[0, n - 1, :vocab]))
    assert new == list(toks[0, len(prompt):])
    return new


def record_reads(monkeypatch) -> list[tuple[str, tuple]]:
    """Every (tensor, slice bounds, elements) `jaxpar.hf.load_params` reads from a safetensors file, in
    order (safetensors' `safe_open` patched for the test)."""
    import safetensors

    reads, real = [], safetensors.safe_open

    class Slice:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, sl):
            out = self.inner[sl]
            reads.append((self.name, tuple((s.start, s.stop) for s in sl), out.size))
            return out

    class Handle:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return Slice(self.inner.get_slice(name), name)

    monkeypatch.setattr(safetensors, "safe_open", Handle)
    return reads


def folder_tensors(folder) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face folder's safetensors files, by name."""
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out |= load_file(os.path.join(folder, f))
    return out


def edit_schedule(schedule, drop=(), add=()):
    """A copy of a pipeline `Schedule` without the actions in `drop` and with (tick, stage, action)
    in `add` (the table validator's tests break valid tables so)."""
    import dataclasses

    ticks = [[[a for a in cell if a not in drop] for cell in row] for row in schedule.ticks]
    for t, s, a in add:
        while len(ticks) <= t:
            ticks.append([[] for _ in range(schedule.stages)])
        ticks[t][s].append(a)
    return dataclasses.replace(schedule, ticks=tuple(tuple(tuple(c) for c in row) for row in ticks))
