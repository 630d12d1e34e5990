"""Tokenizers: text <-> token ids for `data prepare`, `generate` and Hugging Face models.

`byte` needs nothing (ids 0..255 are the UTF-8 bytes); a `tokenizer.json` (a Hugging Face fast
tokenizer, as saved next to every published model) is read with the `tokenizers` package.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

from jaxpar.config import JaxparError


class TokenizerError(JaxparError):
    """A tokenizer that cannot be loaded."""


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    name: str
    """`byte` or the path of the tokenizer.json it was read from."""
    vocab_size: int
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    eos_id: int | None = None


def byte_tokenizer() -> Tokenizer:
    return Tokenizer("byte", 256, lambda text: list(text.encode("utf-8")),
                     lambda ids: bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace"))


def load_tokenizer(spec: str) -> Tokenizer:
    """`"byte"`, a tokenizer.json file, or a folder holding one (a Hugging Face model folder)."""
    if spec == "byte":
        return byte_tokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer {spec!r} is neither `byte` nor a tokenizer.json file (nor a folder "
                             "holding one); pass `byte` or the path of a Hugging Face tokenizer.json.")
    try:
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(path)
    except ImportError:
        raise TokenizerError(f"reading {path!r} needs the `tokenizers` package; `pip install tokenizers`, "
                             "or use the byte tokenizer.") from None
    except Exception as e:  # the Rust library raises a bare Exception on a malformed file
        raise TokenizerError(f"tokenizer file {path!r} cannot be read ({e}); pass a valid tokenizer.json.") from None
    eos = next((tok.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
                if tok.token_to_id(t) is not None), None)
    return Tokenizer(path, tok.get_vocab_size(), lambda text: tok.encode(text, add_special_tokens=False).ids,
                     lambda ids: tok.decode([int(i) for i in ids]), eos)
