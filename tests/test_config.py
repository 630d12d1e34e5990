"""jaxpar.config: presets load, overrides parse to field types, and every user mistake is one clear error.

A user mistake (config, mesh, data) raises a JaxparError subclass whose message names the offending
value and says how to fix it; these tests run in-process (the CLI's handling is in test_cli.py).
"""

import dataclasses
import os
import platform
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.config import Config, ConfigError, JaxparError, from_dict, load_config, parse_override, validate
from jaxpar.mesh import make_mesh
from jaxpar.train.data import DataError, SyntheticSource, TokenFileSource, make_source

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))

# Words of the fix part of a message: every user error must say what to do, not only what is wrong.
FIX_WORDS = ("set ", "choose", "use ", "give ", "pass ", "write ", "change ", "did you mean", "valid keys", "fix",
             "check")


def _assert_clear(err: pytest.ExceptionInfo, *values: object) -> str:
    """The message is one sentence that names each offending value and says how to fix it."""
    msg = str(err.value)
    for v in values:
        assert str(v) in msg, f"expected the message to name {v!r}: {msg}"
    assert any(w in msg for w in FIX_WORDS), f"expected a fix in the message: {msg}"
    assert "\n" not in msg, f"expected one line: {msg!r}"
    return msg


# --------------------------------------------------------------------------------------------
# Shipped presets


def test_configs_dir_is_not_empty():
    assert CONFIGS, "expected YAML presets in configs/"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(path)
    validate(cfg)
    assert isinstance(cfg, Config)
    # Round trip: what the run writes to config.yaml reads back as the same config.
    assert from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("path", [p for p in CONFIGS if "tiny" in p.name], ids=lambda p: p.name)
def test_tiny_presets_build_a_mesh_on_the_test_devices(path):
    cfg = load_config(path)
    mesh = make_mesh(cfg)
    assert mesh.devices.size == 8
    for axis in ("data", "stage", "model"):  # explicit sizes as given; -1 takes the rest
        assert getattr(cfg.mesh, axis) in (-1, mesh.shape[axis])


def test_defaults_load_without_a_file():
    assert load_config() == Config()


# --------------------------------------------------------------------------------------------
# Overrides


@pytest.mark.parametrize("text, key, value", [
    ("model.d_model=256", "model.d_model", 256),
    ("train.lr=0.001", "train.lr", 0.001),
    ("train.lr=2", "train.lr", 2.0),  # an int where a float is due is widened
    ("parallel.sequence_parallel=false", "parallel.sequence_parallel", False),
    ("parallel.remat=dots", "parallel.remat", "dots"),
    ("model.arch=gpt2", "model.arch", "gpt2"),
    ("train.run_dir=/tmp/some run", "train.run_dir", "/tmp/some run"),
    ("model.n_kv_heads=null", "model.n_kv_heads", None),
    ("model.n_kv_heads=2", "model.n_kv_heads", 2),
    ("runtime.cpu_devices=4", "runtime.cpu_devices", 4),
    ("data.dtype=uint32", "data.dtype", "uint32"),
])
def test_override_parses_to_the_field_type(text, key, value):
    cfg = load_config(None, [text])
    section, name = key.split(".")
    got = getattr(getattr(cfg, section), name)
    assert got == value and type(got) is type(value), f"{text}: expected {value!r}, got {got!r}"


@pytest.mark.parametrize("text", ["train.lr=1e-3", "train.lr=3E-4"])
def test_override_reads_exponent_floats_without_a_dot(text):
    cfg = load_config(None, [text])
    assert cfg.train.lr == float(text.split("=")[1])


def test_parse_override_splits_dotted_key_and_parses_value():
    assert parse_override("model.d_model=256") == (["model", "d_model"], 256)
    assert parse_override("train.run_dir=a=b") == (["train", "run_dir"], "a=b")


def test_later_override_wins_and_overrides_apply_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 7\n  global_batch: 8\n")
    cfg = load_config(path, ["train.steps=3", "train.steps=5"])
    assert (cfg.train.steps, cfg.train.global_batch) == (5, 8)


