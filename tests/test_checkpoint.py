"""Checkpoints: exact resume, resume onto other meshes, damaged checkpoints, signals, NaN steps."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar.train import checkpoint as ckpt_lib
from jaxpar.train.checkpoint import CheckpointError, saved_steps
from jaxpar.train.loop import TrainingStopped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def losses(history) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in history}


def file_losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, request):
    """6 steps on (2, 2, 2) (ZeRO-1, 1F1B, sequence parallel), checkpoints at steps 3 and 6."""
    from jaxpar.config import from_dict

    run = tmp_path_factory.mktemp("straight")
    base = {"model": {"arch": "llama", "n_layers": 8, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
                      "vocab_size": 64, "seq_len": 16},
            "mesh": {"data": 2, "stage": 2, "model": 2},
            "parallel": {"zero": 1, "schedule": "1f1b", "microbatches": 2, "sequence_parallel": True},
            "train": {"steps": 6, "global_batch": 8, "lr": 1e-2, "warmup_steps": 1, "log_every": 1,
                      "checkpoint_every": 3, "run_dir": str(run)}}
    cfg = from_dict(base)
    history = jaxpar.train(cfg)
    return cfg, run, losses(history)


def resume_copy(src, dst, drop_after: int):
    """A copy of run `src` whose checkpoints after step `drop_after` are gone (as if it stopped there)."""
    shutil.copytree(src, dst)
    for s in saved_steps(dst):
        if s > drop_after:
            shutil.rmtree(os.path.join(dst, "checkpoints", str(s)))


def test_checkpoints_are_kept_and_canonical(straight):
    cfg, run, _ = straight
    assert saved_steps(run) == [3, 6]
    meta = ckpt_lib.read_meta(run, 6)
    assert meta["step"] == 6 and meta["mesh"] == {"data": 2, "stage": 2, "model": 2}
    # The canonical layout: blocks stacked [layers, ...] with all 8 layers, whatever the mesh.
    assert meta["param_shapes"]["blocks.attn.wq"] == [8, 32, 4, 8]


def test_resume_on_the_same_mesh_is_bit_exact(straight, tmp_path):
    cfg, run, want = straight
    resume_copy(run, tmp_path / "r", drop_after=3)
    history = jaxpar.train(cfg.replace(train={"run_dir": str(tmp_path / "r")}))
    assert history.resumed_from == 3
    got = losses(history)
    assert sorted(got) == [4, 5, 6]
    for step in got:  # same mesh, same program, same restored bits: identical floats
        assert got[step] == want[step], step
    # metrics.jsonl holds each step once: the records up to the checkpoint, then the resumed ones.
    assert file_losses(tmp_path / "r") == want


@pytest.mark.parametrize("mesh,parallel", [
    ((8, 1, 1), {"zero": 3, "microbatches": 1, "sequence_parallel": False}),
    ((1, 8, 1), {"zero": 0, "schedule": "gpipe", "microbatches": 8, "sequence_parallel": False}),
    ((1, 2, 4), {"zero": 0, "schedule": "1f1b_one_action", "microbatches": 4}),
], ids=["8x1x1-zero3", "1x8x1-gpipe", "1x2x4-1f1b_one_action"])
def test_resume_onto_another_mesh(straight, tmp_path, mesh, parallel):
    cfg, run, want = straight
    resume_copy(run, tmp_path / "r", drop_after=3)
    moved = cfg.replace(mesh=dict(zip(("data", "stage", "model"), mesh)), parallel=parallel,
                        train={"run_dir": str(tmp_path / "r")})
    history = jaxpar.train(moved)
    assert history.resumed_from == 3
    got = losses(history)
    assert sorted(got) == [4, 5, 6]
    # Same parameters restored; the layouts differ in the order of their float32 reductions only,
    # which moves losses by ~1e-6 per step (the parity tests' bound); 3 further steps stay well under 2e-5.
    np.testing.assert_allclose([got[s] for s in (4, 5, 6)], [want[s] for s in (4, 5, 6)], rtol=0, atol=2e-5)


def test_restore_params_for_generation(straight):
    cfg, run, _ = straight
    saved_cfg, params = ckpt_lib.restore_params(str(run))
    assert saved_cfg.model == cfg.model
    assert params["blocks"]["attn"]["wq"].shape == (8, 32, 4, 8)
    assert len(params["blocks"]["attn"]["wq"].sharding.device_set) == 1


# Orbax's background reads of the truncated files report their failure to an asyncio loop that
# orbax has already closed; Python prints that as an unraisable exception. Ours is the restore
# error above it, which the test checks.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_latest_checkpoint_falls_back_to_the_previous(straight, tmp_path, caplog):
    cfg, run, want = straight
    shutil.copytree(run, tmp_path / "r")
    # Truncate every array file of the newest checkpoint (as a full disk or a killed copy leaves it).
    data_files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "r" / "checkpoints" / "6" / "state")
                  for f in fs if os.path.basename(d) == "d"]
    assert data_files
    for path in data_files:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    longer = cfg.replace(train={"run_dir": str(tmp_path / "r"), "steps": 7})
    with caplog.at_level("WARNING", logger="jaxpar"):
        history = jaxpar.train(longer)
    assert history.resumed_from == 3
    assert any("checkpoints/6" in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    assert os.path.isdir(tmp_path / "r" / "checkpoints" / "6.corrupt")
    assert sorted(losses(history)) == [4, 5, 6, 7]


def test_checkpoint_of_another_shape_is_refused_before_writing(straight, tmp_path):
    cfg, run, _ = straight
    shutil.copytree(run, tmp_path / "r")
    before = {p: os.path.getmtime(os.path.join(tmp_path / "r", p)) for p in ("config.yaml", "metrics.jsonl")}
    wider = cfg.replace(model={"d_ff": 128}, train={"run_dir": str(tmp_path / "r")})
    with pytest.raises(CheckpointError, match=r"holds parameter `blocks\.mlp\.w_down` with shape \(8, 64, 32\), but "
                                              r"the config's model gives it shape \(8, 128, 32\)"):
        jaxpar.train(wider)
    assert before == {p: os.path.getmtime(os.path.join(tmp_path / "r", p)) for p in before}


def test_resume_never_refuses_to_overwrite(straight, tmp_path):
    cfg, run, _ = straight
    shutil.copytree(run, tmp_path / "r")
    with pytest.raises(CheckpointError, match="train.resume = never would overwrite them"):
        jaxpar.train(cfg.replace(train={"run_dir": str(tmp_path / "r"), "resume": "never"}))


# --------------------------------------------------------------------------------------------
# Non-finite steps: a target id of -1 makes the (patched) loss NaN inside the jitted step.


@pytest.fixture
def nan_at_step(monkeypatch):
    """Make the batch of step `k` (0-based) produce a NaN loss inside the jitted train step."""
    loop = importlib.import_module("jaxpar.train.loop")  # `jaxpar.train` itself is the function
    step = importlib.import_module("jaxpar.train.step")

    ce = step.cross_entropy_sum

    def poisoned_ce(logits, targets, vocab_size=None):
        return ce(logits, targets, vocab_size) + jnp.where(jnp.any(targets < 0), jnp.nan, 0.0)

    monkeypatch.setattr(step, "cross_entropy_sum", poisoned_ce)

    def arm(k: int):
        real = loop.batch_at

        def batch_at(source, i, global_batch, sharding):
            batch = real(source, i, global_batch, sharding)
            if i == k:  # the last target of row 0 becomes -1 (inputs untouched)
                host = np.asarray(batch).copy()
                host[0, -1] = -1
                batch = jax.device_put(host, sharding)
            return batch

        monkeypatch.setattr(loop, "batch_at", batch_at)

    return arm


def test_nan_step_is_skipped(tiny, tmp_path, nan_at_step):
    cfg = tiny(mesh={"data": 8}, train={"steps": 5, "run_dir": str(tmp_path / "skip"), "on_nan": "skip"})
    clean = losses(jaxpar.train(cfg.replace(train={"run_dir": str(tmp_path / "clean")})))
    nan_at_step(2)
    history = jaxpar.train(cfg)
    got = {r["step"]: r for r in history}
    assert np.isnan(got[3]["loss"]) and got[3]["skipped_steps"] == 1 and got[5]["skipped_steps"] == 1
    assert got[1]["loss"] == clean[1] and got[2]["loss"] == clean[2]
    assert all(np.isfinite(got[s]["loss"]) for s in (4, 5))
    # The update of step 3 was dropped: step 4 starts from the parameters after step 2, so its
    # loss differs from the clean run's (which had applied step 3).
    assert got[4]["loss"] != clean[4]


def test_nan_step_stops_with_the_last_good_state_saved(tiny, tmp_path, nan_at_step):
    cfg = tiny(mesh={"data": 8}, train={"steps": 6, "run_dir": str(tmp_path / "stop"), "on_nan": "stop"})
    nan_at_step(3)
    with pytest.raises(TrainingStopped, match=r"step 4 had a non-finite loss or gradient; the last good state \(after step 3\)"):
        jaxpar.train(cfg)
    assert saved_steps(tmp_path / "stop") == [3]
    assert file_losses(tmp_path / "stop").keys() <= {1, 2, 3}


# --------------------------------------------------------------------------------------------
# The CLI: SIGTERM saves and exits 0; the next run resumes.


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(tmp_path):
    run = tmp_path / "run"

    def cmd(steps):
        return [sys.executable, "-m", "jaxpar.train", "--config", os.path.join(ROOT, "configs", "tiny_llama.yaml"),
                "--set", f"train.steps={steps}", "--set", "train.log_every=1", "--set", f"train.run_dir={run}",
                "--set", "runtime.cpu_devices=8"]

    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(cmd(400), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM: checkpoint saved in" in out
    steps = saved_steps(run)
    assert len(steps) == 1 and 3 <= steps[0] < 400
    # Resume for a few more steps: it continues from the saved step.
    more = subprocess.run(cmd(steps[0] + 2), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert more.returncode == 0, more.stderr
    assert f"resumed from step {steps[0]}" in more.stdout
    assert sorted(file_losses(run))[-2:] == [steps[0] + 1, steps[0] + 2]
