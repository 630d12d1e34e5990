"""Tokenizers: text <-> token ids for `data prepare`, `generate` and Hugging Face models.

`byte` needs nothing (ids 0..255 are the UTF-8 bytes); a `tokenizer.json` (a Hugging Face fast
tokenizer, as saved next to every published model) is read with the `tokenizers` package.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

from jaxpar.errors import JaxparError


class TokenizerError(JaxparError):
    """A tokenizer that cannot be loaded."""


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    name: str
    """`byte` or the path of the tokenizer.json it was read from."""
    vocab_size: int
    encode: Callable[[str], list[int]]
    """Text to ids, nothing added (`data prepare`'s documents)."""
    decode: Callable[[Sequence[int]], str]
    eos_id: int | None = None
    """The end-of-text id that separates documents, if the vocabulary has one."""
    encode_prompt: Callable[[str], list[int]] | None = None
    """A prompt to ids as the family's tokenizer makes one: with the special tokens its
    tokenizer.json's post-processor adds (Llama 2 and 3, Mistral: a BOS; Qwen, GPT-2: none)."""
    stop_ids: tuple[int, ...] = ()
    """Ids generation stops at: generation_config.json's eos_token_id (an id or a list, e.g.
    Llama 3.1's end_of_text, eom and eot), else eos_id."""

    encode_offsets: Callable[[str], tuple[list[int], list[tuple[int, int]]]] | None = None
    """Text to ids and each id's (start, end) character offsets, nothing added (`prepare --chat`)."""

    def prompt_ids(self, text: str) -> list[int]:
        return (self.encode_prompt or self.encode)(text)


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
    stop = _generation_stop_ids(os.path.join(os.path.dirname(path), "generation_config.json"))
    return Tokenizer(path, tok.get_vocab_size(), lambda text: tok.encode(text, add_special_tokens=False).ids,
                     lambda ids: tok.decode([int(i) for i in ids]), eos,
                     lambda text: tok.encode(text, add_special_tokens=True).ids,
                     stop if stop else (() if eos is None else (eos,)),
                     lambda text: (lambda e: (e.ids, e.offsets))(tok.encode(text, add_special_tokens=False)))


def _generation_stop_ids(path: str) -> tuple[int, ...]:
    """eos_token_id of a generation_config.json (an int or a list), () without one."""
    if not os.path.isfile(path):
        return ()
    import json

    try:
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise TokenizerError(f"{path!r} cannot be read as a JSON object ({e}); fix or remove it.") from None
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TokenizerError(f"{path!r} has eos_token_id = {value!r}; it must be a token id or a list of them.")
    return tuple(ids)