@pytest.mark.parametrize("text", ["model.d_model", "d_model=3", "model.d_model.x=3", ".d_model=3"])
def test_malformed_override_is_a_config_error(text):
    with pytest.raises(ConfigError) as err:
        load_config(None, [text])
    _assert_clear(err, "--set section.key=value")


@pytest.mark.parametrize("text, bad, hint", [
    ("model.dmodel=64", "model.dmodel", "d_model"),
    ("train.step=3", "train.step", "steps"),
    ("modle.d_model=64", "modle", "model"),
    ("train.zzzz=1", "train.zzzz", "valid keys"),
])
def test_unknown_key_names_it_and_suggests(text, bad, hint):
    with pytest.raises(ConfigError) as err:
        load_config(None, [text])
    msg = _assert_clear(err, bad)
    assert hint in msg


def test_unknown_key_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  n_layer: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    _assert_clear(err, "model.n_layer", "n_layers", path)


@pytest.mark.parametrize("text, key, shown", [
    ("model.n_layers=abc", "model.n_layers", "'abc'"),
    ("model.n_layers=2.5", "model.n_layers", "2.5"),
    ("model.n_layers=true", "model.n_layers", "True"),
    ("train.lr=fast", "train.lr", "'fast'"),
    ("parallel.sequence_parallel=3", "parallel.sequence_parallel", "3"),
    ("model.arch=gpt3", "model.arch", "'gpt3'"),
    ("model.n_kv_heads=two", "model.n_kv_heads", "'two'"),
    ("model.d_model=[1, 2]", "model.d_model", "[1, 2]"),
])
def test_wrong_type_names_key_and_value(text, key, shown):
    with pytest.raises(ConfigError) as err:
        load_config(None, [text])
    _assert_clear(err, key, shown)


def test_section_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    _assert_clear(err, "model", "3")


def test_file_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    _assert_clear(err, path, "list")


def test_file_that_is_not_a_mapping_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError):
        load_config(path, ["train.steps=3"])


