"""Composition: every factorization of 8 devices into (data, stage, model), every schedule and every
ZeRO stage, each pair of them together, computes the single-device function; ZeRO-2/3 under pipelining reduce and gather where
the docs say, and `parallel.zero3_gather` trades memory for traffic as stated."""

import math
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import assert_parity, pairwise, run_reference, run_steps
from jaxpar import model
from jaxpar.config import from_dict
from jaxpar.inspect import analyze
from jaxpar.parallel.schedules import build as build_schedule
from jaxpar.train.step import build, lower_step

FACTORIZATIONS = [(d, p, 8 // (d * p)) for d in (1, 2, 4, 8) for p in (1, 2, 4, 8) if 8 % (d * p) == 0]
# ZeRO stages; stage 3 once per `parallel.zero3_gather` placement.
ZEROS = ((0, None), (1, None), (2, None), (3, "microbatch"), (3, "step"))
# The options of a case: the mesh (d, p, t), the schedule (None: no pipeline, two microbatches of
# gradient accumulation), the ZeRO stage with its placement, the architecture.
OPTIONS = {"mesh": tuple(FACTORIZATIONS),
           "schedule": (None, "gpipe", "1f1b", "1f1b_one_action", "interleaved_1f1b", "zb_h1", "1f1b_lockstep"),
           "zero": ZEROS, "arch": ("llama", "gpt2")}


def runs(row):
    """A schedule exactly where the mesh has a pipeline."""
    return (row["schedule"] is None) == (row["mesh"][1] == 1)


def as_row(case):
    d, p, t, schedule, zero, gather, arch = case
    return {"mesh": (d, p, t), "schedule": schedule, "zero": (zero, gather), "arch": arch}


def as_case(row):
    return (*row["mesh"], row["schedule"], *row["zero"], row["arch"])


# The product of these options holds 400 valid cases. By default 12 of them run, covering every
# size of every axis (1, 2, 4, 8 of data, stage and model), every schedule, every ZeRO stage and
# both ZeRO-3 placements, both architectures, pipelining with each of data and model parallelism
# and with both, and gpt2 (whose biases are sharded on a dim that `model` also splits) with tensor
# parallelism under ZeRO-2/3. The slow tier adds the 45 that `pairwise` picks so that the 57
# together hold every pair of option values: every factorization with every schedule it can run
# and every ZeRO stage and placement, every schedule with every ZeRO stage and placement, each of
# them on both architectures. Before, it ran 188: the rest of every factorization x schedule x
# ZeRO, the architecture alternating.
DEFAULT = [
    (8, 1, 1, None, 3, "step", "gpt2"),
    (2, 1, 4, None, 2, None, "gpt2"),
    (4, 1, 2, None, 3, "microbatch", "gpt2"),
    (1, 1, 8, None, 0, None, "llama"),
    (4, 2, 1, "1f1b", 3, "microbatch", "gpt2"),
    (2, 2, 2, "interleaved_1f1b", 3, "step", "gpt2"),
    (2, 4, 1, "gpipe", 2, None, "llama"),
    (1, 4, 2, "1f1b_one_action", 1, None, "llama"),
    (1, 8, 1, "1f1b", 0, None, "llama"),
    (2, 2, 2, "zb_h1", 3, "microbatch", "gpt2"),
    (4, 2, 1, "zb_h1", 2, None, "llama"),
    (2, 4, 1, "1f1b_lockstep", 1, None, "llama"),
]
SLOW = [as_case(r) for r in pairwise(OPTIONS, must=[as_row(c) for c in DEFAULT], valid=runs)[len(DEFAULT):]]
FULL = DEFAULT + SLOW


def composed(d, p, t, schedule, zero, gather, arch):
    """The tiny model on mesh (d, p, t): 8 heads (t up to 8; llama's 2 kv heads are replicated for
    t > 2), 8 layers (16 for interleaving over 8 stages), m = p microbatches (2 without a
    pipeline), 16 sequences per step; zero_min_elements = 0 so that ZeRO shards every leaf it can."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    return from_dict({
        "model": {"arch": arch, "n_layers": max(8, p * v), "d_model": 32, "n_heads": 8,
                  "n_kv_heads": 2 if arch == "llama" else None, "d_ff": 64, "vocab_size": 64, "seq_len": 16},
        "mesh": {"data": d, "stage": p, "model": t},
        "parallel": {"schedule": schedule or "1f1b", "microbatches": p if p > 1 else 2, "virtual_stages": v,
                     "zero": zero, "zero3_gather": gather or "microbatch", "zero_min_elements": 0},
        "train": {"steps": 3, "global_batch": 16, "lr": 1e-2, "warmup_steps": 1},
    })


_REF = {}


def reference(cfg):
    key = (cfg.model.arch, cfg.model.n_layers, cfg.model.tied, cfg.model.rope_scaling, cfg.model.qkv_bias,
           cfg.model.qk_norm, cfg.model.head_dim)
    if key not in _REF:
        _REF[key] = run_reference(cfg.replace(parallel={"virtual_stages": 1}))
    return _REF[key]


def check_parity(cfg):
    assert_parity(run_steps(cfg), reference(cfg))


def case_id(c):
    d, p, t, schedule, zero, gather, arch = c
    return f"{d}x{p}x{t}-{schedule or 'accum'}-zero{zero}{'-' + gather if gather else ''}-{arch}"


@pytest.mark.parametrize("case", DEFAULT, ids=case_id)
def test_composition_matches_single_device(case):
    check_parity(composed(*case))


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=case_id)
def test_composition_matches_single_device_pairwise(case):
    check_parity(composed(*case))


# The llama-architecture options of the Hugging Face families, each on meshes that split what it
# adds: a tied head (Llama 3.2: the first stage's lookup plus the last stage's head, vocab-parallel
# under TP) with Llama 3.1's RoPE scaling; q, k, v biases (Qwen 2: split over `model` with their
# heads, replicated with kv heads for t > 2); q and k norms with head_dim 8 != d_model / n_heads = 4
# (Qwen 3: the norm scales shared by the heads of every model rank). (4, 1, 2) adds sequence
# parallelism.
FAMILY_OPTIONS = {
    "tied-llama3": {"tie_embeddings": True, "rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_context": 32},
    "qkv-bias": {"qkv_bias": True},
    "qk-norm-head-dim": {"qk_norm": True, "head_dim": 8},
}
FAMILY_CASES = [(o, mesh, s, z) for o in FAMILY_OPTIONS
                for mesh, s, z in (((2, 2, 2), "1f1b", 3), ((1, 4, 2), "zb_h1", 2), ((4, 1, 2), None, 1))]


@pytest.mark.parametrize("options, mesh, schedule, zero", FAMILY_CASES,
                         ids=[f"{o}-{'x'.join(map(str, m))}-{s or 'accum-sp'}-zero{z}" for o, m, s, z in FAMILY_CASES])
def test_llama_family_options_compose(options, mesh, schedule, zero):
    """Each option computes the single-device function under pipelining, TP and ZeRO. (Against
    transformers: test_hf.py.)"""
    cfg = composed(*mesh, schedule, zero, "microbatch" if zero == 3 else None, "llama").replace(
        model=FAMILY_OPTIONS[options], parallel={"sequence_parallel": schedule is None})  # SP on (4, 1, 2)
    shapes = model.param_shapes(cfg.model)
    assert ("lm_head" in shapes) != cfg.model.tied and ("bq" in shapes["blocks"]["attn"]) == cfg.model.qkv_bias
    check_parity(cfg)


def test_the_matrix_covers_every_factorization_schedule_and_zero_stage():
    assert len(FACTORIZATIONS) == 10 and all(d * p * t == 8 for d, p, t in FACTORIZATIONS)
    rows = [as_row(c) for c in FULL]
    assert all(runs(r) for r in rows) and len(set(FULL)) == len(FULL)

    def met(a, b):
        return {(r[a], r[b]) for r in rows}

    pipelined = [s for s in OPTIONS["schedule"] if s]
    assert met("mesh", "schedule") == {(m, s) for m in FACTORIZATIONS for s in (pipelined if m[1] > 1 else [None])}
    assert met("mesh", "zero") == {(m, z) for m in FACTORIZATIONS for z in ZEROS}
    assert met("schedule", "zero") == {(s, z) for s in OPTIONS["schedule"] for z in ZEROS}
    for a in ("mesh", "schedule", "zero"):
        assert met(a, "arch") == {(v, arch) for v in OPTIONS[a] for arch in OPTIONS["arch"]}, a
    for i in range(7):  # and the default cases reach every value of every dimension
        assert {c[i] for c in DEFAULT} == {c[i] for c in FULL}, i


# ---------------------------------------------------------------------------------------------
# Where ZeRO-2/3 reduce and gather under pipelining and accumulation, read from the compiled step.
# A model whose sharded leaves dominate (d_model 256; norm scales stay replicated by the default
# zero_min_elements): d = 4, p = 2 (two layers per stage), t = 1, m = 4 microbatches.

D, M = 4, 4


def medium(zero, gather="microbatch", stage=2, reduce="microbatch"):
    return from_dict({
        "model": {"arch": "llama", "n_layers": 4, "d_model": 256, "n_heads": 4, "d_ff": 512, "vocab_size": 256,
                  "seq_len": 16},
        "mesh": {"data": D, "stage": stage, "model": 8 // (D * stage)},
        "parallel": {"zero": zero, "microbatches": M, "zero3_gather": gather, "zero2_reduce": reduce,
                     "schedule": "1f1b"},
        "train": {"global_batch": 2 * D * M},
    })


_COMPILED = {}


def report_of(cfg):
    key = (cfg.parallel.zero, cfg.parallel.zero3_gather, cfg.mesh.stage)
    if key not in _COMPILED:
        compiled, mesh = lower_step(cfg)
        _COMPILED[key] = analyze(compiled, mesh)
    return _COMPILED[key]


def gathered_leaves(cfg, stored=False):
    """Per-device bytes, once gathered over `data`, of each leaf that ZeRO shards (blocks: this
    stage's layers; the embedding and head: whole, or with `stored` as stored, 1/p where they are
    sharded over `stage` too), split into (blocks, shared)."""
    program = build(cfg)
    mesh, layout = program.mesh, program.layout
    shapes = model.param_shapes(cfg.model)

    def gathered(spec, s, dim, sdim):
        if dim is None:
            return None
        # (A shared leaf stored over `stage` too is gathered over `stage` first, before the loop.)
        skip = ("data", "stage") if sdim is not None and not stored else ("data",)
        split = math.prod(mesh.shape[a] for ax in spec if ax for a in ((ax,) if isinstance(ax, str) else ax)
                          if a not in skip)
        return s.size * s.dtype.itemsize // split

    per_leaf = jax.tree.map(gathered, layout.params, shapes, layout.zero_dims, layout.stage_dims,
                            is_leaf=lambda x: isinstance(x, P))
    blocks = [b for b in jax.tree.leaves(per_leaf["blocks"]) if b is not None]
    shared = [b for k, v in per_leaf.items() if k != "blocks" for b in jax.tree.leaves(v) if b is not None]
    return blocks, shared


def test_zero2_pipeline_reduce_scatters_once_after_the_tick_loop():
    cfg = medium(2, reduce="step")
    r = report_of(cfg)
    assert not r.select(spans="data", in_loop=True), r.table()
    blocks, shared = gathered_leaves(cfg)
    scatters = r.select(kind="reduce-scatter", spans="data")
    assert all(c.executions == 1 for c in scatters)
    assert sum(c.traffic for c in scatters) == sum(blocks + shared) // D  # each gradient once, 1/d kept
    # The updated parameters are all-gathered once to their storage (ZeRO-2 keeps them whole over
    # `data`; the embedding and head are stored 1/p over `stage`).
    assert r.traffic(kind="all-gather", spans="data") == sum(sum(x) for x in gathered_leaves(cfg, stored=True))


def test_zero3_step_gathers_every_leaf_once_per_step():
    cfg = medium(3, "step")
    r = report_of(cfg)
    assert not r.select(spans="data", in_loop=True), r.table()
    blocks, shared = gathered_leaves(cfg)
    gathers = r.select(kind="all-gather", spans="data")
    # One all-gather per sharded leaf (7 block leaves, embedding, head), each run once per step.
    assert sorted(c.bytes for c in gathers) == sorted(blocks + shared)
    assert all(c.executions == 1 for c in gathers)
    scatters = r.select(kind="reduce-scatter", spans="data")
    assert sum(c.traffic for c in scatters) == sum(blocks + shared) // D and all(c.executions == 1 for c in scatters)


def test_zero3_microbatch_gathers_every_layer_in_every_forward_and_backward():
    cfg = medium(3, "microbatch")
    r = report_of(cfg)
    ticks = build_schedule("1f1b", 2, M).num_ticks()
    per_stage = cfg.model.n_layers // cfg.mesh.stage
    blocks, shared = gathered_leaves(cfg)
    gathers = r.select(kind="all-gather", spans="data")
    assert gathers and all(c.in_loop for c in gathers), r.table()
    # Block leaves inside the layer scan of every tick, the embedding and head once per tick.
    assert {c.executions for c in gathers} == {ticks * per_stage, ticks}
    layer = [c for c in gathers if c.executions == ticks * per_stage]
    # Each layer's leaves gathered in F (forward) and again in I's backward (rematerialized: the
    # remat policy never saves gathered parameters); B no longer recomputes the forward, and W
    # needs no weights (x^T g).
    forward = [c for c in layer if "transpose(" not in c.op_name]
    regathered = [c for c in layer if "transpose(" in c.op_name and "rematted" in c.op_name]
    assert sorted(c.bytes for c in forward) == sorted(b // per_stage for b in blocks)
    assert sorted(c.bytes for c in regathered) == sorted(b // per_stage for b in blocks)
    assert len(layer) == 2 * len(blocks)
    # Gradients reduce-scattered per microbatch: the weight matmuls' by W (one per leaf, over the
    # chunk's stacked layers), the other leaves' where their gathers are transposed.
    scatters = r.select(kind="reduce-scatter", spans="data")
    assert all(c.in_loop for c in scatters)
    assert sum(c.executions * c.bytes for c in scatters if "transpose(" not in c.op_name) == ticks * sum(blocks) // D


def test_zero3_gather_placement_trades_memory_for_traffic():
    """step holds this stage's gathered parameters for the step (temp grows by exactly its gathered
    blocks over ZeRO-2, whose blocks are arguments; both hold the embedding and head gathered,
    ZeRO-2 over `stage` alone, ZeRO-3 over `stage` and `data`) and a full float32 accumulator;
    microbatch holds shards of both, for more data-axis traffic."""
    step, micro, zero2 = report_of(medium(3, "step")), report_of(medium(3, "microbatch")), report_of(medium(2, reduce="step"))
    blocks, shared = gathered_leaves(medium(3))
    full = sum(blocks + shared)
    # 1%: XLA's buffer assignment may round or share a small buffer differently (measured exact
    # to 64 bytes of 5.5 MiB).
    assert abs((step.memory.temp_bytes - zero2.memory.temp_bytes) - sum(blocks)) <= 0.01 * full
    # Gathered parameters and the float32 accumulator, (1 - 1/d) of each, at least.
    assert step.memory.temp_bytes - micro.memory.temp_bytes >= 2 * (1 - 1 / D) * full
    assert micro.traffic(spans="data") > 3 * step.traffic(spans="data")


@pytest.mark.parametrize("gather", ["step", "microbatch"])
def test_zero3_accumulation_gathers_per_step_or_per_microbatch(gather):
    """Without a pipeline (stage 1, data 4, model 2) and m = 4 accumulated microbatches."""
    cfg = medium(3, gather, stage=1)
    r = report_of(cfg)
    blocks, shared = gathered_leaves(cfg)
    gathers = r.select(kind="all-gather", spans="data")
    if gather == "step":  # one gather per sharded leaf before the loop, one reduce-scatter after it
        assert sorted(c.bytes for c in gathers) == sorted(blocks + shared)
        assert all(c.executions == 1 for c in gathers)
        assert not r.select(spans="data", in_loop=True), r.table()
    else:
        # Every layer's leaves gathered in the forward and again in the backward of every
        # microbatch, inside the layer scans (of the microbatch loop, and of the first microbatch,
        # peeled off the loop to start the accumulator).
        layers = [c for c in gathers if c.in_loop]
        assert sum(c.traffic for c in layers) == 2 * M * sum(blocks), r.table()
    # The step mode's cost: the gathered parameters and a full float32 accumulator, held for the
    # step, instead of one layer's gathered parameters and a sharded accumulator.
    if gather == "step":
        micro = report_of(medium(3, "microbatch", stage=1))
        assert r.memory.temp_bytes - micro.memory.temp_bytes >= 2 * (1 - 1 / D) * sum(blocks + shared)


STRESS = """
import os, sys
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           "--xla_cpu_collective_call_terminate_timeout_seconds=60")  # a hang aborts
sys.path.insert(0, {tests!r})
from jaxpar.mesh import use_cpu_devices
use_cpu_devices(8)
import jax
from test_composition import composed
from jaxpar.train.data import batch_at, make_source
from jaxpar.train.step import build
cfg = composed(2, 2, 2, "interleaved_1f1b", 0, None, "gpt2")
program = build(cfg)
state = program.init(jax.random.key(0))
batch = batch_at(make_source(cfg), 0, cfg.train.global_batch, program.batch_sharding)
for _ in range({steps}):
    state, metrics = program.step(state, batch)
    jax.block_until_ready(metrics)
print("done")
"""


@pytest.mark.slow
def test_interleaved_tensor_parallel_steps_never_hang_on_simulated_devices():
    # With one thread per simulated device, XLA:CPU's pool ran out (a tick's stage hop and an
    # all-reduce of the other action run side by side) and this program hung within 300 steps,
    # idle or loaded; use_cpu_devices sizes the pool (jaxpar/mesh.py). A hang aborts after 60 s.
    env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}  # what use_cpu_devices sets itself
    script = STRESS.format(tests=os.path.dirname(__file__), steps=300)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-2000:]
