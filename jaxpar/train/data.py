"""Training batches: a synthetic Markov language and memory-mapped token files.

The batch of step k is a function of (seed, k) only, row by row: never of the mesh or of the
process count. Each process builds just the rows its devices hold and assembles the global array
with `jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.config import Config, JaxparError


class DataError(JaxparError, ValueError):
    """A data file that cannot serve the configured model (missing, too short, bad token ids)."""


def _row_rng(seed: int, step: int, row: int) -> np.random.Generator:
    # One stream per (seed, step, row): any process can build any row without the others.
    return np.random.default_rng([seed, step, row])


class SyntheticSource:
    """A seeded first-order Markov language: each token has 4 successors with probabilities
    0.6 / 0.25 / 0.1 / 0.05, so the best possible loss is the chain's entropy rate (~1.03 nats),
    far below the log(vocab) of a model that has learned nothing."""

    PROBS = np.array([0.6, 0.25, 0.1, 0.05])

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.seq_len, self.seed = seq_len, seed
        table_rng = np.random.default_rng([seed, 0x5EED])
        self.successors = table_rng.integers(0, vocab_size, size=(vocab_size, len(self.PROBS)))

    @property
    def entropy(self) -> float:
        """Entropy rate in nats per token: the loss of a perfect model."""
        return float(-(self.PROBS * np.log(self.PROBS)).sum())

    def rows(self, step: int, rows: range) -> np.ndarray:
        """Token windows [len(rows), seq_len + 1] of step `step` (inputs and shifted targets)."""
        n = self.seq_len + 1
        starts = np.empty(len(rows), np.int64)
        choices = np.empty((len(rows), n - 1), np.int64)
        for i, r in enumerate(rows):
            rng = _row_rng(self.seed, step, r)
            starts[i] = rng.integers(0, self.successors.shape[0])
            choices[i] = rng.choice(len(self.PROBS), size=n - 1, p=self.PROBS)
        out = np.empty((len(rows), n), np.int32)
        out[:, 0] = starts
        for t in range(1, n):
            out[:, t] = self.successors[out[:, t - 1], choices[:, t - 1]]
        return out


class TokenFileSource:
    """A flat binary file of token ids (uint16 or uint32, as nanoGPT and Megatron write them),
    memory-mapped; row r of step k is a window at an offset drawn from (seed, k, r)."""

    def __init__(self, path: str, dtype: str, vocab_size: int, seq_len: int, seed: int):
        if not os.path.isfile(path):
            raise DataError(f"data file {path!r} does not exist; set data.source to an existing token file "
                            "or to `synthetic`.")
        itemsize = np.dtype(dtype).itemsize
        size = os.path.getsize(path)
        if size % itemsize:
            raise DataError(f"data file {path!r} has {size} bytes, not a multiple of {itemsize} ({dtype}); "
                            f"check data.dtype (uint16 or uint32) matches how the file was written.")
        self.tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        self.seq_len, self.seed = seq_len, seed
        n = len(self.tokens)
        if n < seq_len + 1:
            raise DataError(f"data file {path!r} holds {n} tokens, fewer than one sequence plus one token "
                            f"(model.seq_len + 1 = {seq_len + 1}); use a longer file or a smaller model.seq_len.")
        top = self._max_token()
        if top >= vocab_size:
            raise DataError(f"data file {path!r} contains token id {top}, but ids must be below "
                            f"model.vocab_size = {vocab_size}; set model.vocab_size to at least {top + 1} "
                            "or re-tokenize the data.")

    def _max_token(self, chunk: int = 1 << 24) -> int:
        return int(max(self.tokens[i:i + chunk].max() for i in range(0, len(self.tokens), chunk)))

    def rows(self, step: int, rows: range) -> np.ndarray:
        n = self.seq_len + 1
        last = len(self.tokens) - n
        out = np.empty((len(rows), n), np.int32)
        for i, r in enumerate(rows):
            start = int(_row_rng(self.seed, step, r).integers(0, last + 1))
            out[i] = self.tokens[start:start + n]
        return out


def make_source(cfg: Config) -> SyntheticSource | TokenFileSource:
    """The configured source, with every check that can fail done now (before compiling)."""
    m = cfg.model
    if cfg.data.source == "synthetic":
        return SyntheticSource(m.vocab_size, m.seq_len, cfg.train.seed)
    return TokenFileSource(cfg.data.source, cfg.data.dtype, m.vocab_size, m.seq_len, cfg.train.seed)


def batch_at(source, step: int, global_batch: int, sharding: NamedSharding) -> jax.Array:
    """The global batch [global_batch, seq_len + 1] of `step`, built from this process's rows only."""
    shape = (global_batch, source.seq_len + 1)
    indices = sharding.addressable_devices_indices_map(shape).values()
    starts = [idx[0].start or 0 for idx in indices]
    stops = [global_batch if idx[0].stop is None else idx[0].stop for idx in indices]
    # The rows this process holds form one contiguous block (the batch dim is split over `data`,
    # and the mesh puts each process's devices in a contiguous run of it).
    local = source.rows(step, range(min(starts), max(stops)))
    return jax.make_array_from_process_local_data(sharding, local, shape)
