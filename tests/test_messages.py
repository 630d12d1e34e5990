"""Every message points at the fix (issue 39, item 5), and outputs get the user's umask (item 3).

Each test checks a message by its words: where the mistake is (an override, not the file), what
the file is (text, not token ids), every mismatch at once, why a layout cannot exist, the right
per-device numbers, and for the CLIs one `error:` line with exit 2 and no traceback.
"""

import json
import math
import os
import stat

import jax
import numpy as np
import pytest

from jaxpar import hf, model
from jaxpar.config import Config, ConfigError, load_config
from jaxpar.parallel.checks import check_stage_axis
from jaxpar.data import DataError, prepare
from jaxpar.train.data import TokenFileSource, make_source

TINY_LLAMA = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_llama.yaml")
TEXT = "Once upon a time there was a little fox who lived in the woods.\n" * 400


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, f"expected one `error:` line, got: {err!r}"
    assert "Traceback" not in err and "usage:" not in err, err
    return err.strip()


# --------------------------------------------------------------------------------------------
# 1. A typo in an override is the override's


def test_override_typo_names_the_override_not_the_file():
    with pytest.raises(ConfigError) as err:
        load_config(TINY_LLAMA, ["train.stesp=10"])
    msg = str(err.value)
    assert "in `--set train.stesp=10`" in msg, msg
    assert "tiny_llama.yaml" not in msg, msg
    assert "did you mean `train.steps`?" in msg, msg


def test_override_typo_in_the_section_names_the_override():
    with pytest.raises(ConfigError) as err:
        load_config(TINY_LLAMA, ["trian.steps=10"])
    msg = str(err.value)
    assert "unknown config key `trian` in `--set trian.steps=10`; did you mean `train`?" in msg, msg


def test_typo_in_the_file_still_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  stesp: 10\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["train.steps=5"])
    msg = str(err.value)
    assert f"unknown config key `train.stesp` in {path}" in msg and "did you mean `train.steps`?" in msg, msg
    assert "--set" not in msg, msg


def test_a_hugging_face_config_json_as_config_names_convert(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                      "hidden_size": 64}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "config.json")
    msg = str(err.value)
    assert "is a Hugging Face model's config.json, not a jaxpar config" in msg, msg
    assert f"python -m jaxpar.convert --from-hf {tmp_path} --to RUN_DIR" in msg, msg


# --------------------------------------------------------------------------------------------
# 2. Text where token ids are expected


def _text_cfg(source: str) -> Config:
    return load_config(None, [f"data.source={source}", "model.vocab_size=256", "model.seq_len=16"])


@pytest.mark.parametrize("name, why", [("story.txt", "its name ends in .txt"),
                                       ("notes.md", "its name ends in .md"),
                                       ("corpus", "its first 1024 bytes are printable UTF-8 text")])
def test_a_text_file_as_data_source_names_data_prepare(tmp_path, monkeypatch, name, why):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(TEXT + "naïve café, 東京\n")
    with pytest.raises(DataError) as err:
        make_source(_text_cfg(name))
    msg = str(err.value)
    assert f"data file {name!r} is text, not token ids ({why})" in msg, msg
    assert "python -m jaxpar.data prepare --input" in msg and "set data.source to DIR" in msg, msg
    assert "vocab_size" not in msg, msg
    if not name.endswith((".txt", ".jsonl")):  # prepare reads those only
        assert "rename it to a .txt file" in msg, msg


@pytest.mark.parametrize("dtype, vocab", [("uint16", 256), ("uint16", 50304), ("uint32", 128256)])
def test_a_token_file_is_not_taken_for_text(tmp_path, dtype, vocab):
    ids = np.random.default_rng(0).integers(0, vocab, size=4096)
    ids[::7] = np.arange(len(ids[::7])) % 256  # byte-level ids, as tokenized text has every few tokens
    path = tmp_path / "train.bin"
    ids.astype(dtype).tofile(path)
    src = TokenFileSource(str(path), dtype, vocab, 16, seed=0)
    assert src.rows(0, range(2)).shape == (2, 17)


# --------------------------------------------------------------------------------------------
# 3. model.init_from: every mismatch at once


def _hf_folder(tmp_path, *extra: str) -> str:
    folder = tmp_path / "hf"
    folder.mkdir()
    base = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.d_ff=96", "model.vocab_size=256",
            "model.seq_len=32"]
    mcfg = load_config(None, [*base, *(extra or ("model.n_kv_heads=2",))]).model
    (folder / "config.json").write_text(json.dumps(hf.hf_config(mcfg)))
    return str(folder)


