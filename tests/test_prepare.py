"""`python -m jaxpar.data prepare`: token files that decode back to the input, a train/val split of
the asked fraction, deterministic output, tokenizer.json support, and bad input refused whole."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.data import CHUNK_CHARS, DataError, prepare
from jaxpar.data.__main__ import main

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _text(rng, n_lines: int) -> str:
    """Random lines of at most 80 characters, with blank lines, non-ASCII text and a CRLF line end."""
    lines = []
    for _ in range(n_lines):
        k = rng.integers(0, 8)
        lines.append(" ".join(rng.choice(WORDS, size=k)))
    lines[len(lines) // 2] += " é—ü"
    return "\n".join(lines[:-1]) + "\r\n" + lines[-1] + "\n"


def _tree(root, rng, scale: int = 1) -> list[str]:
    """A small text tree; returns the documents in the order prepare reads them for inputs
    [root/'books', root/'notes/*.jsonl'] (each argument's files sorted by path)."""
    docs = {}
    (root / "books" / "b").mkdir(parents=True)
    (root / "notes").mkdir()
    for name in ("books/z.txt", "books/b/a.txt", "books/a.txt"):
        docs[name] = [_text(rng, 40 * scale)]
        (root / name).write_text(docs[name][0], encoding="utf-8", newline="")
    (root / "books" / "ignored.md").write_text("not an input")
    (root / "books" / ".hidden.txt").write_text("hidden files are skipped")
    for name in ("notes/2.jsonl", "notes/1.jsonl"):
        docs[name] = [_text(rng, int(rng.integers(1, 10 * scale))) for _ in range(5)]
        lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[name])]
        lines.insert(2, "")  # blank lines are skipped
        (root / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    order = ["books/a.txt", "books/b/a.txt", "books/z.txt", "notes/1.jsonl", "notes/2.jsonl"]
    return [d for name in order for d in docs[name]]


def _inputs(root) -> list[str]:
    return [str(root / "books"), str(root / "notes" / "*.jsonl")]


def _read(out, split: str, dtype="uint16") -> np.ndarray:
    return np.fromfile(os.path.join(out, f"{split}.bin"), dtype=dtype)


def _decode(ids) -> str:
    return bytes(ids.astype(np.uint8)).decode("utf-8")


def test_byte_tokens_decode_back_to_the_input(tmp_path):
    docs = _tree(tmp_path, np.random.default_rng())
    meta = prepare(_inputs(tmp_path), str(tmp_path / "out"), "byte", val_fraction=0)
    train = _read(tmp_path / "out", "train")
    assert _decode(train) == "".join(d + "\n\n" for d in docs)  # every document, then a blank line
    assert len(_read(tmp_path / "out", "val")) == 0
    assert meta == json.loads((tmp_path / "out" / "meta.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"], meta["n_documents"]) == ("byte", 256, "uint16", 13)
    assert meta["train"]["n_tokens"] == len(train) and len(meta["inputs"]) == 5
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "train.bin", "val.bin"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out")]  # no temporary left


@pytest.mark.parametrize("fraction", [0.05, 0.3])
def test_split_holds_the_fraction_of_tokens(tmp_path, fraction):
    docs = _tree(tmp_path, np.random.default_rng(), scale=40)  # ~60 chunks
    meta = prepare(_inputs(tmp_path), str(tmp_path / "out"), "byte", val_fraction=fraction)
    train, val = _read(tmp_path / "out", "train"), _read(tmp_path / "out", "val")
    total = len(train) + len(val)
    # The split moves whole chunks; the greedy rule keeps the error within half the largest chunk,
    # which closes at the first line end past CHUNK_CHARS (lines here are <= 80 chars + separator).
    assert abs(len(val) - fraction * total) <= (CHUNK_CHARS + 80 + 2) / 2, (len(val), total)
    assert meta["val"]["n_chunks"] >= 2 and meta["train"]["n_chunks"] > meta["val"]["n_chunks"]
    # Nothing lost or duplicated: chunks are whole lines, so the lines of both splits are the input's.
    expected = "".join(d + "\n\n" for d in docs)
    assert sorted(_decode(train).splitlines() + _decode(val).splitlines()) == sorted(expected.splitlines())
    # Validation chunks are spread over the corpus (the first lies in its first half), not cut from its end.
    assert 0 <= expected.find(_decode(val)[:300]) < len(expected) // 2


def test_prepare_is_deterministic(tmp_path):
    _tree(tmp_path, np.random.default_rng(), scale=10)
    for out in ("out1", "out2"):
        prepare(_inputs(tmp_path), str(tmp_path / out), "byte", val_fraction=0.2)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes(), name


def _word_tokenizer(tmp_path, docs, extra: int = 0) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1}
    for w in " ".join(docs).split():
        vocab.setdefault(w, len(vocab))
    for i in range(extra):
        vocab[f"filler{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("extra, dtype", [(0, "uint16"), (70000, "uint32")])
def test_tokenizer_json(tmp_path, extra, dtype):
    from tokenizers import Tokenizer

    docs = _tree(tmp_path, np.random.default_rng())
    path = _word_tokenizer(tmp_path, docs, extra)
    meta = prepare(_inputs(tmp_path), str(tmp_path / "out"), path, val_fraction=0)
    tok = Tokenizer.from_file(path)
    expected = [i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [1]]  # EOS after each
    np.testing.assert_array_equal(_read(tmp_path / "out", "train", dtype), expected)
    assert (meta["vocab_size"], meta["eos_id"], meta["separator"], meta["dtype"]) == (tok.get_vocab_size(), 1, [1], dtype)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == open(path, "rb").read()


def test_force_replaces_only_a_prepared_dataset(tmp_path):
    _tree(tmp_path, np.random.default_rng())
    out = str(tmp_path / "out")
    prepare(_inputs(tmp_path), out, "byte", val_fraction=0)
    before = (tmp_path / "out" / "train.bin").read_bytes()
    with pytest.raises(DataError, match="already holds a prepared dataset; pass --force"):
        prepare(_inputs(tmp_path), out, "byte", val_fraction=0.2)
    assert (tmp_path / "out" / "train.bin").read_bytes() == before
    meta = prepare(_inputs(tmp_path), out, "byte", val_fraction=0.2, force=True)
    assert meta["val"]["n_tokens"] > 0 and len((tmp_path / "out" / "train.bin").read_bytes()) < len(before)
    assert sorted(os.listdir(tmp_path)) == ["books", "notes", "out"]  # no temporary or old copy left


def _bad_jsonl(tmp):
    (tmp / "notes" / "3.jsonl").write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    return [str(tmp / "books"), str(tmp / "notes")], "3.jsonl' line 2 has no string field `text`"


def _bad_json(tmp):
    (tmp / "notes" / "3.jsonl").write_text('{"text": "fine"}\n{"text": "unterminated}\n')
    return [str(tmp / "notes")], "3.jsonl' line 2 is not valid JSON"


def _not_utf8(tmp):
    (tmp / "books" / "zz.txt").write_bytes(b"fine\n\xff\xfe latin-1\n")
    return [str(tmp / "books")], "zz.txt' line 2 is not valid UTF-8"


def _existing_dataset(tmp):
    prepare([str(tmp / "books")], str(tmp / "out"), "byte", val_fraction=0)
    return [str(tmp / "books")], "already holds a prepared dataset; pass --force"


def _other_dir(tmp):
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine")
    return [str(tmp / "books")], "holding other files"


# name -> (extra arguments, builds the inputs in tmp and returns (inputs, text the error names))
BAD = {
    "empty_glob": ([], lambda tmp: ([str(tmp / "nothing" / "*.txt")], "nothing/*.txt' matches no .txt or .jsonl")),
    "missing_path": ([], lambda tmp: ([str(tmp / "missing.txt")], "missing.txt' does not exist")),
    "other_extension": ([], lambda tmp: ([str(tmp / "books" / "*")], "ignored.md' (matched by")),
    "jsonl_without_text": ([], _bad_jsonl),
    "invalid_json": ([], _bad_json),
    "not_utf8": ([], _not_utf8),
    "fraction_one": (["--val-fraction", "1"], lambda tmp: ([str(tmp / "books")], "--val-fraction 1.0 must lie in [0, 1)")),
    "fraction_negative": (["--val-fraction", "-0.1"], lambda tmp: ([str(tmp / "books")], "--val-fraction -0.1")),
    "fraction_leaves_val_empty": (["--val-fraction", "0.001"],
                                  lambda tmp: ([str(tmp / "books" / "a.txt")], "left the validation split empty")),
    "missing_tokenizer": (["--tokenizer", "nope.json"], lambda tmp: ([str(tmp / "books")], "'nope.json'")),
    "existing_dataset": ([], _existing_dataset),
    "out_holds_other_files": ([], _other_dir),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, case):
    _tree(tmp_path, np.random.default_rng())
    args, build = BAD[case]
    inputs, expected = build(tmp_path)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    out = tmp_path / "deeper" / "out" if case not in ("existing_dataset", "out_holds_other_files") else tmp_path / "out"
    code = main(["prepare", "--input", *inputs, "--out", str(out), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err, err
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before  # nothing written or removed


def test_cli_module(tmp_path):
    docs = _tree(tmp_path, np.random.default_rng())
    res = subprocess.run([sys.executable, "-m", "jaxpar.data", "prepare", "--input", *_inputs(tmp_path),
                          "--out", "out", "--val-fraction", "0"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert res.returncode == 0 and not res.stderr, res.stderr  # no warning either
    assert "wrote out: 5 files, 13 documents" in res.stdout
    assert _decode(_read(tmp_path / "out", "train")) == "".join(d + "\n\n" for d in docs)
