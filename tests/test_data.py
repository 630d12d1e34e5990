"""Batches depend only on (seed, step): never on the mesh; token files give the right windows."""

import jax
import numpy as np
import pytest

from jaxpar.mesh import make_mesh
from jaxpar.sharding import NamedSharding, compute_rules
from jaxpar.train.data import SyntheticSource, TokenFileSource, batch_at, make_source


def sharded_batch(cfg, step, data):
    mesh = make_mesh(cfg.replace(mesh={"data": data}), jax.devices()[:data])
    sharding = NamedSharding(mesh, compute_rules(cfg, mesh).spec(("batch", None)))
    return batch_at(make_source(cfg), step, cfg.train.global_batch, sharding)


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