def test_init_from_reports_every_mismatch_at_once(tmp_path):
    folder = _hf_folder(tmp_path)
    cfg = load_config(None, ["model.n_layers=4", "model.d_model=128", "model.n_heads=4", "model.n_kv_heads=2",
                             "model.d_ff=384", "model.vocab_size=256", "model.seq_len=32"]).model
    with pytest.raises(hf.HFError) as err:
        hf.check_matches(cfg, folder)
    msg = str(err.value)
    assert msg.startswith(f"3 settings of the model section differ from {os.path.join(folder, 'config.json')!r}: "), msg
    for item in ("model.n_layers = 4 (folder: 2)", "model.d_model = 128 (folder: 64)", "model.d_ff = 384 (folder: 96)"):
        assert item in msg, msg
    # head_dim follows d_model / n_heads: not a difference of its own.
    assert "head_dim" not in msg, msg
    assert "set them to the folder's values (`--set model.n_layers=2 --set model.d_model=64 --set model.d_ff=96`)" \
        in msg, msg
    assert "\n" not in msg


def test_init_from_lists_seq_len_beside_the_others(tmp_path):
    """gpt2's learned positions cover only the folder's: a longer seq_len is a difference (a RoPE
    model's is a context extension, tests/test_hf.py)."""
    folder = _hf_folder(tmp_path, "model.arch=gpt2")
    cfg = load_config(None, ["model.arch=gpt2", "model.n_layers=2", "model.d_model=64", "model.n_heads=4",
                             "model.d_ff=96", "model.vocab_size=128", "model.seq_len=64"]).model
    with pytest.raises(hf.HFError) as err:
        hf.check_matches(cfg, folder)
    msg = str(err.value)
    assert msg.startswith("2 settings"), msg
    assert "model.vocab_size = 128 (folder: 256)" in msg and "model.seq_len = 64 (folder: at most 32)" in msg, msg


def test_init_from_one_mismatch_is_singular(tmp_path):
    folder = _hf_folder(tmp_path)
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
                             "model.d_ff=128", "model.vocab_size=256", "model.seq_len=32"]).model
    with pytest.raises(hf.HFError, match=r"^1 setting of the model section differs from .*: model.d_ff = 128 "
                                         r"\(folder: 96\); set it to the folder's value \(`--set model.d_ff=96`\)"):
        hf.check_matches(cfg, folder)


def test_init_from_a_run_directory_names_the_export(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    with pytest.raises(hf.HFError) as err:
        hf.config_from_hf(str(run))
    msg = str(err.value)
    assert "is a jaxpar run directory" in msg and f"python -m jaxpar.convert --run-dir {run} --to-hf DIR" in msg, msg


# --------------------------------------------------------------------------------------------
# 4. More stages than layers


def test_more_stages_than_layers_says_one_layer_per_stage():
    cfg = load_config(None, ["model.n_layers=4", "mesh.stage=8", "mesh.data=1"])
    with pytest.raises(ConfigError) as err:
        check_stage_axis(cfg, 8)
    msg = str(err.value)
    assert msg == ("mesh.stage = 8 needs at least 8 layers (one per stage), but model.n_layers = 4; use fewer stages "
                   "(mesh.stage=4) or more layers (model.n_layers=8)."), msg


def test_more_chunks_than_layers_counts_virtual_stages():
    cfg = load_config(None, ["model.n_layers=6", "mesh.stage=4", "mesh.data=2", "parallel.schedule=interleaved_1f1b",
                             "parallel.virtual_stages=2", "parallel.microbatches=8"])
    with pytest.raises(ConfigError) as err:
        check_stage_axis(cfg, 4)
    msg = str(err.value)
    assert "4 x 2 = 8 pipeline chunks need at least 8 layers (one per chunk), but model.n_layers = 6" in msg, msg
    assert "mesh.stage=3" in msg and "model.n_layers=8" in msg, msg


# --------------------------------------------------------------------------------------------
# 5. The state line's per-device bytes, against the program's own shardings


def _shard_bytes(shardings, shapes) -> int:
    return sum(math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize
               for sh, s in zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes)))