def test_invalid_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {d_model: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    _assert_clear(err, path)


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(path)
    _assert_clear(err, path)
    assert not path.exists()


# --------------------------------------------------------------------------------------------
# Config.replace


def test_replace_changes_only_named_fields():
    cfg = load_config()
    new = cfg.replace(train={"steps": 3}, model={"d_model": 64})
    assert (new.train.steps, new.model.d_model) == (3, 64)
    assert new.train.lr == cfg.train.lr and new.mesh == cfg.mesh
    assert cfg.train.steps == Config().train.steps, "replace must not mutate the original"


def test_replace_takes_dotted_keys_as_set_does():
    cfg = load_config()
    new = cfg.replace(**{"mesh.data": 2, "train.steps": 3, "train.lr": 0.5}, model={"d_model": 64})
    assert (new.mesh.data, new.train.steps, new.train.lr, new.model.d_model) == (2, 3, 0.5, 64)
    with pytest.raises(ConfigError, match=r"unknown config key `train\.stepz`"):
        cfg.replace(**{"train.stepz": 3})
    # A dotted key at the top of a YAML file is told to nest, not "did you mean `mesh.data`?".
    with pytest.raises(ConfigError, match=r"`mesh\.data` in .* is written dotted at the top level; nest it"):
        from_dict({"mesh.data": 2})


def test_replace_revalidates_types():
    cfg = load_config()
    with pytest.raises(ConfigError) as err:
        cfg.replace(train={"steps": "3"})
    _assert_clear(err, "train.steps", "'3'")
    with pytest.raises(ConfigError) as err:
        cfg.replace(train={"stepz": 3})
    _assert_clear(err, "train.stepz", "steps")


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_config().train.steps = 3  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Model shape rules


@pytest.mark.parametrize("overrides, values", [
    (["model.n_heads=4", "model.n_kv_heads=3"], ["n_kv_heads = 3", "n_heads = 4"]),
    (["model.d_model=100", "model.n_heads=3"], ["d_model = 100", "n_heads = 3"]),
    (["model.n_layers=0"], ["model.n_layers = 0"]),
    (["model.vocab_size=-5"], ["model.vocab_size = -5"]),
    (["model.d_model=36", "model.n_heads=4"], ["head_dim", "9"]),  # llama: RoPE needs an even head_dim
    (["model.arch=gpt2", "model.tie_embeddings=false"], ["model.tie_embeddings = false", "gpt2"]),
    (["model.arch=gpt2", "model.rope_scaling=linear", "model.rope_factor=2"], ["model.rope_scaling = linear", "gpt2"]),
    (["model.rope_scaling=llama3", "model.rope_factor=0.5"], ["model.rope_factor = 0.5", "at least 1"]),
    (["model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=4",
      "model.rope_high_freq_factor=1"], ["rope_low_freq_factor = 4.0", "rope_high_freq_factor = 1.0"]),
    # YaRN's ramp is placed by the pretraining context: no default stands in for a missing one.
    (["model.rope_scaling=yarn", "model.rope_factor=4"], ["model.rope_original_context", "yarn",
                                                          "original_max_position_embeddings"]),
    (["model.rope_scaling=yarn", "model.rope_factor=4", "model.rope_original_context=64",
      "model.rope_beta_slow=0"], ["rope_beta_slow = 0.0"]),
    (["model.rope_scaling=yarn", "model.rope_factor=4", "model.rope_original_context=64",
      "model.rope_attention_factor=-1"], ["model.rope_attention_factor = -1.0"]),
])
def test_model_shape_rules(overrides, values):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    _assert_clear(err, *values)


@pytest.mark.parametrize("override, shown", [
    ("model.n_kv_heads=0", "model.n_kv_heads = 0"),
    ("model.norm_eps=0", "model.norm_eps = 0.0"),
    ("model.init_std=-1", "model.init_std = -1.0"),
    ("parallel.zero=4", "parallel.zero = 4"),
    ("parallel.microbatches=0", "parallel.microbatches = 0"),
    ("parallel.virtual_stages=0", "parallel.virtual_stages = 0"),
    ("train.steps=0", "train.steps = 0"),
    ("train.global_batch=0", "train.global_batch = 0"),
    ("train.lr=-1", "train.lr = -1.0"),
    ("train.warmup_steps=-1", "train.warmup_steps = -1"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio = 2.0"),
    ("train.grad_clip=-1", "train.grad_clip = -1.0"),
    ("train.weight_decay=-1", "train.weight_decay = -1.0"),
    ("train.log_every=0", "train.log_every = 0"),
    ("train.checkpoint_every=-1", "train.checkpoint_every = -1"),
    ("runtime.cpu_devices=0", "runtime.cpu_devices = 0"),
])
def test_range_rules_name_key_and_value(override, shown):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert shown in str(err.value), f"expected the message to name {shown!r}: {err.value}"


def test_divisor_suggestion_is_valid():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.d_model=96", "model.n_heads=5"])
    suggested = int(str(err.value).split("e.g. ")[1].split(")")[0])
    assert 96 % suggested == 0, f"suggested n_heads = {suggested} does not divide d_model = 96"
    load_config(None, ["model.d_model=96", f"model.n_heads={suggested}"])  # and it validates


# --------------------------------------------------------------------------------------------
# Mesh rules (the device count is known only to make_mesh; the tests have 8 devices)


def test_default_mesh_takes_all_devices():
    assert jax.device_count() == 8
    mesh = make_mesh(load_config())
    assert mesh.axis_names == ("data", "stage", "model")
    assert dict(mesh.shape) == {"data": 8, "stage": 1, "model": 1}


@pytest.mark.parametrize("overrides, values", [
    (["mesh.data=4", "train.global_batch=16"], ["(4, 1, 1)", "8", "-1"]),
    (["mesh.data=3", "train.global_batch=24"], ["(3, 1, 1)", "8"]),
    (["mesh.data=16", "train.global_batch=16"], ["(16, 1, 1)", "8"]),
])
def test_mesh_product_must_equal_device_count(overrides, values):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as err:
        make_mesh(cfg)
    _assert_clear(err, *values)


def test_simulated_devices_get_threads_for_their_collectives():
    # conftest called use_cpu_devices(8): XLA sizes the CPU client's pools from PJRT_NPROC.
    from jaxpar.mesh import CPU_THREADS_PER_DEVICE, cpu_threads

    assert cpu_threads() >= CPU_THREADS_PER_DEVICE * 8


def test_too_few_threads_for_simulated_devices_is_a_warning(monkeypatch):
    from jaxpar.mesh import check_cpu_threads

    mesh = make_mesh(load_config(None, ["mesh.data=2", "mesh.stage=2", "mesh.model=2"]))
    monkeypatch.setenv("PJRT_NPROC", "8")
    with pytest.warns(RuntimeWarning, match="8 CPU devices share 8 threads.*PJRT_NPROC=64"):
        check_cpu_threads(mesh)
    monkeypatch.setenv("PJRT_NPROC", "64")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_cpu_threads(mesh)
        check_cpu_threads(make_mesh(load_config(None, ["mesh.data=1"]), jax.devices()[:1]))


_FAULTS_PER_STEP = """
import ctypes, resource, sys, threading
from jaxpar.config import load_config
from jaxpar.mesh import use_cpu_devices
use_cpu_devices(2, load_config(None, ["mesh.data=2", "runtime.cpu_malloc=" + sys.argv[1]]))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
faults = []
def step():  # as XLA:CPU runs an execution on a pool thread: allocate its buffers, use them, free them
    p = libc.malloc(96 << 20)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    ctypes.memset(p, 1, 96 << 20)
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    libc.free(p)
for _ in range(3):
    t = threading.Thread(target=step)
    t.start()
    t.join()
print(faults)
"""


@pytest.mark.skipif(not (sys.platform == "linux" and platform.libc_ver()[0] == "glibc"), reason="glibc's malloc")
def test_cpu_malloc_keep_reuses_a_freed_step_buffer_without_faulting_it_in_again():
    # runtime.cpu_malloc: keep (the default) against glibc's defaults, each in a fresh process
    # (mallopt must precede the backend's threads): a 96 MiB buffer allocated, touched and freed on
    # a new thread three times, as XLA:CPU's steps do. Kept, the 2nd and 3rd steps fault in no
    # pages; glibc unmaps it and faults every page in again (fewer with system-wide huge pages).
    import ast
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "XLA_FLAGS", "PJRT_NPROC")}
    faults = {mode: ast.literal_eval(subprocess.run([sys.executable, "-c", _FAULTS_PER_STEP, mode], env=env,
                                                    capture_output=True, text=True, check=True).stdout.splitlines()[-1])
              for mode in ("keep", "glibc")}
    assert max(faults["glibc"][1:]) > 0, faults
    assert max(faults["keep"][1:]) <= min(faults["glibc"][1:]) / 10, faults


