"""Batches depend only on (seed, step): never on the mesh; token files and prepared directories give
the right windows; validation batches are fixed, disjoint from training, and the same on every mesh."""

import json
import os

import jax
import numpy as np
import pytest

from jaxpar.data import prepare
from jaxpar.mesh import make_mesh
from jaxpar.sharding import NamedSharding, compute_rules
from jaxpar.train.data import (DataError, SyntheticSource, TokenFileSource, batch_at, document_eos, eval_batches,
                               make_eval_source, make_source)


def batch_sharding(cfg, data, model=1):
    cfg = cfg.replace(mesh={"data": data, "model": model})
    mesh = make_mesh(cfg, jax.devices()[:data * model])
    return NamedSharding(mesh, compute_rules(cfg, mesh).spec(("batch", None)))


def sharded_batch(cfg, step, data):
    return batch_at(make_source(cfg), step, cfg.train.global_batch, batch_sharding(cfg, data))


def test_batch_is_the_same_on_every_mesh(tiny):
    cfg = tiny()
    for step in (0, 7):
        ref = np.asarray(sharded_batch(cfg, step, 1))
        for data in (2, 4, 8):
            arr = sharded_batch(cfg, step, data)
            assert arr.sharding.spec[0] == "data"
            np.testing.assert_array_equal(np.asarray(arr), ref)
    assert not np.array_equal(np.asarray(sharded_batch(cfg, 0, 1)), np.asarray(sharded_batch(cfg, 1, 1)))


def test_batch_rows_do_not_depend_on_how_they_are_split():
    src = SyntheticSource(vocab_size=64, seq_len=16, seed=3)
    whole = src.rows(5, range(0, 8))
    np.testing.assert_array_equal(np.concatenate([src.rows(5, range(0, 3)), src.rows(5, range(3, 8))]), whole)
    assert whole.shape == (8, 17) and whole.dtype == np.int32
    assert whole.min() >= 0 and whole.max() < 64


def test_synthetic_language_follows_its_chain():
    src = SyntheticSource(vocab_size=64, seq_len=32, seed=0)
    rows = src.rows(0, range(16))
    for prev, nxt in zip(rows[:, :-1].ravel(), rows[:, 1:].ravel()):
        assert nxt in src.successors[prev]
    assert src.entropy < 0.3 * np.log(64)  # learnable: far below an untrained model's log(vocab)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows(tmp_path, dtype):
    tokens = np.arange(1000, dtype=dtype) % 250
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    src = TokenFileSource(str(path), dtype, vocab_size=256, seq_len=16, seed=1)
    rows = src.rows(3, range(4))
    assert rows.shape == (4, 17)
    for row in rows:  # each row is a contiguous window of the file
        start = int(np.flatnonzero((tokens[:-16] == row[0]) & (tokens[16:] == row[16]))[0])
        np.testing.assert_array_equal(row, tokens[start:start + 17])
    np.testing.assert_array_equal(src.rows(3, range(4)), rows)  # deterministic in (seed, step)


