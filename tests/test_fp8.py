"""FP8 weight matmuls (`model.fp8`, `jaxpar.model.fp8`, docs/fp8.md): the quantization (clipped,
scaled by the whole tensor's amax), one matmul's value and gradients against a numpy emulation
with ml_dtypes' float8 types, the lowered step's form (every weight dot takes converts from float8
times their scales: the pattern XLA's GPU compiler rewrites into FP8 GEMMs), parity with one
device on several meshes (losses and gradients), and that the scales are the whole tensor's (a
per-shard amax breaks parity)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import parity_failures, run_reference, run_steps, single_device
from jaxpar.config import ConfigError, from_dict, validate
from jaxpar.model import fp8


def tiny(mesh=(1, 1, 1), model=None, **parallel):
    return from_dict({
        "model": {"arch": "llama", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
                  "vocab_size": 64, "seq_len": 16, "fp8": True, **(model or {})},
        "mesh": dict(zip(("data", "stage", "model"), mesh)),
        "parallel": {"zero_min_elements": 0, **parallel},
        "train": {"steps": 3, "global_batch": 8, "lr": 1e-2, "warmup_steps": 1}})


# ------------------------------------------------------------------ the quantization


def test_quantize_clips_and_scales_by_the_amax():
    x = jnp.array([500.0, -1e-3, 2.0, -448.0], jnp.float32)
    assert bool(jnp.isnan(x.astype(fp8.E4M3).astype(jnp.float32))[0])  # (why we clip: a plain cast is NaN)
    s = fp8.scale(x, fp8.E4M3)
    np.testing.assert_allclose(float(s), 500.0 / 448.0, rtol=1e-7)
    q = fp8.quantize(x, fp8.E4M3, s)
    assert bool(jnp.isfinite(q.astype(jnp.float32)).all())
    assert float(q[0].astype(jnp.float32)) == 448.0  # the amax lands on the format's largest value
    # Out of range (a scale older than the tensor): clipped, not NaN.
    assert float(fp8.quantize(x, fp8.E4M3, jnp.float32(1.0))[0].astype(jnp.float32)) == 448.0
    assert float(fp8.scale(jnp.zeros(3), fp8.E5M2)) == 1.0  # (an all-zero tensor: scale 1, no 0/0)


def _q(a: np.ndarray, fmt) -> tuple[np.ndarray, np.float32]:
    """numpy: (the dequantized float32 values, the scale) of a's current-scaling quantization."""
    top = float(ml_dtypes.finfo(fmt).max)
    s = np.float32(np.max(np.abs(a)) / np.float32(top))
    q = np.clip(a.astype(np.float32) / s, -top, top).astype(fmt)
    return q.astype(np.float32) * s, s


def test_one_matmul_and_its_gradients_against_an_emulation():
    """y = Q4(x) Q4(w); dx = Q5(g) Q4(w)ᵀ; dw = Q4(x)ᵀ Q5(g), with Q4 / Q5 the e4m3 / e5m2
    quantizations scaled by each tensor's amax, in float64 from the same float8 values. The
    products are float32 dots of at most 24 terms of representable values: observed <= 2e-7
    relative to the largest output; 1e-5 leaves float32 rounding room and fails on any value
    that is not the emulation's (a skipped quantization moves them by ~1e-2)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 24)).astype(np.float32)
    w = (rng.standard_normal((24, 3, 4)) * 0.1).astype(np.float32)
    g = (rng.standard_normal((2, 5, 3, 4)) * 1e-3).astype(np.float32)
    from jaxpar.model.layers import linear

    def f(x, w):
        with fp8.matmuls():
            return linear(x, w)

    y, pull = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = pull(jnp.asarray(g))
    xq, _ = _q(x, ml_dtypes.float8_e4m3fn)
    wq, _ = _q(w, ml_dtypes.float8_e4m3fn)
    gq, _ = _q(g, ml_dtypes.float8_e5m2)
    want_y = np.einsum("btc,cno->btno", xq.astype(np.float64), wq.astype(np.float64))
    want_dx = np.einsum("btno,cno->btc", gq.astype(np.float64), wq.astype(np.float64))
    want_dw = np.einsum("btc,btno->cno", xq.astype(np.float64), gq.astype(np.float64))
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max())
    # (FP8 moves them: the float32 product differs by far more than the tolerance.)
    assert np.abs(np.einsum("btc,cno->btno", x, w) - want_y).max() > 1e-3 * np.abs(want_y).max()


# ------------------------------------------------------------------ the lowered step


def _functions(text: str) -> list[list[str]]:
    """StableHLO: the lines of each function (SSA names are per function)."""
    out: list[list[str]] = []
    for line in text.splitlines():
        if line.lstrip().startswith("func.func"):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def _defs(lines: list[str]) -> dict[str, str]:
    """Each SSA value's defining line in one function."""
    return {m.group(1): line for line in lines if (m := re.match(r"\s*(%[\w#]+)(?::\d+)? = ", line))}


