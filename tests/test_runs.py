"""Runs a researcher can trust: no trained work lost, logs a batch job can read, quiet recovery,
a watchdog for hangs.

The CLI runs are subprocesses with stdout a pipe (not a terminal), as under SLURM or nohup; the
shared run (`first`) trains once and each test copies it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

import jaxpar
from jaxpar.train import watchdog
from jaxpar.train.checkpoint import CheckpointError, newest_trained, saved_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.vocab_size=64",
        "model.seq_len=16", "train.global_batch=8", "train.warmup_steps=1", "runtime.cpu_devices=8"]


def _cli(module: str, *args: str, sets=(), script: str | None = None) -> subprocess.CompletedProcess:
    """`python -m jaxpar.<module> args --set ...` (or `script`, which runs it), stdout a pipe."""
    argv = [*args, *(a for s in sets for a in ("--set", s))]
    cmd = [sys.executable, "-c", script, *argv] if script else [sys.executable, "-m", f"jaxpar.{module}", *argv]
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _records(run) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """4 steps through the CLI, a checkpoint every 2, logged every 2: (run_dir, the process)."""
    run = tmp_path_factory.mktemp("first") / "run"
    proc = _cli("train", sets=[*TINY, "train.steps=4", "train.log_every=2", "train.checkpoint_every=2",
                              f"train.run_dir={run}"])
    assert proc.returncode == 0, proc.stderr
    return run, proc


def test_a_batch_log_has_one_full_line_per_logged_step(first):
    run, proc = first
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "4/4"], proc.stdout
    for line, rec in zip(lines, _records(run), strict=True):  # every figure, in full, as metrics.jsonl has it
        assert f"loss {rec['loss']:.4f} grad_norm " in line and " tok/s " in line and " MFU " in line, line
        assert " ETA " in line and "…" not in line, line
    assert "━" not in proc.stdout, "the live bar is for terminals only"
    assert "Traceback" not in proc.stderr and proc.stderr.strip() == "", proc.stderr


def test_the_last_step_is_saved_without_any_checkpoint_setting(tmp_path):
    cfg = jaxpar.load_config(None, [*TINY, "train.steps=3", f"train.run_dir={tmp_path / 'r'}"])
    assert jaxpar.train(cfg).checkpoint.endswith(os.path.join("checkpoints", "3"))
    assert saved_steps(tmp_path / "r") == [3]
    off = cfg.replace(train={"run_dir": str(tmp_path / "off"), "save_final": False})
    assert jaxpar.train(off).checkpoint is None and saved_steps(tmp_path / "off") == []


def test_the_python_api_logs_each_record_as_a_line(tmp_path, caplog):
    cfg = jaxpar.load_config(None, [*TINY, "train.steps=2", "train.log_every=1", "train.save_final=false",
                                    f"train.run_dir={tmp_path / 'r'}"])
    with caplog.at_level(logging.INFO, logger="jaxpar"):
        history = jaxpar.train(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxpar.progress"]
    assert [line.split()[:2] for line in lines] == [["step", "1/2"], ["step", "2/2"]], lines
    assert f"loss {history[-1]['loss']:.4f}" in lines[-1]


def test_a_fresh_run_into_a_folder_with_records_and_no_checkpoint_is_refused(first, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(first[0], run)
    shutil.rmtree(run / "checkpoints")
    before = (run / "metrics.jsonl").read_text()
    proc = _cli("train", sets=[*TINY, "train.steps=4", f"train.run_dir={run}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "holds the metrics of an earlier run (3 records, up to step 4)" in err[0], proc.stderr
    assert "choose a new train.run_dir" in err[0] and "metrics.jsonl away" in err[0], err
    assert (run / "metrics.jsonl").read_text() == before


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_quietly_and_keeps_every_record(first, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(first[0], run)
    for d, _, files in os.walk(run / "checkpoints" / "4" / "state"):
        for name in files:
            if os.path.basename(d) == "d":
                os.truncate(os.path.join(d, name), 10)
    earlier = _records(run)
    proc = _cli("train", sets=[*TINY, "train.steps=6", "train.log_every=1", "train.checkpoint_every=2",
                              f"train.run_dir={run}"])
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    out = proc.stdout.splitlines()
    assert sum("checkpoints/4 is damaged" in line for line in out) == 1, proc.stdout
    assert any("done (resumed from step 2)" in line for line in out), proc.stdout
    # Steps 1-2 kept, steps 3-6 logged again; the first run's record of step 4 moved, not lost.
    assert [r["step"] for r in _records(run)] == [1, 2, 3, 4, 5, 6]
    assert _records(run)[:2] == earlier[:2]
    with open(run / "metrics.rewound.jsonl") as f:
        assert [json.loads(line) for line in f] == earlier[2:]


def test_export_and_generate_refuse_a_checkpoint_older_than_the_logged_steps(first, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(first[0], run)
    shutil.rmtree(run / "checkpoints" / "4")  # as a run killed after logging step 4 leaves it
    with pytest.raises(CheckpointError, match=r"newest checkpoint is of step 2 but its metrics.jsonl logs training "
                                              r"up to step 4.*--allow-stale"):
        newest_trained(str(run))
    assert newest_trained(str(run), allow_stale=True) == 2
    proc = _cli("convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "out"))
    assert proc.returncode == 2 and "--allow-stale" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
    proc = _cli("convert", "--run-dir", str(run), "--to-hf", str(tmp_path / "out"), "--allow-stale")
    assert proc.returncode == 0 and f"from step 2 of {run}" in proc.stdout, proc.stderr
    assert "WARNING" not in proc.stderr and "absl" not in proc.stderr, proc.stderr  # no library chatter
    proc = _cli("generate", "--run-dir", str(run), "--prompt", "ab", "--max-new-tokens", "2")
    assert proc.returncode == 2 and "--allow-stale" in proc.stderr, proc.stderr


_HANG_AT_STEP_3 = """
import sys, threading
import jaxpar.train.loop as loop
from jaxpar.train.__main__ import main

