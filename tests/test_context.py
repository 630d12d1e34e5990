"""Context parallelism (`parallel.context`, `jaxpar.parallel.context`): the zigzag layout, the
balanced tile tables, parity with one device (loss each step and gradients: tests/helpers.py's
assert_parity) for c = 2, 4, 8 and both attention kinds, composed with TP + SP, ZeRO, gradient
accumulation and document masking, the work from the compiled step, and the refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_parity, run_reference, run_steps
from jaxpar.parallel import context

SEQ = 32  # c = 8: 16 chunks of 2 tokens


def test_zigzag_windows_give_each_rank_its_two_chunks():
    """Data rank g·c + j holds chunks j and 2c − 1 − j (with their next token, the last target) of
    its group's sequences; `loss_rows` puts them side by side in `positions`' order."""
    B, T, c, d = 4, 16, 2, 4  # 2 groups of 2 context ranks, 2 sequences per group
    batch = jnp.arange(B * (T + 1)).reshape(B, T + 1)
    w = np.asarray(context.windows(batch, c, d))
    L = T // (2 * c)
    assert w.shape == (B * 2 * c, L + 1)
    per_rank = w.reshape(d, -1, L + 1)  # the data axis's contiguous shards
    for rank in range(d):
        g, j = divmod(rank, c)
        inputs, targets = (np.asarray(a) for a in context.loss_rows(jnp.asarray(per_rank[rank])))
        for s in range(B * c // d):
            row = np.asarray(batch[g * (B * c // d) + s])
            pos = context.positions(c, L)[j]
            assert inputs[s].tolist() == row[pos].tolist() and targets[s].tolist() == row[pos + 1].tolist()
    assert context.positions(2, 2).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]


@pytest.mark.parametrize("c,m", [(2, 1), (4, 2), (8, 1), (3, 3)])
def test_every_rank_gets_the_same_tiles_and_together_the_causal_ones(c, m):
    """All-gather: each rank's (query tile, key tile) pairs are as many as any other's, and over the
    group they are the causal lower triangle of the 2cm tiles of the sequence, each tile pair once.
    Ring: step 0 the rank's own blocks, then 2m² pairs a step for every rank; in all, the same
    triangle."""
    n = 2 * c * m
    triangle = {(a, b) for a in range(n) for b in range(a + 1)}
    tile_of = context.positions(c, m)
    gathered = context.gather_pairs(c, m)
    keys = tile_of.reshape(-1)
    seen = [(int(tile_of[j, u]), int(keys[kt])) for j in range(c) for u, kt in gathered[j]]
    assert len(seen) == len(set(seen)) and set(seen) == triangle
    own, steps = context.ring_pairs(c, m)
    assert steps.shape[2] == 2 * m * m
    ring = [(int(tile_of[j, u]), int(tile_of[j, v])) for j in range(c) for u, v in own[j]]
    ring += [(int(tile_of[j, u]), int(tile_of[(j - s - 1) % c, v]))
             for j in range(c) for s in range(c - 1) for u, v in steps[j, s]]
    assert len(ring) == len(set(ring)) and set(ring) == triangle


_REFERENCES = {}


def _cfg(tiny, arch="llama", docs=False, **sections):
    base = dict(model={"seq_len": SEQ}, data={"document_mask": docs})
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return tiny(arch, **base)


def _reference(tiny, arch="llama", docs=False):
    if (arch, docs) not in _REFERENCES:
        _REFERENCES[arch, docs] = run_reference(_cfg(tiny, arch, docs))
    return _REFERENCES[arch, docs]


def _cp(c, kind, **parallel):
    return {"context": c, "context_attention": kind, "zero_min_elements": 0, **parallel}


CASES = {
    # (arch, document masking, mesh, parallel)
    "c2-all_gather": ("llama", False, {"data": 8}, _cp(2, "all_gather")),
    "c8-ring": ("llama", False, {"data": 8}, _cp(8, "ring")),
    "c2-ring-tp2-sp-zero3": ("llama", False, {"data": 4, "model": 2}, _cp(2, "ring", sequence_parallel=True, zero=3)),
    "c4-all_gather-zero1-m2-docs": ("llama", True, {"data": 8}, _cp(4, "all_gather", zero=1, microbatches=2)),
    "c2-all_gather-pp2-1f1b": ("llama", False, {"data": 4, "stage": 2}, _cp(2, "all_gather", microbatches=2)),
}
SLOW = {
    "c8-all_gather": ("llama", False, {"data": 8}, _cp(8, "all_gather")),
    "c2-all_gather-tp2-sp-zero1": ("llama", False, {"data": 4, "model": 2},
                                   _cp(2, "all_gather", sequence_parallel=True, zero=1)),
    "c4-ring-zero3-docs": ("llama", True, {"data": 8}, _cp(4, "ring", zero=3)),
    "c2-ring-tp2-sp-docs": ("llama", True, {"data": 4, "model": 2}, _cp(2, "ring", sequence_parallel=True)),
    "gpt2-c2-all_gather-zero2-docs": ("gpt2", True, {"data": 8}, _cp(2, "all_gather", zero=2)),
    "gpt2-c4-ring": ("gpt2", False, {"data": 8}, _cp(4, "ring")),
    "c4-all_gather-pp2-zb_h1-zero1-docs": ("llama", True, {"data": 4, "stage": 2},
                                           _cp(4, "all_gather", schedule="zb_h1", microbatches=2, zero=1)),
    "c2-all_gather-pp2-gpipe-tp2-sp": ("llama", False, {"data": 2, "stage": 2, "model": 2},
                                       _cp(2, "all_gather", schedule="gpipe", microbatches=2, sequence_parallel=True)),
}

MOE = dict(n_experts=8, experts_per_token=2, expert_d_ff=16, router_aux_loss=0.1, router_z_loss=0.01)


# (c, attention, capacity factor, TP 2 with SP and whole experts routing each model rank's shard)
EXPERT_CASES = [(2, "all_gather", None, False), (4, "ring", 0.5, False),
                pytest.param(4, "ring", None, False, marks=pytest.mark.slow),
                pytest.param(2, "all_gather", 0.5, True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("c,kind,capacity,tp", EXPERT_CASES)
def test_context_parallel_with_experts_matches_single_device(tiny, c, kind, capacity, tp):
    """An MoE model with its 8 experts over the 8 data ranks and each sequence over c of them:
    the router's load-balancing loss takes each sequence's loads from all its chunks (summed over
    the context group), so the losses, the gradients and the routers' report equal one device's.
    In capacity mode an expert's queue runs over the whole sequence as on one device, although a
    rank's two chunks come from its two ends: the same assignments are dropped (some are). With
    TP and SP and whole experts, a model rank routes its piece of its data rank's chunks."""
    model = {**MOE, "capacity_factor": capacity}
    key = ("moe", capacity)
    ref = _REFERENCES.get(key) or _REFERENCES.setdefault(key, run_reference(_cfg(tiny, model=model)))
    mesh, parallel = {"data": 8}, _cp(c, kind)
    if tp:
        mesh, parallel = {"data": 4, "model": 2}, {**parallel, "sequence_parallel": True, "expert_tensor_parallel": False}
    out = run_steps(_cfg(tiny, model=model, mesh=mesh, parallel=parallel))
    assert_parity(out, ref)
    assert out["moe"].shape[1] > 0
    if capacity is not None:
        assert np.all(ref["moe"][:, 1] > 0), ref["moe"]  # moe_dropped (the report's keys are sorted)