def _from_f8(defs: dict, name: str, fmt: str) -> bool:
    """Is `name` a multiply of a convert from float8 `fmt` (by a scale), possibly reshaped or
    transposed on the way (the dot's operand as the matmul's custom VJP hands it)?"""
    for _ in range(6):
        line = defs.get(name, "")
        if "stablehlo.multiply" in line:
            return any(f"x{fmt}>) ->" in defs.get(op, "") and "stablehlo.convert" in defs.get(op, "")
                       for op in re.findall(r"(%[\w#]+)", line.split("=", 1)[1]))
        ops = re.findall(r"(%[\w#]+)", line.split("=", 1)[1]) if "=" in line else []
        if not ops or not any(k in line for k in ("reshape", "transpose", "broadcast_in_dim", "convert")):
            return False
        name = ops[0]
    return False


def test_every_weight_dot_of_the_step_reads_float8_operands():
    """In the lowered train step (before XLA's passes: what XLA's GPU compiler pattern-matches),
    each of the 7 weight matmuls of the layer body (the scan over layers lowers it once) is a dot
    of two converts from e4m3 times their scales, and each of their 14 backward dots takes an
    e5m2 cotangent; the output head's and attention's own dots are not in float8."""
    from helpers import COMPILER_OPTIONS  # noqa: F401 (the suite's compile options: not needed to lower)
    from jaxpar.mesh import make_mesh
    from jaxpar.train.data import batch_at, make_source
    from jaxpar.train.step import build

    cfg = tiny()
    program = build(cfg, make_mesh(cfg, jax.devices()[:1]))
    key = jax.random.key(0)
    state = program.init(key)
    batch = batch_at(make_source(cfg), 0, 8, program.batch_sharding)
    forward = backward = n_dots = 0
    for lines in _functions(program.step.lower(state, batch).as_text()):
        defs = _defs(lines)
        for d in (line for line in lines if "stablehlo.dot_general" in line):
            ops = re.findall(r"(%[\w#]+)", d.split("dot_general", 1)[1])[:2]
            n_dots += 1
            forward += all(_from_f8(defs, o, "f8E4M3FN") for o in ops)
            backward += any(_from_f8(defs, o, "f8E5M2") for o in ops)
    dots = range(n_dots)
    assert forward == 7, (forward, backward, len(dots))
    assert backward == 7 * 2, (forward, backward, len(dots))
    assert forward + backward < len(dots)  # the head and attention's dots stay as they were


# ------------------------------------------------------------------ parity with one device

_REF: dict = {}

# From step 1 on, a mesh's parameters differ from one device's by the float32 rounding of the
# gradient reduction (an ulp: helpers.PARAM_ATOL's reasons), and an FP8 cast near a rounding
# boundary then moves by 2^-4 (e4m3) of that element, which AdamW's normalized update carries to
# a whole learning-rate step. So the mesh is compared with one device exactly where the
# parameters are the same, at step 0 (the loss, the gradient norm and every gradient, helpers'
# tolerances: the scales' independence of the layout), and by the losses of the later steps
# within FP8_DRIFT_RTOL: observed <= 8.4e-6 relative (data 2, ZeRO-2, step 2); a per-shard
# scale moves the step-0 gradients by > GRAD_ATOL (`test_the_scales_are_the_whole_tensors`).
FP8_DRIFT_RTOL = 1e-4


