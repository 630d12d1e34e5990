"""ZeRO at DeepSpeed's cost, read from the compiled step: ZeRO-1 moves DDP's bytes, ZeRO-2 never
holds the full gradient, ZeRO-3 gathers in the compute dtype, no weight cast is saved for the
backward pass, and gradient accumulation runs every microbatch inside its loop. Parity of the
new reduction paths with one device (losses, gradients, parameters)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import max_abs_diff, run_reference, run_steps
from jaxpar import inspect as jinspect
from jaxpar import model
from jaxpar.mesh import make_mesh
from jaxpar.train.step import build

D = 8


def small(tiny, zero, *, data=D, m=1, dtype="float32", **parallel):
    # d_model 64 and zero_min_elements 256: every matrix is sharded over data = 8.
    return tiny("llama", model={"d_model": 64, "d_ff": 128, "dtype": dtype},
                train={"global_batch": 16},
                mesh={"data": data},
                parallel={"zero": zero, "microbatches": m, "zero_min_elements": 256, **parallel})


def compiled(cfg):
    mesh = make_mesh(cfg, jax.devices()[:cfg.mesh.data * cfg.mesh.stage * cfg.mesh.model])
    program = build(cfg, mesh)
    lowered = program.step.lower(program.abstract_state(), program.abstract_batch())
    return lowered, lowered.compile(), mesh


def wire(report, n=D) -> float:
    """Ring wire bytes per device per step over `data`: all-reduce 2B(n-1)/n, all-gather and
    reduce-scatter B(n-1)/n of the full size B (a reduce-scatter's result is B/n)."""
    total = 0.0
    for c in report.select(spans="data"):
        full = {"all-reduce": 2 * c.bytes, "all-gather": c.bytes, "reduce-scatter": c.bytes * n}.get(c.kind, 0)
        total += full * (n - 1) / n * c.executions
    return total


def grad_bytes(cfg) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.param_shapes(cfg.model)))


def test_zero_1_moves_what_ddp_moves(tiny):
    reports = {z: jinspect.analyze(*compiled(small(tiny, z))[1:]) for z in (0, 1)}
    w0, w1 = wire(reports[0]), wire(reports[1])
    assert abs(w1 - w0) <= 0.05 * w0, (w0, w1)  # the issue's target: within 5% (it was 1.5x)
    assert reports[1].traffic(kind="reduce-scatter", spans="data") > 0
    # What ZeRO-1 all-reduces is only what it cannot shard (norm scales) and scalars.
    assert reports[1].traffic(kind="all-reduce", spans="data") < 0.05 * reports[0].traffic(kind="all-reduce",
                                                                                           spans="data")


@pytest.mark.parametrize("m", [1, 2])
def test_zero_2_never_holds_the_full_gradient(tiny, m):
    """Against the program that holds the full gradient before reducing it (ZeRO-0 at one
    microbatch, ZeRO-2 with zero2_reduce = step with microbatches): ZeRO-2's temp bytes are at
    least half of (1 - 1/d) x the gradient bytes lower."""
    full = small(tiny, 0) if m == 1 else small(tiny, 2, m=m, zero2_reduce="step")
    temp_full = compiled(full)[1].memory_analysis().temp_size_in_bytes
    temp_2 = compiled(small(tiny, 2, m=m))[1].memory_analysis().temp_size_in_bytes
    saved = temp_full - temp_2
    assert saved >= 0.5 * (1 - 1 / D) * grad_bytes(full), (temp_full, temp_2, grad_bytes(full))


def test_zero_2_reduces_per_microbatch_or_once(tiny):
    per_mb = jinspect.analyze(*compiled(small(tiny, 2, m=2))[1:])
    once = jinspect.analyze(*compiled(small(tiny, 2, m=2, zero2_reduce="step"))[1:])
    rs = lambda r: r.traffic(kind="reduce-scatter", spans="data")  # noqa: E731
    assert rs(per_mb) == 2 * rs(once)  # m reduce-scatters of every sharded gradient, against one


def test_zero_3_gathers_in_the_compute_dtype(tiny, monkeypatch):
    # The issue's model (llama, 4 layers, d_model 256): on the tiny one XLA:CPU's bf16 upcasts
    # (below) cost more temporaries than the gathers save.
    def issue_model(dtype):
        return tiny("llama", model={"n_layers": 4, "d_model": 256, "n_heads": 4, "n_kv_heads": 4, "d_ff": 1024,
                                    "vocab_size": 256, "seq_len": 64, "dtype": dtype},
                    train={"global_batch": 16}, mesh={"data": D}, parallel={"zero": 3})
    # Like with like: in float32 XLA:CPU also gets `linear`'s weight-gradient layout (0.65 MiB
    # fewer temporaries here), which its emulated bf16 cannot use; the goal compares the dtypes.
    from jaxpar.model import layers
    monkeypatch.setattr(layers, "CPU_WEIGHT_GRADIENT_LAYOUT", False)
    f32_low, f32, mesh = compiled(issue_model("float32"))
    bf16_low, bf16, _ = compiled(issue_model("bfloat16"))
    assert bf16.memory_analysis().temp_size_in_bytes <= f32.memory_analysis().temp_size_in_bytes

    def gathered(lowered) -> dict[str, int]:
        # The program as jaxpar writes it (StableHLO): result bytes of all-gathers, by dtype.
        # XLA:CPU then upcasts bf16 collectives to float32 (it has no bf16 reductions), so the
        # compiled CPU program cannot show the saving; a GPU moves the bf16 bytes.
        out: dict[str, int] = {}
        for shape, dt in re.findall(r'"stablehlo.all_gather".*?-> tensor<([\dx]+)x(\w+)>', lowered.as_text()):
            n = int(np.prod([int(s) for s in shape.split("x")]))
            out[dt] = out.get(dt, 0) + n * {"f32": 4, "bf16": 2}[dt]
        return out

    f, b = gathered(f32_low), gathered(bf16_low)
    assert set(f) == {"f32"} and b.get("bf16", 0) > 0
    assert b["bf16"] + b.get("f32", 0) <= 0.55 * f["f32"]  # half, but for the small leaves gathered as stored
    # Gradients are reduce-scattered in float32 whatever the compute dtype.
    # (a reduce_scatter's result type follows its reduction region, lines below the op)
    scattered = re.findall(r'"stablehlo.reduce_scatter".*?\}\) : \(tensor<[^>]*>\) -> tensor<[\dx]+x(\w+)>',
                           bf16_low.as_text(), re.S)
    assert scattered and set(scattered) == {"f32"}, scattered


