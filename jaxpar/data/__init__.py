"""Prepared datasets: text files -> train and validation token files + meta.json, and reading them back.

`python -m jaxpar.data prepare` (jaxpar/data/__main__.py) is the command line of `prepare`.

Documents: a `.txt` file is one document; each line of a `.jsonl` file is one (its `text` field).
Every document is followed by the tokenizer's EOS id, or, for a tokenizer without one (`byte`),
by its encoding of a blank line "\\n\\n". Empty documents are skipped.

Split: each document is cut into chunks of whole lines, a chunk ending at the first line end at
or after CHUNK_CHARS characters (never before a blank line), and each chunk is tokenized on its
own. Chunks are taken in order (inputs in command-line order, the files of a directory or glob
sorted by path) and a chunk goes to `val` when that brings the validation token count closer to
val_fraction x (tokens so far); otherwise to `train`. So validation text is spread evenly over
the corpus, and |val tokens - val_fraction x all tokens| <= half the largest chunk's tokens.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable, Iterator, Sequence

import numpy as np

from jaxpar.errors import DataError, JaxparError  # noqa: F401  (DataError: jaxpar.data.DataError, public)
from jaxpar.files import publish
from jaxpar.tokenizer import Tokenizer, load_tokenizer

CHUNK_CHARS = 4096
"""Chunks (the unit of the train/val split) close at the first line end past this many characters."""
FORMAT = "jaxpar.data/1"
"""meta.json's `format`: what `data.source: DIR` knows how to read."""
EXTENSIONS = (".txt", ".jsonl")
SPLITS = ("train", "val")




# --------------------------------------------------------------------------------------------
# Inputs


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """The input files, in argument order: a file as given; a directory's or a glob's `.txt` and
    `.jsonl` files (recursively; hidden names skipped, as glob does) sorted by path; duplicates once."""
    if not patterns:
        raise DataError("no input given; pass text files, directories or globs, e.g. `--input 'corpus/**/*.txt'`.")
    files, seen = [], set()
    for pattern in patterns:
        found = _expand(pattern)
        if not found:
            raise DataError(f"input {pattern!r} matches no .txt or .jsonl file; check the path or the glob "
                            "(quote it so the shell does not expand it).")
        for path in found:
            key = os.path.abspath(path)
            if key not in seen:
                seen.add(key)
                files.append(os.path.normpath(path))
    for path in files:
        if not os.access(path, os.R_OK):
            raise DataError(f"input file {path!r} cannot be read (permission denied); make it readable or leave it out.")
    return files


def _expand(pattern: str) -> list[str]:
    if os.path.isdir(pattern):
        return _walk(pattern)
    if os.path.isfile(pattern):
        return [_check_extension(pattern, pattern)]
    if not glob.has_magic(pattern):
        raise DataError(f"input {pattern!r} does not exist; pass an existing file, directory or glob.")
    out = []
    for match in sorted(glob.glob(pattern, recursive=True)):
        out += _walk(match) if os.path.isdir(match) else [_check_extension(match, pattern)]
    return out


def _walk(root: str) -> list[str]:
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        out += [os.path.join(d, n) for n in names if n.endswith(EXTENSIONS) and not n.startswith(".")]
    return sorted(out)


def _check_extension(path: str, pattern: str) -> str:
    if not path.endswith(EXTENSIONS):
        origin = "" if path == pattern else f" (matched by {pattern!r})"
        raise DataError(f"input file {path!r}{origin} is neither .txt nor .jsonl; convert it, or narrow the input "
                        "to .txt and .jsonl files.")
    return path


# --------------------------------------------------------------------------------------------
# Documents and chunks


def _lines(path: str, progress: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    """(line number, text) of a file read as UTF-8, line ends kept exactly ("\\r\\n" too)."""
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                progress(len(raw))
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"input file {path!r} line {number} is not valid UTF-8 ({e.reason} at byte "
                                    f"{e.start} of the line); convert the file to UTF-8.") from None
    except OSError as e:
        raise DataError(f"input file {path!r} cannot be read ({e.__class__.__name__}: {e.strerror or e}); "
                        "make it readable or leave it out.") from None