def fp8_parity_failures(out: dict, ref: dict) -> dict[str, str]:
    from helpers import LOSS_RTOL

    step0 = {k: (v[:1] if k in ("losses", "grad_norms", "moe", "mtp") else v) for k, v in out.items()}
    ref0 = {k: (v[:1] if k in ("losses", "grad_norms", "moe", "mtp") else v) for k, v in ref.items()}
    failed = {k: v for k, v in parity_failures(step0, ref0).items() if k != "params"}
    drift = np.max(np.abs(out["losses"] / ref["losses"] - 1))
    if not drift <= FP8_DRIFT_RTOL:
        failed["losses"] = f"relative diff {drift:.3g} > {FP8_DRIFT_RTOL}: {out['losses']} vs {ref['losses']}"
    assert LOSS_RTOL <= FP8_DRIFT_RTOL
    return failed


def assert_fp8_parity(out: dict, ref: dict) -> None:
    """`out` is the one-device run `ref`: exactly at step 0, within FP8_DRIFT_RTOL after."""
    failed = fp8_parity_failures(out, ref)
    assert not failed, "parity fails on " + "; ".join(f"{k}: {v}" for k, v in failed.items())


def reference(model=None, microbatches=1) -> dict:
    key = (tuple(sorted((model or {}).items())), microbatches)
    if key not in _REF:
        cfg = tiny(model=model, microbatches=microbatches)
        _REF[key] = (run_reference(cfg) if microbatches == 1 else
                     run_steps(single_device(cfg).replace(parallel={"zero": 0}), devices=jax.devices()[:1]))
    return _REF[key]


def test_fp8_trains_close_to_float32_but_not_equal():
    """The tiny model's first 3 losses with and without FP8: within 0.1% (observed 5e-5), and
    not equal (observed 4e-5 apart: FP8 is on)."""
    on, off = reference(), run_reference(tiny(model={"fp8": False}))
    rel = np.abs(on["losses"] / off["losses"] - 1)
    assert rel.max() < 1e-3 and rel.max() > 1e-6, rel


@pytest.mark.parametrize("mesh, parallel", [
    ((8, 1, 1), dict(zero=1)),
    ((4, 1, 2), dict(zero=3, sequence_parallel=True)),
], ids=["data8-zero1", "tp2-sp-zero3"])
def test_parity(mesh, parallel):
    assert_fp8_parity(run_steps(tiny(mesh, **parallel)), reference())


MOE = {"n_experts": 4, "experts_per_token": 2, "expert_d_ff": 16}

