"""runtime.xla_flags: which flags are chosen for which backend and jaxlib, that the user's XLA_FLAGS
win, that a flag the installed jaxlib does not register is refused before anything runs, and what
the CLI prints."""

import logging
import os
import subprocess
import sys

import pytest

from jaxpar import xla_flags
from jaxpar.config import ConfigError, load_config
from jaxpar.mesh import CPU_SCHEDULER_FLAG
from jaxpar.train.__main__ import main
from jaxpar.xla_flags import GPU_PRESET, resolve

LEGACY = frozenset({  # what jaxlib 0.10.2 registers of the preset's spellings (scanned)
    "xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_all_reduce_combine_threshold_bytes",
    "xla_gpu_all_gather_combine_threshold_bytes", "xla_gpu_reduce_scatter_combine_threshold_bytes",
    "xla_gpu_enable_while_loop_double_buffering", "xla_gpu_enable_pipelined_all_gather",
    "xla_gpu_enable_pipelined_reduce_scatter", "xla_gpu_enable_pipelined_all_reduce", "xla_dump_to",
    "xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel"})
NEWER = (LEGACY - {f"xla_gpu_enable_pipelined_{c}" for c in ("all_gather", "reduce_scatter", "all_reduce")}
         | {f"xla_gpu_pipeline_{c}" for c in ("all_gather", "reduce_scatter", "all_reduce")})
RAGGED = "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=true"
COMMON = ["--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
          "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
          "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
          "--xla_gpu_enable_while_loop_double_buffering=true"]


@pytest.mark.parametrize("version", [(0, 10, 2), (0, 12, 0)])
def test_cpu_backend_gets_no_preset(version):
    choice = resolve("auto", "cpu", version, LEGACY | NEWER, "")
    assert choice.added == () and "the backend is cpu" in choice.describe(), choice