def _records(path: str, progress: Callable[[int], None], like: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each non-blank line of a .jsonl file; `like` shows a line."""
    for number, line in _lines(path, progress):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"input file {path!r} line {number} is not valid JSON (column {e.colno}: {e.msg}); "
                            f"write one object per line, like {like}.") from None


def _documents(path: str, progress: Callable[[int], None]) -> Iterator[Iterator[str]]:
    """Each document of a file, as an iterator over its lines."""
    if path.endswith(".txt"):
        yield (line for _, line in _lines(path, progress))
        return
    for number, record in _records(path, progress, '{"text": "..."}'):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"input file {path!r} line {number} has no string field `text`; write one object per "
                            "line, like {\"text\": \"...\"}.")
        yield iter(record["text"].splitlines(keepends=True))


def _conversations(path: str, progress: Callable[[int], None]) -> Iterator[list[dict]]:
    """The messages of each conversation of a .jsonl file (`prepare --chat`)."""
    from jaxpar.data.chat import check_conversation

    for number, record in _records(path, progress, '{"messages": [...]}'):
        yield check_conversation(record, f"input file {path!r} line {number}")


def _chunks(lines: Iterator[str]) -> Iterator[str]:
    """Whole lines grouped into chunks that close at the first line end past CHUNK_CHARS characters,
    but never just before a blank line (a paragraph's trailing blank lines stay with it)."""
    buf: list[str] = []
    size = 0
    for line in lines:
        if size >= CHUNK_CHARS and line.strip("\r\n"):
            yield "".join(buf)
            buf, size = [], 0
        buf.append(line)
        size += len(line)
    if buf:
        yield "".join(buf)


def _encode(tok: Tokenizer, text: str) -> np.ndarray:
    if tok.name == "byte":  # the same ids as tok.encode, without a Python list per byte
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    return np.asarray(tok.encode(text), np.int64)


def _with_separator(chunks: Iterator[np.ndarray], sep: np.ndarray) -> Iterator[tuple[np.ndarray, bool]]:
    """(ids, is last) of a document's chunks, `sep` appended to the last: one chunk of lookahead,
    so a long document is never held whole."""
    prev = None
    for ids in chunks:
        if prev is not None:
            yield prev, False
        prev = ids
    if prev is not None:
        yield np.concatenate([prev, sep]), True


def separator(tok: Tokenizer) -> list[int]:
    """The ids that follow every document: [eos_id], or the encoding of a blank line."""
    return [tok.eos_id] if tok.eos_id is not None else [int(i) for i in _encode(tok, "\n\n")]


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# --------------------------------------------------------------------------------------------
# prepare


def prepare(inputs: Sequence[str], out: str, tokenizer: str = "byte", val_fraction: float = 0.01, *,
            force: bool = False, progress: Callable[[int], None] | None = None, chat: bool = False) -> dict:
    """Tokenize `inputs` (files, directories, globs) into `out`/train.bin, val.bin and meta.json.

    With `chat`, every input is a .jsonl of conversations (`{"messages": [...]}` per line), each
    rendered with the tokenizer folder's chat template (`jaxpar.data.chat`) and kept whole (one
    chunk, never split between train and val); `train.mask.bin` and `val.mask.bin` (one uint8 per
    token) say which tokens the loss learns: those of the assistant turns.

    Everything is written under a temporary name next to `out` and renamed at the end, so `out`
    holds either nothing or a complete dataset. `force` replaces an existing prepared dataset
    (never any other directory). `progress(n)` is called with the input bytes read since the last
    call. Returns the metadata (as written to meta.json).
    """
    if not (isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1):
        raise DataError(f"--val-fraction {val_fraction} must lie in [0, 1) (the share of tokens held out for "
                        "validation); pass e.g. 0.01, or 0 for no validation split.")
    files = expand_inputs(inputs)
    out = os.path.normpath(out)  # "data/out/" and "data/out" are one directory to rename onto
    _check_out(out, force)
    tok = load_tokenizer(tokenizer)
    template = None
    if chat:
        from jaxpar.data.chat import ChatTemplate, encode_conversation

        bad = [f for f in files if not f.endswith(".jsonl")]
        if bad:
            raise DataError(f"--chat reads conversations from .jsonl files, but {_some(bad)} is not one; give only "
                            ".jsonl files of {\"messages\": [...]} lines.")
        if tok.encode_offsets is None:
            raise DataError("--chat needs a tokenizer.json with a chat template beside it (tokenizer_config.json), "
                            "not the byte tokenizer; pass --tokenizer with a chat model's folder.")
        template = ChatTemplate(tokenizer)
    progress = progress or (lambda n: None)
    sep = np.asarray(separator(tok), np.int64)
    dtype = token_dtype(tok.vocab_size)

    parent = os.path.dirname(os.path.abspath(out))
    try:
        created = _makedirs(parent)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.tmp-", dir=parent)
    except OSError as e:
        raise _unwritable(out, e) from None
    try:
        counts = {s: {"file": f"{s}.bin", "n_tokens": 0, "n_chunks": 0} for s in SPLITS}
        if chat:
            for s in SPLITS:
                counts[s].update(mask_file=f"{s}.mask.bin", n_learned=0)
        n_docs = 0
        handles = {s: open(os.path.join(tmp, f"{s}.bin"), "wb") for s in SPLITS}
        masks = {s: open(os.path.join(tmp, f"{s}.mask.bin"), "wb") for s in SPLITS} if chat else {}
        try:
            for path in files:
                if chat:
                    for messages in _conversations(path, progress):
                        ids, mask = encode_conversation(template, tok.encode_offsets, messages)
                        ids, mask = np.concatenate([ids, sep]), np.concatenate([mask, np.zeros(len(sep), np.uint8)])
                        split = _assign(len(ids), counts, val_fraction)
                        handles[split].write(ids.astype(dtype).tobytes())
                        masks[split].write(mask.tobytes())
                        counts[split]["n_tokens"] += len(ids)
                        counts[split]["n_learned"] += int(mask.sum())
                        counts[split]["n_chunks"] += 1
                        n_docs += 1
                    continue
                for doc in _documents(path, progress):
                    for ids, last in _with_separator((_encode(tok, c) for c in _chunks(doc)), sep):
                        split = _assign(len(ids), counts, val_fraction)
                        handles[split].write(ids.astype(dtype).tobytes())
                        counts[split]["n_tokens"] += len(ids)
                        counts[split]["n_chunks"] += 1
                        n_docs += last
        finally:
            for h in [*handles.values(), *masks.values()]:
                h.close()
        _check_splits(counts, val_fraction, files)
        meta = {
            "format": FORMAT, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "separator": sep.tolist(), "dtype": dtype, "val_fraction": float(val_fraction), "chunk_chars": CHUNK_CHARS,
            "n_documents": n_docs, "n_bytes": sum(os.path.getsize(p) for p in files), **counts, "inputs": files,
        }
        if chat:
            meta["chat_template"] = template.path
        if tok.name != "byte":  # the dataset carries its tokenizer, so that its ids can be decoded later
            shutil.copyfile(tok.name, os.path.join(tmp, "tokenizer.json"))
            with open(tok.name, "rb") as f:
                meta["tokenizer_sha256"] = hashlib.sha256(f.read()).hexdigest()
            meta["tokenizer_file"] = "tokenizer.json"
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        _publish(tmp, out)
        return meta
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(created):  # only the directories this call made, and only if still empty
            try:
                os.rmdir(d)
            except OSError:
                break
        if isinstance(e, OSError):  # reading the inputs raises DataErrors: this is the writing
            raise _unwritable(out, e) from None
        raise


def _unwritable(out: str, e: OSError) -> DataError:
    return DataError(f"--out {out!r} cannot be written ({e.strerror or e}); pass a path in a folder you can write "
                     "to, with room for the dataset.")


def _assign(n: int, counts: dict, fraction: float) -> str:
    # Greedy on the deficit d = fraction x total - val: val when that leaves |d| smaller. Keeps
    # |d| <= n_max / 2 after every chunk, and interleaves val chunks with train chunks evenly.
    total = counts["train"]["n_tokens"] + counts["val"]["n_tokens"] + n
    deficit = fraction * total - counts["val"]["n_tokens"]
    return "val" if deficit > n / 2 else "train"


def _check_splits(counts: dict, fraction: float, files: list[str]) -> None:
    total = counts["train"]["n_tokens"] + counts["val"]["n_tokens"]
    if total == 0:
        raise DataError(f"the inputs ({_some(files)}) hold no text; give files with text in them.")
    if fraction > 0 and counts["val"]["n_tokens"] == 0:
        raise DataError(f"--val-fraction {fraction} of {total} tokens left the validation split empty (the split "
                        f"moves whole chunks of about {CHUNK_CHARS} characters); give more text, a larger "
                        "--val-fraction, or --val-fraction 0.")
    if counts["train"]["n_tokens"] == 0:
        raise DataError(f"--val-fraction {fraction} left the train split empty; give more text or a smaller fraction.")


def _some(files: list[str]) -> str:
    return ", ".join(repr(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "meta.json"))


def _check_out(out: str, force: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"--out {out!r} is an existing file; pass a new directory path.")
    if os.path.isdir(out) and os.listdir(out):
        if not is_prepared(out):
            raise DataError(f"--out {out!r} is a directory holding other files; pass a new or empty directory "
                            "(prepare replaces only a directory it wrote itself).")
        if not force:
            raise DataError(f"--out {out!r} already holds a prepared dataset; pass --force to replace it, "
                            "or choose another --out.")
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise DataError(f"--out {out!r} cannot be created ({existing!r} is not a writable directory); "
                        "pass a path in a writable directory.")


def _makedirs(path: str) -> list[str]:
    """Create `path` and its missing parents; return those created, outermost first."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        os.mkdir(d)
    return list(reversed(missing))


def _publish(tmp: str, out: str) -> None:
    """Rename the finished temporary directory to `out`; an old dataset there is removed only after."""
    old = None
    if os.path.isdir(out) and os.listdir(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.old-",
                               dir=os.path.dirname(os.path.abspath(out)))
        os.rename(out, os.path.join(old, "dataset"))
    elif os.path.isdir(out):
        os.rmdir(out)
    publish(tmp, out)  # with the user's umask: mkdtemp made it 0700
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Reading (the training side)


TEXT_EXTENSIONS = (".txt", ".text", ".md", ".json", ".jsonl", ".csv", ".tsv", ".html", ".xml", ".yaml", ".yml")
SNIFF_BYTES = 1024


def text_reason(path: str) -> str | None:
    """Why the file `path` is text rather than token ids, or None when it may be token ids.

    The rule: a name ending in one of TEXT_EXTENSIONS (.txt, .md, .json, .jsonl, ...), or a first
    KiB that decodes as UTF-8 (a character cut at the end of the KiB allowed, a BOM skipped) into
    printable characters and whitespace only. Token files of uint16 or uint32 ids fail the sniff:
    each id below 256 (and every uint32 id below 2^24) puts a zero byte, a control character, in
    the file, and tokenized text has such ids (bytes, punctuation) every few tokens."""
    name = os.path.basename(path).lower()
    if name.endswith(TEXT_EXTENSIONS):
        return f"its name ends in {os.path.splitext(name)[1]}"
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.reason != "unexpected end of data" or e.start < len(head) - 3:
            return None
        text = head[:e.start].decode("utf-8")
    text = text.removeprefix("\ufeff")
    if not text.strip() or not all(c.isprintable() or c in "\t\n\r\f\v" for c in text):
        return None
    return f"its first {min(len(head), SNIFF_BYTES)} bytes are printable UTF-8 text"


def refuse_text(path: str) -> None:
    """Raise a DataError naming `jaxpar.data prepare` if the token file `path` is text (`text_reason`)."""
    why = text_reason(path)
    if why is None:
        return
    if path.endswith(EXTENSIONS):
        fix = f"tokenize it with `python -m jaxpar.data prepare --input {path} --out DIR`"
    else:  # prepare reads .txt and .jsonl files only
        fix = "rename it to a .txt file and tokenize that with `python -m jaxpar.data prepare --input FILE.txt --out DIR`"
    raise DataError(f"data file {path!r} is text, not token ids ({why}); {fix}, then set data.source to DIR.")


def read_meta(directory: str) -> dict:
    """meta.json of a prepared directory, checked against the token files next to it."""
    path = os.path.join(directory, "meta.json")
    if not os.path.isfile(path):
        raise DataError(f"data directory {directory!r} has no meta.json, so it was not written by "
                        "`python -m jaxpar.data prepare`; prepare it with that command, or point data.source "
                        "at a .bin token file.")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        assert meta["format"] == FORMAT and meta["dtype"] in ("uint16", "uint32")
        assert isinstance(meta["vocab_size"], int) and all(isinstance(meta[s]["n_tokens"], int) for s in SPLITS)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise DataError(f"{path!r} is not a readable meta.json of format {FORMAT!r}; prepare the directory "
                        "again with `python -m jaxpar.data prepare`.") from None
    itemsize = np.dtype(meta["dtype"]).itemsize
    for s in SPLITS:
        file = os.path.join(directory, meta[s]["file"])
        if not os.path.isfile(file):
            raise DataError(f"data directory {directory!r} lacks its {s} split {file!r}; prepare the directory "
                            "again with `python -m jaxpar.data prepare`.")
        if os.path.getsize(file) != meta[s]["n_tokens"] * itemsize:
            raise DataError(f"{file!r} has {os.path.getsize(file)} bytes, but meta.json says {meta[s]['n_tokens']} "
                            f"{meta['dtype']} tokens; the file was changed or truncated, prepare the directory again.")
        mask = os.path.join(directory, meta[s]["mask_file"]) if "mask_file" in meta[s] else None
        if mask is not None and (not os.path.isfile(mask) or os.path.getsize(mask) != meta[s]["n_tokens"]):
            raise DataError(f"{mask!r} should hold one loss-mask byte per token of {file!r} ({meta[s]['n_tokens']}); "
                            "the file is missing or truncated, prepare the directory again.")
    return meta