def _run(tiny, case):
    arch, docs, mesh, parallel = case
    assert_parity(run_steps(_cfg(tiny, arch, docs, mesh=mesh, parallel=parallel)), _reference(tiny, arch, docs))


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_matches_single_device(tiny, case):
    """Each sequence split over c of the 8 data ranks trains to the one-device losses and gradients:
    both attention kinds, c from 2 to 8, beside TP 2 with sequence parallelism and ZeRO-3, with
    ZeRO-1, 2 microbatches and document masking (documents cut by the zigzag's chunks), and in a
    2-stage 1F1B pipeline."""
    _run(tiny, CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW)
def test_context_parallel_matches_single_device_slow(tiny, case):
    """The rest of the matrix (with the default cases, each c of 2, 4, 8 meets both kinds): c 8
    all_gather, TP + SP with ZeRO-1, ring with ZeRO-3 and documents, gpt2's learned positions at the chunks' positions, ZB-H1 with ZeRO-1 and documents,
    GPipe beside TP 2 with sequence parallelism."""
    _run(tiny, SLOW[case])


def test_context_parallel_step_does_the_causal_work_split_evenly(tiny, monkeypatch):
    """From the compiled programs' matmul FLOPs (`jaxpar.inspect.dot_flops`, loops counted with
    their trips): one sequence of 512 tokens split over c = 8 data ranks does, per device, 1/8 of
    the work of the same step on one device whose attention runs the same 32-token tiles (the
    causal lower triangle of them): every rank its 1/8, no rank a masked tile (the zigzag's
    balance; the ranks run one program, so equal work is the tables' equal length, tested above)."""
    from jaxpar.inspect import dot_flops
    from jaxpar.mesh import make_mesh
    from jaxpar.model import tiled_attention
    from jaxpar.train.step import lower_step

    monkeypatch.setattr(tiled_attention, "BLOCK", 32)  # the one-device step's tile: the chunks' 32 tokens
    sections = dict(model={"seq_len": 512, "n_layers": 1}, train={"global_batch": 1})
    single = tiny("llama", **sections, mesh={"data": 1})
    one, _ = lower_step(single, make_mesh(single, jax.devices()[:1]))
    split, _ = lower_step(tiny("llama", **sections, mesh={"data": 8}, parallel={"context": 8}))
    (f1, k1), (f8, k8) = dot_flops(one.as_text()), dot_flops(split.as_text())
    assert k1 and k8
    assert f8 * 8 == pytest.approx(f1, rel=1e-3), (f8 * 8, f1)


