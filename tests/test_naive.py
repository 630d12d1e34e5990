"""parallel.data_mode = naive (torch DataParallel's pattern): exact, funnelled through device 0 in the
compiled program, refused where it cannot apply, checkpointed in the canonical layout."""

import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxpar
from helpers import max_abs_diff, run_with_loss_and_grads_compiled
from jaxpar import model
from jaxpar.config import ConfigError, from_dict, validate
from jaxpar.inspect import _split_computations, analyze, compiled_device_traffic
from jaxpar.train import checkpoint as ckpt_lib
from jaxpar.train.step import lower_step

# float32 rounding only: the shards' gradients are added in another order than one device's
# batch reduction (test_parity.py's figures).
LOSS_RTOL = 1e-5
PARAM_ATOL = 5e-5
GRAD_ATOL = 1e-6  # gradients of size 1e-3..1; a missing or doubled shard is off by 1e-3 or more
NORM_RTOL = 1e-5  # the step's own gradient norm: a gradient scaled by d would be off by d


def tiny(mode="naive", data=8, microbatches=1, arch="llama", **parallel):
    return from_dict({
        "model": {"arch": arch, "n_layers": 2, "d_model": 32, "n_heads": 4,
                  "n_kv_heads": 2 if arch == "llama" else None, "d_ff": 64, "vocab_size": 64, "seq_len": 16},
        "mesh": {"data": data, "stage": 1, "model": 1},
        "parallel": {"data_mode": mode, "microbatches": microbatches, **parallel},
        "train": {"steps": 3, "global_batch": 32, "lr": 1e-2, "warmup_steps": 1},
    })


def run(cfg) -> dict:
    return run_with_loss_and_grads_compiled(cfg)  # LLVM optimizations off: the same programs, compiled faster


_REF = {}


def reference(arch="llama"):
    if arch not in _REF:
        _REF[arch] = run(tiny("ddp", data=1, arch=arch))
    return _REF[arch]


@pytest.mark.parametrize("data,microbatches,arch", [(8, 1, "llama"), (2, 4, "llama"), (8, 2, "gpt2"), (1, 1, "llama")])
def test_naive_matches_single_device(data, microbatches, arch):
    ref, out = reference(arch), run(tiny("naive", data, microbatches, arch))
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(out["grad_norms"], ref["grad_norms"], rtol=NORM_RTOL)
    for (path, g), want in zip(jax.tree_util.tree_flatten_with_path(out["grads"])[0], jax.tree.leaves(ref["grads"])):
        assert np.max(np.abs(g - want)) < GRAD_ATOL, jax.tree_util.keystr(path)
    assert max_abs_diff(out["params"], ref["params"]) < PARAM_ATOL
    # Device 0's optimizer slot is the real state (Adam's step count = steps taken); the others never move.
    counts = [x for x in jax.tree.leaves(out["state"].opt_state) if x.ndim == 1]
    assert counts and all(np.asarray(c)[0] == 3 and not np.asarray(c)[1:].any() for c in counts)
    moments = [np.asarray(x) for x in jax.tree.leaves(out["state"].opt_state) if x.ndim > 1]
    assert all(not x[1:].any() and x[0].any() for x in moments)


# ---------------------------------------------------------------------------------------------
# Structure of the compiled step.


def medium(mode="naive"):
    return from_dict({
        "model": {"arch": "llama", "n_layers": 2, "d_model": 256, "n_heads": 4, "d_ff": 512, "vocab_size": 256,
                  "seq_len": 16},
        "mesh": {"data": 8}, "parallel": {"data_mode": mode}, "train": {"global_batch": 32},
    })


@pytest.fixture(scope="module")
def compiled_naive():
    compiled, mesh = lower_step(medium())
    return compiled, mesh, analyze(compiled, mesh)


def test_gradients_funnel_into_device_0_and_parameters_fan_out_from_it(compiled_naive):
    compiled, mesh, r = compiled_naive
    d = 8
    # No collective over `data` but permutes: no all-reduce of gradients (DDP), no gather or scatter (ZeRO).
    assert {c.kind for c in r.select(spans="data")} == {"collective-permute"}, r.table()
    assert not r.select(spans="data", in_loop=True)
    psi4 = sum(s.size * 4 for s in jax.tree.leaves(model.param_shapes(medium().model)))
    sent, received = (x.ravel() for x in compiled_device_traffic(compiled, mesh))
    # Reduce to the root: each other rank sends its gradient and partial loss (4 bytes) to device 0,
    # once; device 0 receives d - 1 of them. Broadcast: device 0 sends the new parameters with the
    # loss and the gradient norm (2 x 4 bytes; each rank applies train.on_nan to them) to each other rank.
    assert received[0] == (d - 1) * (psi4 + 4)
    assert sent[0] == (d - 1) * (psi4 + 8)
    assert (sent[1:] == psi4 + 4).all() and (received[1:] == psi4 + 8).all()
    # DDP for contrast: every device moves the same ring all-reduce bytes, 2(d-1)/d of the gradients.
    ddp, ddp_mesh = lower_step(medium("ddp"))
    ddp_sent, _ = compiled_device_traffic(ddp, ddp_mesh)
    assert np.ptp(ddp_sent) == 0 and psi4 * 2 * (d - 1) / d <= ddp_sent.flat[0] <= psi4 * 2 * (d - 1) / d + 1024
    assert sent[0] > (d / 2 - 0.01) * ddp_sent.flat[0]  # device 0's load grows like d/2 times DDP's