@pytest.mark.parametrize("arch, sections, one_at_a_time", [
    ("llama", {"mesh": {"data": 8}}, True),  # ZeRO-0, data only: XLA's own pool (one thread per device)
    ("gpt2", {"mesh": {"data": 8}, "parallel": {"microbatches": 2}, "train": {"global_batch": 16}}, True),
    # ^ tied embedding, accumulation
    ("llama", {"mesh": {"data": 8}, "parallel": {"zero": 1, "zero_min_elements": 1}}, False),  # a gather per leaf
    ("llama", {"mesh": {"data": 4, "model": 2}, "parallel": {"sequence_parallel": True}}, False),
    ("llama", {"mesh": {"data": 4, "stage": 2}, "parallel": {"microbatches": 2}}, False),
])
def test_cpu_pool_is_sized_by_the_collectives_a_step_can_have_in_flight(tiny, arch, sections, one_at_a_time):
    # One thread per device is enough only for a step whose devices never have two collectives in
    # flight (jaxpar/mesh.py); the rule is read from the config, before JAX starts, so check it
    # against the compiled step.
    from jaxpar.inspect import collectives_in_flight
    from jaxpar.mesh import CPU_THREADS_PER_DEVICE, cpu_threads_needed
    from jaxpar.train.step import lower_step

    cfg = tiny(arch, **sections)
    assert cpu_threads_needed(8) == CPU_THREADS_PER_DEVICE * 8  # without a config: any program's pool
    assert cpu_threads_needed(8, cfg) == (8 if one_at_a_time else CPU_THREADS_PER_DEVICE * 8)
    compiled, _ = lower_step(cfg)
    in_flight = collectives_in_flight(compiled.as_text())
    assert (in_flight == 1) if one_at_a_time else (in_flight > 1 or sections["mesh"].get("stage", 1) > 1), in_flight


