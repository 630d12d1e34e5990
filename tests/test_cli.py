"""`python -m jaxpar.train`: a user mistake exits 2 with one `error:` line, no traceback, nothing written;
a tiny run writes config.yaml and metrics.jsonl.

Each subprocess pays the JAX import (seconds), so only a few run as subprocesses; the rest call
`main(argv)` in-process.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.train.__main__ import main

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.vocab_size=64",
        "model.seq_len=16", "train.steps=4", "train.global_batch=8", "train.log_every=2",
        "runtime.cpu_devices=8"]


def _sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxpar.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _tree(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _write_tokens(path, tokens) -> None:
    np.asarray(tokens, np.uint16).tofile(path)


def _bad_vocab_file(tmp_path) -> list[str]:
    tokens = np.random.default_rng().integers(0, 64, size=200)
    tokens[np.random.default_rng().integers(200)] = 100
    _write_tokens(tmp_path / "tokens.bin", tokens)
    return _sets("data.source=tokens.bin", "model.vocab_size=64", "model.seq_len=16")


# name -> (builds the arguments in tmp_path, text the error line must contain)
BAD_INPUTS = {
    "missing_config_file": (lambda tmp: ["--config", "missing.yaml"], "missing.yaml"),
    "unknown_key": (lambda tmp: _sets("model.dmodel=64"), "model.dmodel"),
    "wrong_type": (lambda tmp: _sets("train.steps=many"), "'many'"),
    "two_minus_ones": (lambda tmp: _sets("mesh.stage=-1"), "-1"),
    "mesh_product_mismatch": (lambda tmp: _sets("mesh.data=3", "train.global_batch=24"), "(3, 1, 1)"),
    "token_id_at_or_above_vocab": (_bad_vocab_file, "token id 100"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_2_with_one_error_line_and_writes_nothing(tmp_path, case):
    make_args, expected = BAD_INPUTS[case]
    args = make_args(tmp_path)
    run_dir = tmp_path / "run"
    before = _tree(tmp_path)

    proc = _run([*args, "--set", f"train.run_dir={run_dir}"], tmp_path)

    assert proc.returncode == 2, f"expected exit 2, got {proc.returncode}; stderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, f"expected exactly one `error:` line, got:\n{proc.stderr}"
    flat = " ".join(proc.stderr.split())  # the message may be hard-wrapped (see test_error_is_one_line)
    assert expected in flat, f"expected {expected!r} in the error: {proc.stderr}"
    assert not run_dir.exists(), "a bad input must not create the run directory"
    assert _tree(tmp_path) == before, f"files appeared or vanished: {_tree(tmp_path) ^ before}"


def test_tiny_run_writes_config_and_metrics(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(_sets(*TINY, f"train.run_dir={run_dir}"), tmp_path)

    assert proc.returncode == 0, f"expected exit 0, got {proc.returncode}; stderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "config.yaml", "metrics.jsonl"]
    assert os.listdir(run_dir / "checkpoints") == ["4"], "the last step is saved (train.save_final)"
    saved = load_config(run_dir / "config.yaml")
    assert saved == load_config(None, [*TINY, f"train.run_dir={run_dir}"]), "config.yaml is not the run's config"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4], "expected steps 1 (first), 2 (log_every) and 4 (last)"
    for r in records:
        assert set(r) >= {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"}, r
        assert all(np.isfinite(v) for v in r.values()), r
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0, r
    assert 3.0 < records[0]["loss"] < 5.5, f"initial loss should be near log(64) = 4.16: {records[0]}"

    for axis in ("data", "stage", "model"):
        assert any(line.split()[:1] == [axis] for line in proc.stdout.splitlines()), \
            f"summary does not list mesh axis {axis!r}:\n{proc.stdout}"
    assert "8 x cpu" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------------------------
# In-process: main(argv) as the CLI runs it, without paying for a new interpreter


@pytest.mark.parametrize("overrides, expected", [
    (["model.n_heads=4", "model.n_kv_heads=3"], "n_kv_heads = 3"),
    (["model.d_model=100", "model.n_heads=3"], "d_model = 100"),
    (["train.global_batch=12"], "train.global_batch = 12"),
    (["train.keep_checkpoints=0"], "train.keep_checkpoints = 0"),
    (["parallel.virtual_stages=2"], "needs parallel.schedule = interleaved_1f1b"),
    (["mesh.model=8", "mesh.data=1", "model.n_heads=8", "model.d_ff=100"],
     "model.d_ff = 100 is not divisible by mesh.model = 8"),
    (["mesh.model=8", "mesh.data=1", "model.n_heads=4", "model.d_model=128"],
     "model.n_heads = 4 is not divisible by mesh.model = 8"),
    (["data.source=missing.bin"], "missing.bin"),
])
def test_main_returns_2_on_user_errors(tmp_path, monkeypatch, capsys, overrides, expected):
    monkeypatch.chdir(tmp_path)
    assert main(_sets(*overrides, f"train.run_dir={tmp_path / 'run'}")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and expected in " ".join(err.split()), err
    assert list(tmp_path.iterdir()) == []


def test_short_data_file_returns_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write_tokens(tmp_path / "short.bin", np.arange(16))
    assert main(_sets("data.source=short.bin", "model.seq_len=16", "model.vocab_size=64",
                      f"train.run_dir={tmp_path / 'run'}")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "holds 16 tokens" in err and "17" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.bin"]


def test_document_mask_on_a_plain_token_file_returns_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write_tokens(tmp_path / "tokens.bin", np.arange(200) % 64)
    assert main(_sets("data.source=tokens.bin", "data.document_mask=true", "model.seq_len=16", "model.vocab_size=64",
                      f"train.run_dir={tmp_path / 'run'}")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1, err
    assert "no record of where its documents end" in err and "set data.document_mask=false" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.bin"]


def test_error_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--config", "a/rather/long/path/to/a/config/file/that/does/not/exist.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:"), f"expected one line:\n{err}"


def test_run_dir_that_is_a_file_returns_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("keep me")
    assert main(_sets(*TINY, "train.steps=1", "train.run_dir=taken")) == 2
    assert (tmp_path / "taken").read_text() == "keep me"
