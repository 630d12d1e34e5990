"""Training and validation batches: a synthetic Markov language, memory-mapped token files, and
directories written by `python -m jaxpar.data prepare` (train.bin, val.bin, meta.json).

The batch of step k is a function of (seed, k) only, row by row: never of the mesh or of the
process count. Each process builds just the rows its devices hold and assembles the global array
with `jax.make_array_from_process_local_data`. Validation batches follow the same rule and are
the same ones at every evaluation.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.config import Config
from jaxpar.data import DataError, read_meta, refuse_text

__all__ = ["DataError", "SyntheticSource", "TokenFileSource", "EvalWindows", "make_source", "make_eval_source",
           "document_eos", "batch_at", "eval_batches"]

EVAL_STREAM = 0xE7A1
"""Tags the synthetic language's validation rows: the same chain, an independent stream of draws."""


def _row_rng(seed: int, step: int, row: int, stream: int | None = None) -> np.random.Generator:
    # One stream per (seed, step, row): any process can build any row without the others.
    return np.random.default_rng([seed, step, row] if stream is None else [seed, stream, step, row])


class SyntheticSource:
    """A seeded first-order Markov language: each token has 4 successors with probabilities
    0.6 / 0.25 / 0.1 / 0.05, so the best possible loss is the chain's entropy rate (~1.03 nats),
    far below the log(vocab) of a model that has learned nothing.

    With `documents` (data.document_mask), each row packs documents: each starts at a uniform id,
    follows the chain (whose successors are then drawn from ids below vocab_size - 1) for a
    geometric number of tokens and ends with EOS = vocab_size - 1, the only place EOS appears.
    A row starts at a document start; documents average about seq_len / 3 tokens with their EOS,
    so a row holds parts of about 4."""

    PROBS = np.array([0.6, 0.25, 0.1, 0.05])

    def __init__(self, vocab_size: int, seq_len: int, seed: int, stream: int | None = None,
                 documents: bool = False):
        # `stream` (EVAL_STREAM for validation) draws other rows from the same chain.
        self.seq_len, self.seed, self.stream, self.documents = seq_len, seed, stream, documents
        self.vocab_size = vocab_size
        table_rng = np.random.default_rng([seed, 0x5EED])
        ids = vocab_size - 1 if documents else vocab_size  # with documents, EOS is no successor
        self.successors = table_rng.integers(0, ids, size=(vocab_size, len(self.PROBS)))

    @property
    def eos(self) -> int | None:
        """The id that ends each document (with `documents`), else None."""
        return self.vocab_size - 1 if self.documents else None

    @property
    def end_probability(self) -> float:
        """With `documents`: the chance that a document's token is its last before EOS (a
        document holds a geometric number >= 1 of them, mean max(seq_len / 3, 2) - 1)."""
        return 1.0 / (max(self.seq_len / 3, 2.0) - 1.0)

    @property
    def entropy(self) -> float:
        """Entropy rate in nats per token: the loss of a perfect model. With `documents`, the
        long-run rate of the packed stream: after a document's token, EOS or the chain (a binary
        choice of end_probability, then the chain's entropy), after EOS a uniform start
        (log(vocab_size - 1)); a row's first document starting at position 0 moves a row's
        expected loss slightly off it."""
        chain = float(-(self.PROBS * np.log(self.PROBS)).sum())
        if not self.documents:
            return chain
        p = self.end_probability
        binary = 0.0 if p >= 1 else float(-p * np.log(p) - (1 - p) * np.log(1 - p))
        mean_tokens = 1 / p  # a document's tokens before its EOS: each one's successor is a choice
        return (mean_tokens * (binary + (1 - p) * chain) + np.log(self.vocab_size - 1)) / (mean_tokens + 1)

    def rows(self, step: int, rows: range) -> np.ndarray:
        """Token windows [len(rows), seq_len + 1] of step `step` (inputs and shifted targets)."""
        if self.documents:
            return self._document_rows(step, rows)
        n = self.seq_len + 1
        starts = np.empty(len(rows), np.int64)
        choices = np.empty((len(rows), n - 1), np.int64)
        for i, r in enumerate(rows):
            rng = _row_rng(self.seed, step, r, self.stream)
            starts[i] = rng.integers(0, self.successors.shape[0])
            choices[i] = rng.choice(len(self.PROBS), size=n - 1, p=self.PROBS)
        out = np.empty((len(rows), n), np.int32)
        out[:, 0] = starts
        for t in range(1, n):
            out[:, t] = self.successors[out[:, t - 1], choices[:, t - 1]]
        return out

    def _document_rows(self, step: int, rows: range) -> np.ndarray:
        n, eos = self.seq_len + 1, self.eos
        fresh = np.empty((len(rows), n), np.int64)  # the id a document starting at t starts with
        choices = np.empty((len(rows), n), np.int64)
        ends = np.zeros((len(rows), n), bool)  # EOS at t
        for i, r in enumerate(rows):
            rng = _row_rng(self.seed, step, r, self.stream)
            fresh[i] = rng.integers(0, eos, size=n)
            choices[i] = rng.choice(len(self.PROBS), size=n, p=self.PROBS)
            lengths = rng.geometric(self.end_probability, size=n // 2 + 1) + 1  # tokens with the EOS
            at = np.cumsum(lengths) - 1
            ends[i, at[at < n]] = True
        out = np.empty((len(rows), n), np.int32)
        out[:, 0] = fresh[:, 0]
        for t in range(1, n):
            chain = self.successors[out[:, t - 1], choices[:, t]]
            out[:, t] = np.where(ends[:, t], eos, np.where(ends[:, t - 1], fresh[:, t], chain))
        return out


def _open_tokens(path: str, dtype: str) -> np.ndarray:
    """A token file, memory-mapped (an empty file as an empty array: mmap refuses length 0)."""
    if not os.path.isfile(path):
        raise DataError(f"data file {path!r} does not exist; set data.source to an existing token file, "
                        "a prepared directory or `synthetic`.")
    itemsize = np.dtype(dtype).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise DataError(f"data file {path!r} has {size} bytes, not a multiple of {itemsize} ({dtype}); "
                        f"check data.dtype (uint16 or uint32) matches how the file was written.")
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def with_mask(tokens: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """A window's ids as the step reads them: a token the loss does not learn (mask 0; chat data's
    context) as its bitwise complement ~id = -id - 1, which the model reads back as id
    (`model.transformer.token_ids`) and the loss skips as a target (`train.step.cross_entropy_sum`)."""
    out = tokens.astype(np.int32)
    return out if mask is None else np.where(mask.astype(bool), out, ~out)


class TokenFileSource:
    """A flat binary file of token ids (uint16 or uint32, as nanoGPT and Megatron write them),
    memory-mapped; row r of step k is a window at an offset drawn from (seed, k, r). Unless
    check_ids is false, a file that is text (`jaxpar.data.text_reason`) is refused, naming
    `python -m jaxpar.data prepare`."""

    def __init__(self, path: str, dtype: str, vocab_size: int, seq_len: int, seed: int, check_ids: bool = True,
                 mask_path: str | None = None):
        # check_ids=False when meta.json vouches for the ids (a prepared directory): no pass over the file.
        if check_ids and os.path.isfile(path):
            refuse_text(path)  # a .txt given as data.source: its bytes are no ids, whatever vocab_size says
        self.tokens = _open_tokens(path, dtype)
        self.mask = None if mask_path is None else _open_tokens(mask_path, "uint8")
        self.seq_len, self.seed = seq_len, seed
        n = len(self.tokens)
        if n < seq_len + 1:
            raise DataError(f"data file {path!r} holds {n} tokens, fewer than one sequence plus one token "
                            f"(model.seq_len + 1 = {seq_len + 1}); use a longer file or a smaller model.seq_len.")
        top = self._max_token() if check_ids else -1
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
            out[i] = with_mask(self.tokens[start:start + n], None if self.mask is None else self.mask[start:start + n])
        return out


class EvalWindows:
    """A fixed validation set: n_windows windows of seq_len + 1 tokens, spread evenly over a token
    file (first at 0, last at the end), not overlapping (consecutive windows may share one edge
    token, never a predicted one). Row r of batch i is window i * global_batch + r."""

    def __init__(self, tokens: np.ndarray, seq_len: int, n_windows: int, global_batch: int,
                 mask: np.ndarray | None = None):
        self.tokens, self.seq_len, self.global_batch, self.mask = tokens, seq_len, global_batch, mask
        span = len(tokens) - (seq_len + 1)
        assert n_windows >= 1 and span >= (n_windows - 1) * seq_len, (len(tokens), n_windows, seq_len)
        self.starts = np.arange(n_windows, dtype=np.int64) * span // max(n_windows - 1, 1)

    def rows(self, step: int, rows: range) -> np.ndarray:
        n = self.seq_len + 1
        out = np.empty((len(rows), n), np.int32)
        for i, r in enumerate(rows):
            start = int(self.starts[step * self.global_batch + r])
            out[i] = with_mask(self.tokens[start:start + n], None if self.mask is None else self.mask[start:start + n])
        return out


def _prepared_meta(cfg: Config) -> dict:
    """meta.json of the prepared directory data.source, checked against the model's vocabulary."""
    directory, m = cfg.data.source, cfg.model
    meta = read_meta(directory)
    if meta["vocab_size"] > m.vocab_size:
        raise DataError(f"data directory {directory!r} was tokenized with vocab_size {meta['vocab_size']} "
                        f"({meta['tokenizer']}), more than model.vocab_size = {m.vocab_size}; set "
                        f"model.vocab_size to at least {meta['vocab_size']}, or prepare the data with a "
                        "tokenizer that fits the model.")
    return meta


def document_eos(cfg: Config) -> int | None:
    """The id that ends each document under data.document_mask (None without it): `synthetic`'s
    vocab_size - 1, a prepared directory's tokenizer EOS (meta.json `eos_id`). Data with no record
    of where its documents end (a plain token file; a directory prepared without an EOS, whose
    documents are separated by a blank line) is refused with a DataError, before compiling."""
    if not cfg.data.document_mask:
        return None
    src = cfg.data.source
    if src == "synthetic":
        return cfg.model.vocab_size - 1
    if not os.path.isdir(src):
        raise DataError(f"data.document_mask is true, but data.source = {src!r} is a plain token file with no "
                        "record of where its documents end; prepare the text with `python -m jaxpar.data prepare "
                        "--tokenizer TOKENIZER.json` (a tokenizer with an EOS token, which ends every document) and "
                        "set data.source to that directory, or set data.document_mask=false.")
    meta = read_meta(src)
    eos = meta.get("eos_id")  # a directory of an older format without the key: no EOS recorded
    if eos is None:
        raise DataError(f"data.document_mask is true, but data directory {src!r} has eos_id null in its meta.json "
                        f"(its tokenizer, {meta.get('tokenizer')}, has no EOS token, so its documents are separated "
                        "by a blank line, not an id that ends them); prepare it again with `--tokenizer` a "
                        "tokenizer.json that has an EOS token, or set data.document_mask=false.")
    return int(eos)


def make_source(cfg: Config) -> SyntheticSource | TokenFileSource:
    """The configured training source, with every check that can fail done now (before compiling).

    A prepared directory gives its train split, in the dtype its meta.json records (data.dtype is
    then ignored); its vocab_size must not exceed model.vocab_size. With data.document_mask, the
    data must record where its documents end (`document_eos`); `synthetic` then packs documents.
    """
    m = cfg.model
    if cfg.data.source == "synthetic":
        return SyntheticSource(m.vocab_size, m.seq_len, cfg.train.seed, documents=document_eos(cfg) is not None)
    if os.path.isdir(cfg.data.source):
        meta = _prepared_meta(cfg)
        path = os.path.join(cfg.data.source, meta["train"]["file"])
        mask = meta["train"].get("mask_file")
        source = TokenFileSource(path, meta["dtype"], m.vocab_size, m.seq_len, cfg.train.seed, check_ids=False,
                                 mask_path=None if mask is None else os.path.join(cfg.data.source, mask))
        document_eos(cfg)  # after the directory's own checks
        return source
    if os.path.isfile(cfg.data.source):  # a missing file is named as missing; an existing one is not scanned first
        document_eos(cfg)
    return TokenFileSource(cfg.data.source, cfg.data.dtype, m.vocab_size, m.seq_len, cfg.train.seed)


def make_eval_source(cfg: Config) -> SyntheticSource | EvalWindows:
    """The validation source of train.eval_batches batches of train.global_batch rows.

    `synthetic`: the training chain, rows drawn from an independent stream (EVAL_STREAM), batch i
    of (seed, i). A prepared directory: EvalWindows over its val split, which must hold
    eval_batches x global_batch non-overlapping windows. A plain token file has no validation
    split and is refused.
    """
    m, tr, src = cfg.model, cfg.train, cfg.data.source
    if src == "synthetic":
        return SyntheticSource(m.vocab_size, m.seq_len, tr.seed, stream=EVAL_STREAM,
                               documents=document_eos(cfg) is not None)
    if not os.path.isdir(src):
        raise DataError(f"data.source = {src!r} is a single token file with no validation split, so evaluation "
                        f"(train.eval_every = {tr.eval_every}) has nothing to use; prepare a train/val directory "
                        "with `python -m jaxpar.data prepare` and point data.source at it, or set train.eval_every=0.")
    meta = _prepared_meta(cfg)
    path = os.path.join(src, meta["val"]["file"])
    tokens = _open_tokens(path, meta["dtype"])
    need = tr.eval_batches * tr.global_batch
    have = max(len(tokens) - 1, 0) // m.seq_len  # windows of seq_len + 1 tokens sharing one edge token
    if have < need:
        fix = (f"lower train.eval_batches to {have // tr.global_batch}" if have >= tr.global_batch else
               "set train.eval_every=0")
        raise DataError(f"validation split {path!r} holds {len(tokens)} tokens, {have} windows of model.seq_len + 1 "
                        f"= {m.seq_len + 1}, fewer than train.eval_batches x train.global_batch = "
                        f"{tr.eval_batches} x {tr.global_batch} = {need}; {fix}, or prepare the data with a larger "
                        "--val-fraction.")
    mask = meta["val"].get("mask_file")
    return EvalWindows(tokens, m.seq_len, need, tr.global_batch,
                       None if mask is None else _open_tokens(os.path.join(src, mask), "uint8"))


def has_loss_mask(cfg: Config) -> bool:
    """Whether data.source is a prepared directory with a loss mask (`prepare --chat`)."""
    src = cfg.data.source
    return src != "synthetic" and os.path.isdir(src) and "mask_file" in read_meta(src)["train"]


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


def eval_batches(source, cfg: Config, sharding: NamedSharding) -> list[jax.Array]:
    """The train.eval_batches validation batches [global_batch, seq_len + 1], built like batch_at
    (batch i is `batch_at(source, i, ...)`): the same arrays on every call, mesh and process count."""
    return [batch_at(source, i, cfg.train.global_batch, sharding) for i in range(cfg.train.eval_batches)]