def test_use_cpu_devices_keeps_xlas_pool_for_a_data_only_zero0_step(monkeypatch):
    from jaxpar.mesh import use_cpu_devices

    monkeypatch.delenv("PJRT_NPROC", raising=False)
    use_cpu_devices(8, load_config(None, ["mesh.data=8"]))  # the backend is up with 8 devices: a no-op there
    assert "PJRT_NPROC" not in os.environ
    use_cpu_devices(8, load_config(None, ["mesh.data=4", "mesh.model=2"]))
    assert os.environ["PJRT_NPROC"] == "64"
    monkeypatch.setenv("PJRT_NPROC", "12")  # a pool set by the user is kept
    use_cpu_devices(8)
    assert os.environ["PJRT_NPROC"] == "12"
    # build's check agrees: 8 threads are enough for this step, not for a pipelined one.
    from jaxpar.mesh import check_cpu_threads
    monkeypatch.setenv("PJRT_NPROC", "8")
    data_only = load_config(None, ["mesh.data=-1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_cpu_threads(make_mesh(data_only), data_only)
    piped = load_config(None, ["mesh.data=4", "mesh.stage=2"])
    with pytest.warns(RuntimeWarning, match="PJRT_NPROC=64"):
        check_cpu_threads(make_mesh(piped), piped)


def test_mesh_with_explicit_sizes_covering_the_devices():
    mesh = make_mesh(load_config(None, ["mesh.data=8"]))
    assert dict(mesh.shape) == {"data": 8, "stage": 1, "model": 1}


def test_mesh_with_one_minus_one_that_cannot_fill_the_devices():
    # The rule under test is resolve_mesh_shape's alone (a -1 must fill the devices): call it directly.
    from jaxpar.config import MeshConfig, resolve_mesh_shape

    with pytest.raises(ConfigError) as err:
        resolve_mesh_shape(MeshConfig(data=-1, stage=3, model=1), 8)
    _assert_clear(err, "mesh.data = -1", "3", "8")
    assert resolve_mesh_shape(MeshConfig(data=-1, stage=2, model=2), 8) == (2, 2, 2)


@pytest.mark.parametrize("overrides", [
    ["mesh.data=-1", "mesh.stage=-1"],
    ["mesh.data=-1", "mesh.model=-1"],
    ["mesh.stage=-1", "mesh.model=-1", "mesh.data=2"],
])
def test_two_minus_ones_are_refused(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    _assert_clear(err, "-1")


@pytest.mark.parametrize("size", [0, -2])
def test_mesh_axis_size_must_be_positive_or_minus_one(size):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"mesh.data={size}"])
    _assert_clear(err, f"mesh.data = {size}")


def test_global_batch_must_divide_over_explicit_data():
    with pytest.raises(ConfigError) as err:
        make_mesh(load_config(None, ["mesh.data=8", "train.global_batch=12"]))
    _assert_clear(err, "train.global_batch = 12", "8", "multiple of 8")


def test_global_batch_must_divide_over_data_times_microbatches():
    with pytest.raises(ConfigError) as err:
        make_mesh(load_config(None, ["mesh.data=4", "parallel.microbatches=4", "train.global_batch=8"]),
                  jax.devices()[:4])
    _assert_clear(err, "train.global_batch = 8", "4 x 4 = 16", "multiple of 16")


def test_global_batch_must_divide_over_data_resolved_by_the_mesh():
    cfg = load_config(None, ["train.global_batch=12"])  # data = -1: known only with the devices
    with pytest.raises(ConfigError) as err:
        make_mesh(cfg)
    _assert_clear(err, "train.global_batch = 12", "8", "multiple of 8")


# --------------------------------------------------------------------------------------------
# Out-of-range values: refused, never silently ignored


def test_out_of_range_zero_is_a_range_error_not_a_feature_error():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["parallel.zero=4"])
    assert "parallel.zero = 4" in str(err.value) and "0, 1, 2 or 3" in str(err.value)