@pytest.mark.parametrize("zero", [1, 2])
def test_state_bytes_follow_every_axis_on_2x2x2(tiny, zero):
    from jaxpar.mesh import make_mesh
    from jaxpar.parallel.zero import state_bytes
    from jaxpar.train.step import build

    cfg = tiny(model={"n_layers": 4, "d_model": 64, "d_ff": 128, "vocab_size": 256},
               mesh={"data": 2, "stage": 2, "model": 2},
               parallel={"zero": zero, "microbatches": 2, "zero_min_elements": 1024})
    program = build(cfg, make_mesh(cfg))
    shapes = model.param_shapes(cfg.model)
    acct = state_bytes(program.layout, shapes, program.mesh)
    params = _shard_bytes(program.state_shardings.params, shapes)
    adam = [s for s in jax.tree.leaves(program.state_shardings.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
            if hasattr(s, "mu")]
    assert len(adam) == 1, program.state_shardings.opt_state
    moments = _shard_bytes(adam[0].mu, shapes)
    full = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes))
    assert acct["params"]["per_device"] == params
    assert acct["optimizer"]["per_device"] == 2 * moments
    # ZeRO-1 holds each gradient whole over `data` before its reduce-scatter, laid out as the
    # parameters (split by `stage` and `model`); ZeRO-2 holds its shard, laid out as the moments.
    assert acct["grads"]["per_device"] == (params if zero == 1 else moments)
    assert acct["grads"]["per_device"] < full / 3, "stage and model split the gradients"


# --------------------------------------------------------------------------------------------
# 6. The other CLIs: one `error:` line naming the value and a fix, exit 2


@pytest.fixture
def kinds(tmp_path):
    """A Hugging Face folder, a run directory, a prepared dataset and a text file, by kind."""
    hf_dir = tmp_path / "hfl"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "meta.json").write_text("{}")
    text = tmp_path / "story.txt"
    text.write_text(TEXT)
    return {"hf": str(hf_dir), "run": str(run), "ds": str(ds), "text": str(text)}


def _exit_2(main, argv) -> None:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2, code


@pytest.mark.parametrize("argv, words", [
    (lambda k: ["--from-hf", k["run"], "--to-hf", "o"], "is a jaxpar run directory (config.yaml, checkpoints/), "
                                                         "not a Hugging Face model folder; pass it as `--run-dir "),
    (lambda k: ["--from-hf", k["ds"], "--to-hf", "o"], "is a dataset prepared by `python -m jaxpar.data prepare`"),
    (lambda k: ["--run-dir", k["hf"], "--to-hf", "o"], "is a Hugging Face model folder (config.json), not a jaxpar "
                                                        "run directory; pass it as `--from-hf "),
    (lambda k: ["--run-dir", k["text"], "--to-hf", "o"], "is a file, not a run directory; pass the folder"),
    (lambda k: ["--from-hf", k["hf"], "--to", "o", "--seq-len", "0"], "--seq-len 0 must be at least 1; pass"),
    (lambda k: ["--from-hf", k["hf"], "--to-hf", k["text"] + "/o"], "is not a writable folder; pass a path"),
    (lambda k: ["--from-hf", k["hf"]], "one of the arguments --to --to-hf is required; see "
                                       "`python -m jaxpar.convert --help`."),
], ids=["from_hf_run", "from_hf_dataset", "run_dir_hf", "run_dir_file", "seq_len_0", "to_hf_under_a_file",
        "no_output"])
def test_convert_argument_mistakes(kinds, tmp_path, monkeypatch, capsys, argv, words):
    from jaxpar import convert

    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    _exit_2(convert.main, argv(kinds))
    assert words in _one_error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == before, "nothing may be written"


