"""What the Hugging Face modules share: `HFError`, the one sentence of a refused config.json
setting (`refuse`), the record of one parameter's HF tensor (`Entry`), and publishing a finished
folder with its tokenizer files."""

from __future__ import annotations

import os
from typing import NamedTuple

from jaxpar.errors import JaxparError
from jaxpar.files import publish as _publish

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class HFError(JaxparError):
    """A Hugging Face folder that jaxpar cannot read or write."""


def refuse(ok: bool, path: str, what: str, why: str) -> None:
    """Raise HFError "`path` sets `what`, but `why`." unless `ok`."""
    if not ok:
        raise HFError(f"{path!r} sets {what}, but {why}.")


# --------------------------------------------------------------------------------------------
# Which HF tensor each jaxpar parameter comes from, and how (the maps: `tensors.entries`, `moe.entries`)


class Entry(NamedTuple):
    """One jaxpar parameter and the HF tensor it is read from and written as."""

    path: tuple[str, ...]   # the jaxpar leaf, e.g. ("blocks", "attn", "wq")
    hf: str                 # HF tensor name; "{i}" is the layer index for `blocks` leaves, "{e}" the expert's
    kind: str               # how the leaf is read from the tensor (see `tensors._read`)
    hf_shape: tuple[int, ...]
    offset: int = 0         # first column of this leaf in a fused tensor (GPT-2's c_attn)
    layers: tuple[int, ...] | None = None  # a mixed model's stack: the model layer ("{i}") of each entry
    head: int = 0           # the head width of a heads kind where it is not model.head_size (MLA's value
    #                         and key-value heads; kv_a_proj_with_mqa: the rows before the rotary ones)


def publish(tmp: str, target: str) -> None:
    """Rename the finished temporary directory `tmp` to `target`, it and its files with the user's
    umask (`jaxpar.files.publish`: mkdtemp makes the folder private, safetensors its files)."""
    _publish(tmp, target)


def tokenizer_files(folder: str) -> dict[str, str]:
    """The tokenizer (and generation) files of a Hugging Face folder that exist, name -> path."""
    return {n: os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))}