def test_token_file_of_exactly_one_window(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(17, dtype=np.uint16).tofile(path)
    src = TokenFileSource(str(path), "uint16", vocab_size=64, seq_len=16, seed=0)
    np.testing.assert_array_equal(src.rows(0, range(2)), np.tile(np.arange(17), (2, 1)))


def _prepared(tmp_path, n_bytes=40_000, val_fraction=0.2) -> tuple[str, bytes]:
    text = bytes(np.random.default_rng().integers(97, 123, size=n_bytes, dtype=np.uint8))
    text = b"\n".join(text[i:i + 60] for i in range(0, len(text), 60)).decode()  # lines of 60 letters
    (tmp_path / "corpus.txt").write_text(text)
    prepare([str(tmp_path / "corpus.txt")], str(tmp_path / "ds"), "byte", val_fraction=val_fraction)
    return str(tmp_path / "ds"), text


def test_prepared_directory_trains_on_its_train_split(tiny, tmp_path):
    ds, _ = _prepared(tmp_path)
    cfg = tiny(model={"vocab_size": 256}, data={"source": ds, "dtype": "uint32"})  # meta.json's uint16 wins
    src = make_source(cfg)
    train = np.fromfile(os.path.join(ds, "train.bin"), np.uint16)
    for row in src.rows(2, range(8)):
        starts = [i for i in np.flatnonzero(train[:-16] == row[0]) if np.array_equal(train[i:i + 17], row)]
        assert starts, row  # a window of train.bin
    np.testing.assert_array_equal(np.asarray(batch_at(src, 2, 8, batch_sharding(cfg, 8))), src.rows(2, range(8)))


def test_prepared_directory_with_a_larger_vocab_is_refused(tiny, tmp_path):
    ds, _ = _prepared(tmp_path)
    cfg = tiny(model={"vocab_size": 200}, data={"source": ds})
    for make in (make_source, make_eval_source):
        with pytest.raises(DataError, match=r"vocab_size 256 \(byte\), more than model.vocab_size = 200; set "
                                            r"model.vocab_size to at least 256"):
            make(cfg)


def test_prepared_directory_that_is_incomplete_is_refused(tiny, tmp_path):
    ds, _ = _prepared(tmp_path)
    cfg = tiny(model={"vocab_size": 256}, data={"source": ds})
    with open(os.path.join(ds, "train.bin"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match="train.bin' has 100 bytes, but meta.json says"):
        make_source(cfg)
    os.remove(os.path.join(ds, "train.bin"))
    with pytest.raises(DataError, match="lacks its train split"):
        make_source(cfg)
    os.remove(os.path.join(ds, "meta.json"))
    with pytest.raises(DataError, match="has no meta.json"):
        make_source(cfg)


def test_train_cli_refuses_a_directory_with_a_larger_vocab(tmp_path, capsys, monkeypatch):
    from jaxpar.train.__main__ import main

    ds, _ = _prepared(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["--set", f"data.source={ds}", "--set", "model.vocab_size=128"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data directory") and err.count("\n") == 1 and "vocab_size 256" in err, err
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt", "ds"]


@pytest.mark.parametrize("source", ["synthetic", "prepared"])
def test_eval_batches_are_fixed_and_the_same_on_every_mesh(tiny, tmp_path, source):
    ds = _prepared(tmp_path)[0] if source == "prepared" else "synthetic"
    cfg = tiny(model={"vocab_size": 256}, data={"source": ds}, train={"eval_batches": 3})
    ref = [np.asarray(b) for b in eval_batches(make_eval_source(cfg), cfg, batch_sharding(cfg, 1))]
    assert len(ref) == 3 and ref[0].shape == (8, 17)
    assert len({b.tobytes() for b in ref}) == 3  # three different batches
    for data, model in ((8, 1), (2, 4), (4, 2)):
        got = eval_batches(make_eval_source(cfg), cfg, batch_sharding(cfg, data, model))
        assert got[0].sharding.spec[0] == "data"
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(np.asarray(a), b)
    # Not the training batches of the same indices.
    for i, b in enumerate(ref):
        assert not np.array_equal(make_source(cfg).rows(i, range(8)), b)


def test_synthetic_eval_rows_follow_the_training_chain():
    train = SyntheticSource(vocab_size=64, seq_len=32, seed=0)
    val = SyntheticSource(vocab_size=64, seq_len=32, seed=0, stream=0xE7A1)
    rows = val.rows(0, range(8))
    assert all(nxt in train.successors[prev] for prev, nxt in zip(rows[:, :-1].ravel(), rows[:, 1:].ravel()))
    assert not np.array_equal(rows, train.rows(0, range(8)))


def test_eval_windows_cover_the_val_split_without_overlap(tiny, tmp_path):
    ds, _ = _prepared(tmp_path)
    cfg = tiny(model={"vocab_size": 256}, data={"source": ds}, train={"eval_batches": 2})
    val = np.fromfile(os.path.join(ds, "val.bin"), np.uint16)
    src = make_eval_source(cfg)
    rows = np.concatenate([src.rows(i, range(8)) for i in range(2)])
    starts = [int(np.flatnonzero([np.array_equal(val[s:s + 17], r) for s in range(len(val) - 16)])[0]) for r in rows]
    assert starts[0] == 0 and starts[-1] == len(val) - 17  # from the first token to the last
    assert all(b - a >= 16 for a, b in zip(starts, starts[1:]))  # no predicted token counted twice


def test_eval_needs_a_val_split_large_enough(tiny, tmp_path):
    ds, _ = _prepared(tmp_path, n_bytes=20_000, val_fraction=0.25)  # one chunk of ~4100 val tokens
    meta = json.loads(open(os.path.join(ds, "meta.json")).read())
    windows = (meta["val"]["n_tokens"] - 1) // 16
    ok = tiny(model={"vocab_size": 256}, data={"source": ds}, train={"eval_batches": windows // 8})
    assert len(eval_batches(make_eval_source(ok), ok, batch_sharding(ok, 8))) == windows // 8
    with pytest.raises(DataError, match=f"holds {meta['val']['n_tokens']} tokens, {windows} windows .* lower "
                                        f"train.eval_batches to {windows // 8}"):
        make_eval_source(ok.replace(train={"eval_batches": windows // 8 + 1}))
    plain = tiny(data={"source": os.path.join(ds, "train.bin")})
    with pytest.raises(DataError, match="single token file with no validation split"):
        make_eval_source(plain)


# --------------------------------------------------------------------------------------------
# data.document_mask: where documents end (`document_eos`) and synthetic rows that pack documents


def test_synthetic_documents_end_at_eos_only(tiny):
    cfg = tiny(data={"document_mask": True})  # vocab_size 64, seq_len 16
    assert document_eos(cfg) == 63 and document_eos(tiny()) is None
    src = make_source(cfg)
    rows = src.rows(0, range(256))
    assert rows.shape == (256, 17) and rows.dtype == np.int32 and rows.min() >= 0 and rows.max() <= 63
    n_docs = []
    for row in rows:
        ends = np.flatnonzero(row == 63)
        starts = [0, *(ends + 1)]
        assert all(e - s >= 1 for s, e in zip(starts, ends)), row  # every document has a token before its EOS
        for s, e in zip(starts, [*ends, len(row)]):  # inside a document: the chain, whose successors exclude EOS
            assert all(b in src.successors[a] for a, b in zip(row[s:e - 1], row[s + 1:e])), row
        n_docs.append(len([s for s in starts if s < len(row)]))
    assert 3 <= np.mean(n_docs) <= 5 and np.mean([2 <= n <= 6 for n in n_docs]) > 0.9, np.bincount(n_docs)
    assert 0 < SyntheticSource(64, 16, 0).entropy < src.entropy < np.log(64)  # a start per document costs more


def test_synthetic_documents_are_a_function_of_seed_step_row_and_stream(tiny):
    cfg = tiny(data={"document_mask": True})
    src = make_source(cfg)
    whole = src.rows(5, range(8))
    np.testing.assert_array_equal(np.concatenate([src.rows(5, range(3)), make_source(cfg).rows(5, range(3, 8))]), whole)
    assert not np.array_equal(src.rows(6, range(8)), whole)
    assert not np.array_equal(make_source(cfg.replace(train={"seed": 1})).rows(5, range(8)), whole)
    val = make_eval_source(cfg)
    assert val.documents and not np.array_equal(val.rows(5, range(8)), whole)
    # Without document_mask, the rows are the plain chain's, whose successors include id 63.
    plain = make_source(tiny())
    assert not plain.documents and not np.array_equal(plain.rows(5, range(8)), whole)


def test_document_eos_of_a_prepared_directory_is_its_tokenizers(tiny, tmp_path):
    from test_prepare import _word_tokenizer

    (tmp_path / "a.txt").write_text("alpha beta gamma\n" * 200)
    (tmp_path / "b.txt").write_text("delta epsilon\n" * 200)
    tok = _word_tokenizer(tmp_path, ["alpha beta gamma delta epsilon"])  # "</s>" is id 1
    prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], str(tmp_path / "ds"), tok, val_fraction=0)
    cfg = tiny(data={"source": str(tmp_path / "ds"), "document_mask": True})
    assert document_eos(cfg) == 1
    assert document_eos(cfg.replace(data={"document_mask": False})) is None
    make_source(cfg)  # accepted
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    del meta["eos_id"]  # a dataset from before meta.json recorded it: no EOS known
    (tmp_path / "ds" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="eos_id null"):
        document_eos(cfg)


def test_document_mask_refuses_data_without_document_ends(tiny, tmp_path):
    ds, _ = _prepared(tmp_path)  # byte tokenizer: documents separated by a blank line
    cfg = tiny(model={"vocab_size": 256}, data={"source": ds, "document_mask": True})
    for make in (document_eos, make_source):
        with pytest.raises(DataError) as e:
            make(cfg)
        msg = str(e.value)
        assert msg.count(". ") == 0 and msg.endswith(".") and "eos_id null" in msg and "byte" in msg, msg
        assert "tokenizer.json that has an EOS token, or set data.document_mask=false" in msg, msg
    make_source(cfg.replace(data={"document_mask": False}))  # the same data without it: accepted
    plain = cfg.replace(data={"source": os.path.join(ds, "train.bin")})
    for make in (document_eos, make_source):
        with pytest.raises(DataError, match=r"plain token file with no record of where its documents end; prepare "
                                            r"the text with `python -m jaxpar.data prepare --tokenizer"):
            make(plain)
    with pytest.raises(DataError, match="does not exist"):  # a missing file is named as missing first
        make_source(plain.replace(data={"source": str(tmp_path / "missing.bin")}))