@pytest.mark.parametrize("changes,match", [
    ({"parallel": {"context": 3}, "model": {"seq_len": 48}}, r"parallel.context = 3 does not divide mesh.data = 8"),
    ({"parallel": {"context": 4}, "model": {"seq_len": 12}}, r"model.seq_len = 12 is not divisible by 2 x parallel.context = 8"),
    ({"parallel": {"context": 2, "context_attention": "ring"}, "mesh": {"data": 4, "stage": 2}},
     r"parallel.context_attention = ring cannot be combined with mesh.stage = 2"),
    ({"parallel": {"context": 2}, "model": {"dtype": "bfloat16"}},
     r"all_gather with model.dtype = bfloat16 does not compile on XLA:CPU.*context_attention=ring"),
    ({"parallel": {"context": 2, "data_mode": "naive"}}, r"parallel.data_mode = naive cannot be combined"),
    ({"parallel": {"context": 2}, "train": {"global_batch": 2}}, r"train.global_batch = 2 is not divisible by mesh.data / parallel.context"),
])
def test_bad_context_settings_are_refused_before_compiling(tiny, changes, match):
    """Each in one sentence naming the value, the rule and a fix. (bfloat16 with all_gather: an
    XLA:CPU abort, refused on CPU only.)"""
    from jaxpar.config import ConfigError
    from jaxpar.train import build

    with pytest.raises(ConfigError, match=match):
        build(tiny("llama", mesh={"data": 8, **changes.pop("mesh", {})}, **changes))


def test_the_mesh_header_names_context_parallelism(tiny):
    """`python -m jaxpar.train` prints the mesh with context parallelism's groups on `data`."""
    from jaxpar.mesh import describe, make_mesh

    cfg = _cfg(tiny, mesh={"data": 8}, parallel=_cp(4, "ring"))
    mesh = make_mesh(cfg, jax.devices()[:8])
    assert ("  data     8  (data parallelism; context parallelism: groups of 4 ranks split each sequence, "
            "ring attention)") in describe(mesh, cfg).splitlines()
    assert "  data     8  (data parallelism)" in describe(mesh).splitlines()