def test_no_weight_cast_is_saved_for_the_backward_pass(tiny):
    from jax._src.ad_checkpoint import saved_residuals  # no public spelling in jax 0.10

    from jaxpar.sharding import LOGICAL_NAMES, Rules, activation_rules
    from jaxpar.train.step import loss_fn

    cfg = small(tiny, 0, data=1, dtype="bfloat16")
    params = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
    weight_shapes = {tuple(x.shape) for x in jax.tree.leaves(params["blocks"])}
    mesh = make_mesh(cfg, jax.devices()[:1])
    batch = jnp.zeros((2, cfg.model.seq_len + 1), jnp.int32)

    def loss(p):
        with activation_rules(mesh, Rules({n: None for n in LOGICAL_NAMES}), compute_dtype=cfg.model.dtype):
            return loss_fn(cfg, p, batch)

    saved = [a for a, why in saved_residuals(loss, params) if not str(why).startswith("from the argument")]
    casts = [a for a in saved if a.dtype == jnp.bfloat16 and tuple(a.shape) in weight_shapes]
    assert not casts, casts


def test_accumulation_runs_every_microbatch_inside_the_loop(tiny):
    # 4 microbatches, 2 layers: the microbatch loop runs 4 times (not 1 + a loop of 3).
    text = compiled(small(tiny, 0, data=2, m=4))[1].as_text()
    trips = set(re.findall(r'known_trip_count[^0-9]*(\d+)', text))
    assert "4" in trips and "3" not in trips, trips


_REF = {}


@pytest.mark.parametrize("mesh,parallel", [
    ((2, 1, 1), {"zero": 2, "microbatches": 4}),
    ((2, 1, 1), {"zero": 2, "microbatches": 4, "zero2_reduce": "step"}),
    ((2, 1, 1), {"zero": 1, "microbatches": 4}),
    ((8, 1, 1), {"zero": 1}),
    ((2, 2, 1), {"zero": 2, "microbatches": 4}),
    ((2, 2, 2), {"zero": 1, "microbatches": 2}),
])
def test_new_reduction_paths_match_one_device(tiny, mesh, parallel):
    cfg = tiny("llama", model={"n_layers": 4}, mesh=dict(zip(("data", "stage", "model"), mesh)),
               train={"steps": 2}, parallel={"zero_min_elements": 256, **parallel})
    if "ref" not in _REF:
        _REF["ref"] = run_reference(cfg)
    ref, out = _REF["ref"], run_steps(cfg)
    # float32 sums in another order: losses ~1e-7 apart, gradients of size 1e-3..1 to 1e-6.
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-5)
    assert max_abs_diff(out["grads"], ref["grads"]) < 1e-6
    assert max_abs_diff(out["params"], ref["params"]) < 1e-5


def _unordered_collectives(hlo: str) -> list[tuple[str, str]]:
    """Pairs of collectives of one kind in one computation of optimized HLO text with no data path
    between them: XLA:CPU's runtime may run such a pair side by side on a device."""
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
    pairs, ops = [], {}
    for line in hlo.splitlines() + ["}"]:
        if line.startswith("}"):  # the end of a computation
            deps = {n: set(re.findall(r"%[\w.\-]+", rest)) & set(ops) for n, (_, rest) in ops.items()}
            seen: dict[str, set] = {}

            def above(n):
                if n not in seen:
                    seen[n] = set()
                    seen[n] = set().union(*(({d} | above(d)) for d in deps[n]))
                return seen[n]
            coll = [n for n, (op, _) in ops.items() if op in kinds]
            pairs += [(a, b) for i, a in enumerate(coll) for b in coll[i + 1:]
                      if ops[a][0] == ops[b][0] and a not in above(b) and b not in above(a)]
            ops = {}
            continue
        m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = .*? ([a-z\-]+)\((.*?)\)(?:, |$)", line)
        if m:
            ops[m.group(1)] = (m.group(2), m.group(3))
    return pairs


def test_simulated_devices_run_zero3_gathers_one_at_a_time(tiny):
    """On simulated CPU devices every ZeRO-3 gather of a layer (and of the embedding and head)
    depends on the one before it, and so does every reduce-scatter of their gradients
    (`sharding._after`): XLA:CPU's runtime runs independent collectives side by side, and with
    JAX's one channel id two all-gathers over `data` in flight at once took each other's
    participants (an abort, `Check failed: id < num_threads`, training the planner's ZeRO-3 pick
    for configs/tiny_llama.yaml). ZeRO-1/2's gathers of the updated parameters, which GSPMD
    places, are not chained (DESIGN.md §9)."""
    from jaxpar import sharding

    cfg = small(tiny, 3)
    assert _unordered_collectives(compiled(cfg)[1].as_text()) == []
    real = sharding._after  # without the chain the same check finds unordered pairs
    try:
        sharding._after = lambda x, prev, shape: x
        assert len(_unordered_collectives(compiled(cfg)[1].as_text())) > 0
    finally:
        sharding._after = real