def test_gpu_preset_on_jaxlib_0_10_uses_the_boolean_pipelining_flags():
    choice = resolve("auto", "gpu", (0, 10, 2), LEGACY, "")
    assert list(choice.added) == COMMON + [
        "--xla_gpu_enable_pipelined_all_gather=true", "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "--xla_gpu_enable_pipelined_all_reduce=true", RAGGED], choice.added
    assert choice.missing == () and choice.kept == ()


def test_gpu_preset_prefers_the_newer_spelling_where_jaxlib_registers_it():
    expected = COMMON + ["--xla_gpu_pipeline_all_gather=on", "--xla_gpu_pipeline_reduce_scatter=on",
                         "--xla_gpu_pipeline_all_reduce=on", RAGGED]
    assert list(resolve("auto", "gpu", (0, 11, 2), NEWER, "").added) == expected
    # A release that registers both spellings gets the newer one only (never the same setting twice).
    assert list(resolve("auto", "gpu", (0, 11, 2), NEWER | LEGACY, "").added) == expected


def test_a_spelling_is_not_chosen_for_a_version_older_than_its_evidence():
    """jaxlib 0.10.2 cannot hold `xla_gpu_pipeline_*` (its binary lacks them): with the legacy
    spelling gone too, the setting is reported missing, not guessed."""
    choice = resolve("auto", "gpu", (0, 10, 2), NEWER, "")
    assert list(choice.added) == COMMON + [RAGGED]
    assert len(choice.missing) == 3 and all("pipeline" in m for m in choice.missing), choice.missing
    assert "not known to this jaxlib" in choice.describe()


def test_a_flag_the_jaxlib_lacks_is_left_out():
    choice = resolve("auto", "gpu", (0, 10, 2), LEGACY - {"xla_gpu_enable_while_loop_double_buffering"}, "")
    assert not any("double_buffering" in t for t in choice.added)
    assert choice.missing == (GPU_PRESET[4].purpose,)


def test_the_ragged_all_to_all_kernel_only_where_the_jaxlib_registers_it():
    """`xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel` (MoE's ragged exchange): set on
    GPUs where the scan finds it, reported missing (never passed: XLA would abort) where not."""
    assert RAGGED in resolve("auto", "gpu", (0, 10, 2), LEGACY, "").added
    choice = resolve("auto", "gpu", (0, 10, 2), LEGACY - {RAGGED[2:].split("=")[0]}, "")
    assert not any("ragged" in t for t in choice.added) and choice.missing == (GPU_PRESET[-1].purpose,)
    assert "ragged all-to-all" in choice.describe()
    assert resolve("auto", "cpu", (0, 10, 2), LEGACY, "").added == ()


def test_user_xla_flags_win_by_name_and_over_every_spelling():
    user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_enable_pipelined_all_gather=false"
    choice = resolve("auto", "gpu", (0, 11, 2), NEWER | LEGACY, user)
    assert not any(t.startswith("--xla_gpu_enable_latency_hiding_scheduler") for t in choice.added), choice.added
    assert "--xla_gpu_pipeline_all_gather=on" not in choice.added, "the user's legacy spelling must win"
    assert set(choice.kept) == set(user.split())
    assert len(choice.added) == len(GPU_PRESET) - 2


def test_flags_string_is_checked_against_the_known_flags():
    known = LEGACY | {"xla_cpu_enable_fast_math"}
    choice = resolve("--xla_cpu_enable_fast_math=false --xla_dump_to=/tmp/d", "cpu", (0, 10, 2), known,
                     "--xla_dump_to=/elsewhere")
    assert choice.added == ("--xla_cpu_enable_fast_math=false",) and choice.kept == ("--xla_dump_to=/elsewhere",)
    with pytest.raises(ConfigError) as e:
        resolve("--xla_gpu_enable_latency_hiding_schedular=true", "gpu", (0, 10, 2), known, "")
    message = str(e.value)
    assert "--xla_gpu_enable_latency_hiding_schedular" in message and "0.10.2 does not register" in message
    assert "did you mean --xla_gpu_enable_latency_hiding_scheduler?" in message, message
    assert resolve("none", "gpu", (0, 10, 2), known, "").added == ()
    with pytest.raises(ConfigError, match="cannot be checked: no library of the installed jaxlib"):
        resolve("--xla_dump_to=/tmp/d", "cpu", (0, 10, 2), frozenset(), "")  # the scan found no XLA library


def test_registered_flags_are_nul_delimited_literals_not_proto_fields(tmp_path):
    lib = tmp_path / "lib.so"
    # A registered flag: a C string literal. A DebugOptions field without a flag: inside the
    # serialized descriptor, length-prefixed and followed by a tag byte.
    lib.write_bytes(b"\x7fELF\x00xla_dump_to\x00xla_gpu_real\x00\n\x0dxla_gpu_field\x18\x01\x00xla_gpu_tail")
    assert xla_flags.registered_flags(lib) == {"xla_dump_to", "xla_gpu_real"}


def test_the_preset_fits_the_installed_jaxlib():
    """Every preset setting has a spelling the installed jaxlib registers (else update GPU_PRESET),
    and a removed flag whose proto field survives is not taken for a flag."""
    known = xla_flags.installed_flags()
    # The scan finds the flag jaxpar itself sets: jaxpar.mesh.use_cpu_devices passes
    # CPU_SCHEDULER_FLAG, so a jaxlib that lacks it breaks the project anyway (XLA aborts on an
    # unknown flag), whatever this test says: update jaxpar.mesh with it.
    (needed, _), = xla_flags.parse(CPU_SCHEDULER_FLAG)
    assert needed in known, needed
    assert "xla_gpu_enable_pipelined_collectives" not in known
    choice = resolve("auto", "gpu", xla_flags.jaxlib_version(), known, "")
    assert len(choice.added) == len(GPU_PRESET) and choice.missing == (), choice.describe()


def test_apply_appends_to_xla_flags_and_keeps_what_is_there(monkeypatch):
    before = f"--xla_force_host_platform_device_count=8 {CPU_SCHEDULER_FLAG} --xla_gpu_all_gather_combine_threshold_bytes=1"
    monkeypatch.setenv("XLA_FLAGS", before)
    monkeypatch.setattr(xla_flags, "expected_backend", lambda cfg: "gpu")
    monkeypatch.setattr(xla_flags, "installed_flags", lambda: LEGACY)
    monkeypatch.setattr(xla_flags, "jaxlib_version", lambda: (0, 10, 2))
    monkeypatch.setattr(xla_flags, "_backend_started", lambda: False)
    choice = xla_flags.apply(load_config(None, []))
    assert os.environ["XLA_FLAGS"] == before + " " + " ".join(choice.added)
    assert len(choice.added) == len(GPU_PRESET) - 1 and "all_gather_combine" not in " ".join(choice.added)
    # Applied twice (the CLI, then train()), nothing is added again.
    assert xla_flags.apply(load_config(None, [])).added == ()


def test_a_preset_that_comes_too_late_is_warned_about(monkeypatch, caplog):
    """After JAX started its backend, XLA_FLAGS is read no more: the auto preset is dropped with a
    warning (not silently), and a string of flags is refused."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setattr(xla_flags, "expected_backend", lambda cfg: "gpu")
    monkeypatch.setattr(xla_flags, "installed_flags", lambda: LEGACY)
    monkeypatch.setattr(xla_flags, "jaxlib_version", lambda: (0, 10, 2))
    monkeypatch.setattr(xla_flags, "_backend_started", lambda: True)
    with caplog.at_level(logging.WARNING, logger="jaxpar"):
        choice = xla_flags.apply(load_config(None, []))
    assert choice.added == () and "not applied" in choice.describe()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot be applied: JAX's backend had already started" in warnings[0], warnings
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in warnings[0]
    with pytest.raises(ConfigError, match="cannot be applied: JAX already started its backend"):
        xla_flags.apply(load_config(None, ["runtime.xla_flags=--xla_dump_to=/tmp/d"]))
    # Nothing to add (the flags are in XLA_FLAGS already, or the backend is a CPU): no warning.
    caplog.clear()
    monkeypatch.setattr(xla_flags, "expected_backend", lambda cfg: "cpu")
    with caplog.at_level(logging.WARNING, logger="jaxpar"):
        assert xla_flags.apply(load_config(None, [])).added == ()
    assert not caplog.records


@pytest.mark.parametrize("value, expected", [
    ("fast", "'fast' must be auto, none, or XLA flags"),
    ("--xla_ok=1 -xla_bad", "(not '-xla_bad')"),
    ("--XLA_SHOUT=1", "--xla_name=value"),
])
def test_bad_value_exits_2_naming_it(tmp_path, monkeypatch, capsys, value, expected):
    monkeypatch.chdir(tmp_path)
    assert main(["--set", f"runtime.xla_flags={value}", "--set", f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: runtime.xla_flags") and expected in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_unknown_flag_exits_2_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--set", "runtime.xla_flags=--xla_gpu_enable_latency_hiding_schedular=true",
                 "--set", f"train.run_dir={tmp_path / 'run'}"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: runtime.xla_flags names --xla_gpu_enable_latency_hiding_schedular")
    assert "Traceback" not in captured.err and captured.out == "" and list(tmp_path.iterdir()) == []


def test_cli_prints_the_flags_it_set_and_the_ones_it_kept(tmp_path):
    """A fresh process: the flags reach XLA_FLAGS before the backend starts, the user's win. The
    flags come from what the installed jaxlib registers (dump flags: harmless, and visible):
    `xla_dump_to` is in every XLA that installed_flags reads."""
    known = xla_flags.installed_flags()
    assert "xla_dump_to" in known
    extra = next((f for f in ("xla_dump_hlo_as_text", "xla_dump_hlo_as_proto") if f in known), None)
    if extra is None:
        pytest.skip("the installed jaxlib registers neither xla_dump_hlo_as_text nor xla_dump_hlo_as_proto")
    mine, theirs = tmp_path / "config_dump", tmp_path / "env_dump"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 --xla_dump_to={theirs}")
    args = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.vocab_size=64",
            "model.seq_len=16", "train.steps=1", "train.global_batch=8", "runtime.cpu_devices=8",
            f"train.run_dir={tmp_path / 'run'}", f"runtime.xla_flags=--xla_dump_to={mine} --{extra}=true"]
    proc = subprocess.run([sys.executable, "-m", "jaxpar.train", *[a for s in args for a in ("--set", s)]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next((s for s in proc.stdout.splitlines() if s.startswith("xla ")), None)
    assert line is not None, proc.stdout
    assert f"--{extra}=true" in line, line
    assert f"kept from XLA_FLAGS: --xla_dump_to={theirs}" in line, line
    assert theirs.is_dir() and any(theirs.iterdir()) and not mine.exists()  # XLA read the user's flag