fetch = loop.batch_at

def batch_at(source, k, *args):  # step 3 (k = 2) never returns: a stalled collective, as far as the loop knows
    if k == 2:
        threading.Event().wait()
    return fetch(source, k, *args)

loop.batch_at = batch_at
sys.exit(main(sys.argv[1:]))
"""


def test_the_watchdog_ends_a_hung_run_and_the_rerun_resumes(tmp_path):
    run = tmp_path / "r"
    sets = [*TINY, "train.steps=4", "train.log_every=1", "train.checkpoint_every=2", f"train.run_dir={run}"]
    hung = _cli("train", sets=[*sets, "runtime.step_timeout_s=20"], script=_HANG_AT_STEP_3)
    assert hung.returncode == watchdog.EXIT_HUNG == 75, hung.stderr
    errors = [line for line in hung.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: step 3 did not finish within runtime.step_timeout_s"), \
        hung.stderr
    dumps = [name for name in os.listdir(run) if name.startswith("hang-")]
    assert len(dumps) == 1 and dumps[0] in errors[0]
    stacks = (run / dumps[0]).read_text()
    assert "in batch_at" in stacks, stacks[:2000]
    assert saved_steps(run) == [2]
    rerun = _cli("train", sets=sets)
    assert rerun.returncode == 0, rerun.stderr
    assert "done (resumed from step 2)" in rerun.stdout and saved_steps(run) == [2, 4]


def test_watchdog_limits():
    assert watchdog.limits("off", "gpu") == (None, None)
    assert watchdog.limits("auto", "cpu") == (None, None)
    assert watchdog.limits("auto", "gpu") == (watchdog.STARTUP_S, watchdog.STARTUP_S)
    assert watchdog.limits(60.0, "cpu") == (watchdog.STARTUP_S, 60.0)
    dog = watchdog.Watchdog("auto", "gpu", "unused")
    for t in [1.0] * 9 + [100.0]:
        dog.timed(t)
    assert dog.step_s == watchdog.AUTO_FLOOR_S  # 10 x the median 1 s is under the floor
    dog = watchdog.Watchdog("auto", "gpu", "unused")
    for t in [60.0] * 10:
        dog.timed(t)
    assert dog.step_s == 600.0