SLOW = {
    "data2-zero2": ((2, 1, 1), None, dict(zero=2), 1),
    "zb_h1-stage2": ((1, 2, 1), None, dict(zero=1, schedule="zb_h1", microbatches=2), 2),
    "moe-ep4": ((4, 1, 1), MOE, dict(zero=1), 1),
    "moe-ep2-tp2": ((2, 1, 2), MOE, dict(zero=1, sequence_parallel=True), 1),
    "1f1b-stage2-tp2": ((1, 2, 2), None, dict(zero=1, schedule="1f1b", microbatches=2), 2),
    "interleaved-stage2": ((1, 2, 1), {"n_layers": 4}, dict(zero=1, schedule="interleaved_1f1b", virtual_stages=2,
                                                             microbatches=2), 2),
    "tp4-sp": ((2, 1, 4), {"n_kv_heads": 4}, dict(zero=1, sequence_parallel=True), 1),
    "remat-dots": ((8, 1, 1), None, dict(zero=1, remat="dots"), 1),
    "remat-full-zero3": ((8, 1, 1), None, dict(zero=3, remat="full"), 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_parity_slow(name):
    mesh, model, parallel, m = SLOW[name]
    assert_fp8_parity(run_steps(tiny(mesh, model, **parallel)), reference(model, m))


def test_the_scales_are_the_whole_tensors(monkeypatch):
    """With each shard's own amax (no pmax over the axes that shard the tensor), data 8 is no
    longer the one-device run: the reduction is what makes the scales independent of the mesh."""
    ref = reference()
    monkeypatch.setattr(fp8, "amax", lambda x: jnp.max(jnp.abs(x)).astype(jnp.float32))
    failed = fp8_parity_failures(run_steps(tiny((8, 1, 1), zero=1)), ref)
    assert "grads" in failed, failed


def test_replicated_kv_heads_are_refused():
    with pytest.raises(ConfigError, match=r"model\.fp8 = true cannot run mesh\.model = 4 over model\.n_kv_heads = 2"
                                          r".*; set "):
        validate(tiny((2, 1, 4)))


# ------------------------------------------------------------------ the planner


def test_the_planner_runs_the_block_matmuls_at_the_fp8_rate():
    """`plan.steptime.compute_terms`: with model.fp8 the blocks' weight matmuls take the FP8
    peak (the FLOP part exactly 989/1979 of bf16's on an H100 with HBM taken out), the output head
    stays at bf16's; on an A100 (no FP8 tensor cores) nothing changes."""
    import dataclasses

    from jaxpar.hardware import HARDWARE
    from jaxpar.plan.steptime import MATMUL_EFFICIENCY, compute_terms

    keys = {"dtype": "bfloat16", "d_model": 256, "d_ff": 1024, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 1000,
            "seq_len": 128}
    on, off = tiny(model=keys), tiny(model={**keys, "fp8": False})
    h100 = dataclasses.replace(HARDWARE["h100-80gb"], hbm_bw=float("inf"))
    m = off.model
    M = off.train.global_batch * m.seq_len
    head = 3 * 2 * M * m.d_model * m.padded_vocab / (MATMUL_EFFICIENCY * h100.peak_flops)
    bf16, fp8_ = (compute_terms(c, (1, 1, 1), h100)["matmul"] for c in (off, on))
    np.testing.assert_allclose(fp8_ - head, (bf16 - head) * 989 / 1979, rtol=1e-12)
    a100 = HARDWARE["a100-80gb"]
    assert compute_terms(on, (1, 1, 1), a100)["matmul"] == compute_terms(off, (1, 1, 1), a100)["matmul"]


# ------------------------------------------------------------------ ZeRO-3's gathers


def _gathers(cfg) -> "Counter":
    """(shape, element type) -> count of the lowered train step's all-gathers."""
    from collections import Counter

    from jaxpar.train.step import build

    program = build(cfg)
    text = program.step.lower(program.abstract_state(), program.abstract_batch()).as_text()
    types = (re.search(r"-> tensor<([\dx]+)x(\w+)>", line) for line in text.splitlines() if "all_gather" in line)
    return Counter((tuple(int(n) for n in t.group(1).split("x")), t.group(2)) for t in types if t)


def test_zero3_step_gathers_the_fp8_weights_as_float8():
    """`parallel.zero3_gather: step` (every shard gathered once before the microbatch loop, in
    its stored float32): with model.fp8 each block matrix's gather moves float8 bytes instead
    (ui8, a quarter of float32's), the embedding, head and norms unchanged; and the step computes
    what gathering at use computes (the same FP8 values, a scale per layer of the stacks): step 0
    equal, later losses within FP8_DRIFT_RTOL."""
    def cfg(on: bool, gather: str = "step"):
        return tiny((8, 1, 1), model={"dtype": "bfloat16", "vocab_size": 96, "fp8": on}, zero=3, microbatches=2,
                    zero3_gather=gather).replace(train={"global_batch": 16})

    off, on = _gathers(cfg(False)), _gathers(cfg(True))
    V = tiny(model={"vocab_size": 96}).model.padded_vocab
    matrices = {(shape, d) for (shape, d) in off if d == "f32" and V not in shape and len(shape) >= 3}
    assert matrices, off  # (the stacked block matrices: [layers, ...] at least 3 dims)
    want = {(shape, "ui8" if (shape, d) in matrices else d): n for (shape, d), n in off.items()}
    assert on == want, (on, off)
    assert_fp8_parity(run_steps(cfg(True)), run_steps(cfg(True, "microbatch")))


@pytest.mark.slow
def test_zero3_step_gathers_in_fp8_under_a_pipeline():
    """(2, 2, 2) 1F1B with ZeRO-3 gathering once per step: FP8 gathers of each chunk's stacked
    layers with a scale per layer (one scale for the stack would quantize each weight twice, with
    two scales: measured, step 0 then differed) compute what gathering at use computes."""
    def cfg(gather: str):
        return tiny((2, 2, 2), model={"n_layers": 4, "vocab_size": 96}, zero=3, microbatches=2, zero3_gather=gather,
                    schedule="1f1b")

    assert_fp8_parity(run_steps(cfg("step")), run_steps(cfg("microbatch")))


def test_the_planner_gathers_the_fp8_weights_at_a_byte_each():
    """`jaxpar.plan.collectives`: ZeRO-3's all-gather over data (at use and once per step) moves
    the FP8 matmuls' weights at 1 byte per element, everything else as without FP8."""
    from jaxpar.plan.collectives import collectives
    from jaxpar.plan.memory import model_state

    for gather, m in (("microbatch", 1), ("step", 2)):
        on, off = (tiny((4, 1, 1), model={"fp8": f}, zero=3, zero3_gather=gather, microbatches=m) for f in (True, False))
        st = model_state(on, (4, 1, 1))
        assert st["fp8_blocks_sharded"] == st["fp8_sharded"] > 0
        uses = 2 if gather == "microbatch" else 1  # (at use: forward and backward, in each of m = 1
        # microbatch; once per step: once)

        def gathered(c):
            return sum(x.bytes * x.count for x in collectives(c, (4, 1, 1)) if x.kind == "all-gather")
        assert gathered(off) - gathered(on) == uses * st["fp8_sharded"] * 3 / 4  # float32 -> 1 byte


def test_zero3_gathers_the_fp8_weights_as_float8():
    """ZeRO-3 on data 8 in bf16: with model.fp8 every gather of a block matrix's shard moves
    float8 bytes (ui8: `fp8.gather`) where bf16 moved 2 bytes per element, at the same places
    (forward, and again in the backward pass), and nothing else changes (the embedding and head
    in bf16, the norms in float32): half of bf16's bytes for those gathers, read from the lowered
    step (what every backend compiles; XLA:CPU itself then runs bf16 collectives in float32)."""
    from collections import Counter

    from jaxpar.train.step import build

    def gathers(on: bool) -> Counter:
        cfg = tiny((8, 1, 1), model={"dtype": "bfloat16", "vocab_size": 96, "fp8": on}, zero=3)
        program = build(cfg)
        text = program.step.lower(program.abstract_state(), program.abstract_batch()).as_text()
        types = (re.search(r"-> tensor<([\dx]+)x(\w+)>", line) for line in text.splitlines() if "all_gather" in line)
        return Counter((tuple(int(n) for n in t.group(1).split("x")), t.group(2)) for t in types if t)

    off, on = gathers(False), gathers(True)
    V = tiny(model={"vocab_size": 96}).model.padded_vocab  # (the embedding's and head's vocabulary dim)
    # The bf16 gathers but the embedding's and the head's become ui8 of the same shape.
    want = Counter({(shape, "ui8" if dtype == "bf16" and V not in shape else dtype): n
                    for (shape, dtype), n in off.items()})
    assert on == want, (on, off)
    fp8_bytes = sum(math.prod(s) * n for (s, d), n in on.items() if d == "ui8")
    replaced = sum(2 * math.prod(s) * n for (s, d), n in off.items() if d == "bf16" and V not in s)
    assert fp8_bytes > 0 and fp8_bytes * 2 == replaced
