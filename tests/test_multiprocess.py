"""Multi-process runs: 2 processes x 4 CPU devices (gloo collectives) = 1 process x 8 devices."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.train.checkpoint import saved_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def train_cmd(run_dir, *extra) -> list[str]:
    return [sys.executable, "-m", "jaxpar.train", "--config", os.path.join(ROOT, "configs", "tiny_3d.yaml"),
            "--set", "train.steps=4", "--set", "train.log_every=1", "--set", f"train.run_dir={run_dir}", *extra]


def run_processes(run_dir, n: int, devices_each: int, *extra) -> list[subprocess.CompletedProcess]:
    """`n` processes of one run on this machine, as docs/README's multi-process recipe does."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)  # each process sets its own device count (runtime.cpu_devices)
    procs = [subprocess.Popen(train_cmd(run_dir, "--set", f"runtime.cpu_devices={devices_each}",
                                        "--set", f"runtime.coordinator=localhost:{port}",
                                        "--set", f"runtime.num_processes={n}", "--set", f"runtime.process_id={i}",
                                        *extra),
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=600), *p.communicate()) for p in procs]


def losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.mark.slow  # three launches of fresh processes (~1 min); CI runs the slow tests too
def test_two_processes_match_one_and_checkpoints_move_between_them(tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    results = run_processes(multi, 2, 4, "--set", "train.checkpoint_every=2")
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    # Only process 0 prints the progress and the summary.
    assert "done:" in results[0].stdout and "done:" not in results[1].stdout and "mesh" not in results[1].stdout
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    one = subprocess.run(train_cmd(single, "--set", "runtime.cpu_devices=8"), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    want, got = losses(single), losses(multi)
    assert sorted(got) == [1, 2, 3, 4]
    # The same program on the same (2, 2, 2) mesh; gloo and XLA's in-process CPU collectives may add
    # partial sums in another order, a float32 rounding (~1e-7 relative) on a loss of ~5.
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=0, atol=1e-6)

    # The 2-process checkpoint of step 2 resumes in one process (another process count).
    assert saved_steps(multi) == [2, 4]
    resumed = tmp_path / "resumed"
    shutil.copytree(multi, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    again = subprocess.run(train_cmd(resumed, "--set", "runtime.cpu_devices=8"), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step 2" in again.stdout
    np.testing.assert_allclose([losses(resumed)[s] for s in (3, 4)], [got[s] for s in (3, 4)], rtol=0, atol=1e-6)