def test_the_update_runs_on_device_0_only(compiled_naive):
    """AdamW sits in one branch of the one conditional on the rank: Adam's sqrt appears there and
    nowhere else in the program; the other branch does no arithmetic."""
    compiled, _, _ = compiled_naive
    comps, entry = _split_computations(compiled.as_text())
    calls = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")

    def reachable(comp, seen):  # a computation and everything it calls
        if comp in seen or comp not in comps:
            return seen
        seen.add(comp)
        for _, rest in comps[comp]:
            for callee in calls.findall(rest) + re.findall(r"%?([\w.\-]+)", "".join(
                    re.findall(r"branch_computations=\{([^}]*)\}", rest))):
                reachable(callee, seen)
        return seen

    def count(comps_set, op):
        return sum(f" {op}(" in rest for c in comps_set for _, rest in comps[c])

    conds = [rest for c in reachable(entry, set()) for _, rest in comps[c] if " conditional(" in rest]
    assert len(conds) == 1, conds
    rest = conds[0]
    if "branch_computations" in rest:  # index form: branch 0 is the false (idle) branch
        idle, update = re.findall(r"%?([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", rest).group(1))
    else:
        update = re.search(r"true_computation=%?([\w.\-]+)", rest).group(1)
        idle = re.search(r"false_computation=%?([\w.\-]+)", rest).group(1)
    update_comps, idle_comps = reachable(update, set()), reachable(idle, set())
    leaves = len(jax.tree.leaves(model.param_shapes(medium().model)))
    assert count(update_comps, "sqrt") >= leaves  # one per Adam second moment (and the norms)
    assert count(idle_comps, "sqrt") == count(idle_comps, "multiply") == 0
    assert count(reachable(entry, set()), "sqrt") == count(update_comps, "sqrt")  # none outside the branch


# ---------------------------------------------------------------------------------------------
# Refusals, before compiling.


@pytest.mark.parametrize("key,value,section", [("zero", 1, "parallel"), ("stage", 2, "mesh"), ("model", 2, "mesh")])
def test_naive_refuses_zero_pipeline_and_tensor_parallelism(key, value, section):
    cfg = tiny()
    bad = cfg.replace(**{section: {key: value}})
    with pytest.raises(ConfigError) as e:
        validate(bad)
    msg = str(e.value)
    assert f"{section}.{key} = {value} cannot be combined with parallel.data_mode = naive" in msg
    assert f"set {section}.{key}=" in msg and "parallel.data_mode=ddp" in msg and msg.count(". ") == 0
    validate(bad.replace(parallel={"data_mode": "ddp"}))  # the same values are fine under DDP


def test_cli_refuses_naive_with_zero_in_one_line(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "jaxpar.train", "--set", "parallel.data_mode=naive",
                          "--set", "parallel.zero=1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: parallel.zero = 1 cannot be combined"), out.stderr
    assert "Traceback" not in out.stderr and not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# Checkpoints: the canonical layout, across modes.


def test_checkpoints_are_canonical_and_cross_between_naive_and_ddp(tmp_path):
    """A naive run saves DDP's layout (the optimizer state shaped like the parameters): DDP resumes
    from it, and naive resumes from DDP's, both continuing as the uninterrupted naive run does.
    One chain of runs: DDP resumes from naive's step 2 and saves step 4, naive resumes from that."""
    def cfg(mode, run_dir):
        return tiny(mode, data=8).replace(train={"steps": 6, "checkpoint_every": 2, "log_every": 1,
                                                 "run_dir": str(tmp_path / run_dir)})
    want = {r["step"]: r["loss"] for r in jaxpar.train(cfg("naive", "naive"))}
    meta = ckpt_lib.read_meta(str(tmp_path / "naive"), 2)
    assert meta["param_shapes"]["blocks.attn.wq"] == [2, 32, 4, 8]
    saved_by = "naive"
    for resumed_as, step in (("ddp", 2), ("naive", 4)):
        run_dir = tmp_path / f"{saved_by}_to_{resumed_as}"
        shutil.copytree(tmp_path / saved_by, run_dir)
        for later in [s for s in ckpt_lib.saved_steps(run_dir) if s > step]:
            shutil.rmtree(run_dir / "checkpoints" / str(later))
        history = jaxpar.train(cfg(resumed_as, run_dir.name))
        assert history.resumed_from == step
        got = {r["step"]: r["loss"] for r in history}
        # Exact but for float32 reduction order (two layouts): as the parity tests' bound.
        np.testing.assert_allclose([got[s] for s in range(step + 1, 7)], [want[s] for s in range(step + 1, 7)],
                                   rtol=LOSS_RTOL)
        if resumed_as == "ddp":
            assert meta["opt_structure"] == ckpt_lib.read_meta(str(run_dir), 4)["opt_structure"]
        saved_by = run_dir.name