# --------------------------------------------------------------------------------------------
# Data files


def _data_cfg(path, vocab=64, seq_len=16, dtype="uint16"):
    return load_config(None, [f"data.source={path}", f"data.dtype={dtype}", f"model.vocab_size={vocab}",
                              f"model.seq_len={seq_len}"])


def test_synthetic_source_is_the_default():
    assert isinstance(make_source(load_config()), SyntheticSource)


def test_document_mask_is_off_by_default_and_set_by_an_override(tmp_path):
    assert load_config().data.document_mask is False and not make_source(load_config()).documents
    cfg = load_config(None, ["data.document_mask=true"])
    assert cfg.data.document_mask is True and make_source(cfg).documents
    path = tmp_path / "t.bin"
    np.arange(200, dtype=np.uint16).tofile(path)
    with pytest.raises(DataError) as err:
        make_source(load_config(None, [f"data.source={path}", "data.document_mask=true", "model.vocab_size=256"]))
    _assert_clear(err, str(path), "data.document_mask", "EOS")


def test_token_file_serves_windows(tmp_path):
    path = tmp_path / "t.bin"
    tokens = np.random.default_rng().integers(0, 64, size=200).astype(np.uint16)
    tokens.tofile(path)
    src = make_source(_data_cfg(path))
    assert isinstance(src, TokenFileSource)
    rows = src.rows(0, range(4))
    assert rows.shape == (4, 17) and rows.max() < 64


def test_uint32_token_file(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(70_000, 70_040, dtype=np.uint32).tofile(path)
    src = make_source(_data_cfg(path, vocab=70_040, dtype="uint32"))
    assert src.rows(0, range(1)).max() < 70_040


def test_missing_data_file(tmp_path):
    path = tmp_path / "nope.bin"
    with pytest.raises(DataError) as err:
        make_source(_data_cfg(path))
    _assert_clear(err, path)
    assert not path.exists()


@pytest.mark.parametrize("n", [0, 1, 16])
def test_data_file_shorter_than_one_sequence_plus_one(tmp_path, n):
    path = tmp_path / "short.bin"
    np.zeros(n, np.uint16).tofile(path)
    with pytest.raises(DataError) as err:
        make_source(_data_cfg(path, seq_len=16))
    _assert_clear(err, path, f"holds {n} tokens", "17")


def test_data_file_of_exactly_one_sequence_plus_one_is_enough(tmp_path):
    path = tmp_path / "exact.bin"
    np.arange(17, dtype=np.uint16).tofile(path)
    src = make_source(_data_cfg(path, seq_len=16))
    np.testing.assert_array_equal(src.rows(3, range(2)), np.tile(np.arange(17), (2, 1)))


@pytest.mark.parametrize("bad", [64, 1000])
def test_token_id_at_or_above_vocab(tmp_path, bad):
    path = tmp_path / "t.bin"
    tokens = np.random.default_rng().integers(0, 64, size=100).astype(np.uint16)
    tokens[np.random.default_rng().integers(100)] = bad
    tokens.tofile(path)
    with pytest.raises(DataError) as err:
        make_source(_data_cfg(path, vocab=64))
    _assert_clear(err, path, f"token id {bad}", "64", f"at least {bad + 1}")


def test_data_file_size_not_a_multiple_of_the_dtype(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(b"\x01" * 75)
    with pytest.raises(DataError) as err:
        make_source(_data_cfg(path))
    _assert_clear(err, path, "75", "uint16")


@pytest.mark.parametrize("exc", [ConfigError, DataError])
def test_user_errors_share_one_base_class(exc):
    assert issubclass(exc, JaxparError) and issubclass(exc, ValueError)


def test_cudnn_attention_needs_a_gpu(tiny):
    from jaxpar.train.step import build

    with pytest.raises(ConfigError, match=r"model.attention = cudnn needs an NVIDIA GPU, but the mesh's devices are cpu"):
        build(tiny(model={"attention": "cudnn"}, mesh={"data": 8}))