@pytest.mark.parametrize("argv, words", [
    (lambda k: ["--hf", k["run"], "--prompt", "hi"], "not a Hugging Face model folder; pass it as `--run-dir "),
    (lambda k: ["--run-dir", k["hf"], "--prompt", "hi"], "not a jaxpar run directory; pass it as `--hf "),
    (lambda k: ["--hf", k["hf"], "--prompt", "hi", "--cpu-devices", "0"], "--cpu-devices 0 must be at least 1"),
    (lambda k: ["--hf", k["hf"], "--prompt", "hi", "--temperature", "-1"],
     "--temperature -1 must be at least 0; pass 0 for greedy decoding"),
    (lambda k: ["--hf", k["hf"], "--prompt", "hi", "--top-k", "0"], "--top-k 0 must be at least 1"),
    (lambda k: ["--hf", k["hf"], "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
    (lambda k: ["--hf", k["hf"]], "the following arguments are required: --prompt; see "
                                  "`python -m jaxpar.generate --help`."),
], ids=["hf_run", "run_dir_hf", "cpu_devices_0", "negative_temperature", "top_k_0", "no_new_tokens", "no_prompt"])
def test_generate_argument_mistakes(kinds, capsys, argv, words):
    from jaxpar.generate import parse_args

    _exit_2(parse_args, argv(kinds))
    assert words in _one_error_line(capsys)


def test_data_cli_argument_mistake_is_one_line(kinds, capsys):
    from jaxpar.data.__main__ import main

    _exit_2(main, ["prepare", "--input", kinds["text"]])
    assert _one_error_line(capsys) == ("error: the following arguments are required: --out; see "
                                       "`python -m jaxpar.data prepare --help`.")


def test_data_prepare_unwritable_out_is_a_data_error(kinds, tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(DataError, match=r"^--out '.*out' cannot be written \(Permission denied\); pass a path in a "
                                        r"folder you can write to"):
        prepare([kinds["text"]], str(tmp_path / "out"))


def test_export_to_an_unwritable_folder_is_an_hf_error(tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    mcfg = load_config(None, ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
                              "model.vocab_size=64", "model.seq_len=16"]).model
    params = jax.device_get(model.init_params(mcfg, jax.random.key(0)))
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(hf.HFError, match=r"'.*out' cannot be written \(Permission denied\); choose a folder you can "
                                         r"write to"):
        hf.save_params(params, mcfg, str(tmp_path / "out"))


def test_inspect_argument_mistake_is_one_line(capsys):
    from jaxpar.inspect import main

    _exit_2(main, ["--bogus"])
    assert _one_error_line(capsys) == ("error: unrecognized arguments: --bogus; see `python -m jaxpar.inspect "
                                       "--help`.")


@pytest.mark.parametrize("extra, words", [
    (["--png", "story.txt"], "--png 'story.txt' is not an image file name"),
    (["--activation-bytes", "-5"], "--activation-bytes -5 must be >= 0"),
    (["-m", "x"], "invalid int value: 'x'; see `python -m jaxpar.schedules --help`."),
])
def test_schedules_argument_mistakes(tmp_path, monkeypatch, capsys, extra, words):
    from jaxpar.schedules import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "story.txt").write_text(TEXT)
    assert main(["--schedule", "1f1b", "-p", "2", "-m", "4", *extra]) == 2
    assert words in _one_error_line(capsys)
    assert (tmp_path / "story.txt").read_text() == TEXT


# --------------------------------------------------------------------------------------------
# 7. Outputs get the user's umask


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root) -> dict[str, int]:
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for d, dirs, names in os.walk(root):
        for n in dirs + names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.stat(p).st_mode)
    return out


def _assert_umask_modes(root) -> None:
    modes = _modes(root)
    assert len(modes) > 1, modes
    for rel, mode in modes.items():
        want = 0o755 if os.path.isdir(os.path.join(root, rel)) else 0o644
        assert mode == want, f"{rel}: {oct(mode)}, expected {oct(want)} under umask 022 ({modes})"


def test_outputs_get_the_umask(tmp_path, umask_022):
    from jaxpar.convert import hf_to_run

    mcfg = load_config(None, ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
                              "model.vocab_size=64", "model.seq_len=16"]).model
    params = jax.device_get(model.init_params(mcfg, jax.random.key(0)))
    hf.save_params(params, mcfg, str(tmp_path / "hf"))
    assert os.path.isfile(tmp_path / "hf" / hf.SINGLE)
    _assert_umask_modes(tmp_path / "hf")

    (tmp_path / "story.txt").write_text(TEXT)
    prepare([str(tmp_path / "story.txt")], str(tmp_path / "ds"), val_fraction=0.1)
    _assert_umask_modes(tmp_path / "ds")

    hf_to_run(str(tmp_path / "hf"), str(tmp_path / "run"))
    _assert_umask_modes(tmp_path / "run")


def test_train_argument_mistake_is_one_line(capsys):
    from jaxpar.train.__main__ import main

    _exit_2(main, ["--bogus"])
    assert _one_error_line(capsys) == ("error: unrecognized arguments: --bogus; see `python -m jaxpar.train "
                                       "--help`.")


def test_plan_write_config_gets_the_umask(tmp_path, umask_022):
    from jaxpar.plan import _write_config

    _write_config(load_config(None), str(tmp_path / "best.yaml"))
    assert stat.S_IMODE(os.stat(tmp_path / "best.yaml").st_mode) == 0o644


def test_more_chunks_than_layers_when_no_stage_count_splits_them():
    """61 layers (DeepSeek-V3's) in 2 chunks a stage on 64 stages: no stage count gives whole chunks;
    one sentence, not a crash inside the message (the planner met this case)."""
    from jaxpar.parallel.checks import check_stage_axis

    cfg = load_config(None, ["model.n_layers=61", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                             "parallel.microbatches=64", "train.global_batch=64"])
    with pytest.raises(ConfigError, match=r"64 x 2 = 128 pipeline chunks need at least 128 layers .* use "
                                          r"parallel.virtual_stages=1 with mesh.stage=61"):
        check_stage_axis(cfg, 64)
