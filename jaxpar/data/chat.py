"""Chat data: conversations rendered with a model's chat template, the loss kept to the assistant.

A conversation is `{"messages": [{"role": ..., "content": ...}, ...]}` (one `.jsonl` line). It is
rendered with the chat template of the tokenizer's folder (`tokenizer_config.json`
`chat_template`, jinja2 as transformers renders it: sandboxed, `trim_blocks`, `lstrip_blocks`,
`raise_exception`, the folder's `bos_token` / `eos_token`), then tokenized with offsets. A token is
learned (mask 1) when it starts inside an assistant turn, that is inside the text that rendering
the conversation up to and including assistant message i adds to rendering it up to message i
with the generation prompt: the reply and whatever closes it (an end-of-turn token), not the
template's role header. Every other token (system, user, headers) is context only (mask 0).
"""

from __future__ import annotations

import bisect
import datetime
import json
import os
from typing import Any

import numpy as np

from jaxpar.errors import DataError


class ChatError(DataError):
    """A conversation or chat template that cannot be rendered."""


def _special(value: Any) -> str:
    """A tokenizer_config.json special token: a string or an AddedToken-like {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    """The chat template of a tokenizer folder, with the folder's special tokens."""

    def __init__(self, tokenizer_path: str):
        folder = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
        path = os.path.join(folder, "tokenizer_config.json")
        config = {}
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ChatError(f"{path!r} cannot be read as JSON ({e}); fix it or pass another tokenizer.") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str) or not template:
            raise ChatError(f"--chat needs a chat template, but {path!r} has no `chat_template`; use the tokenizer "
                            "folder of a chat model, or prepare the data without --chat.")
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ChatError("--chat renders chat templates with jinja2; `pip install jinja2`.") from None

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(template)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"the chat template of {path!r} does not parse ({e}); fix it or pass another "
                            "tokenizer.") from None
        self._jinja_error = jinja2.exceptions.TemplateError
        self.path = path
        self.special = {k: _special(config.get(k)) for k in ("bos_token", "eos_token")}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special)
        except self._jinja_error as e:
            raise ChatError(f"the chat template of {self.path!r} refused a conversation ({e}); fix the "
                            "conversation or the template.") from None

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns."""
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[:i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ChatError(f"the chat template of {self.path!r} does not render a conversation as the "
                                f"renderings of its beginnings followed by more (at message {i}), so the assistant "
                                "turns cannot be found; use a template without such rewriting.")
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return text, spans


def check_conversation(record: Any, where: str) -> list[dict]:
    """The messages of one .jsonl record, or a ChatError naming `where` (file and line)."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"{where} has no list `messages`; write one conversation per line, like "
                        '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}.')
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ChatError(f"{where} message {k} is {m!r}; give each message a string `role` and `content`.")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError(f"{where} has no assistant message, so nothing of it would be learned; give each "
                        "conversation at least one assistant turn.")
    return messages


def encode_conversation(template: ChatTemplate, encode_offsets, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one conversation: mask 1 where the token starts inside an assistant turn.
    `encode_offsets(text)` gives the token ids and their (start, end) character offsets."""
    text, spans = template.assistant_spans(messages)
    ids, offsets = encode_offsets(text)
    starts = [s for s, _ in spans]
    mask = np.zeros(len(ids), np.uint8)
    for j, (start, end) in enumerate(offsets):
        k = bisect.bisect_right(starts, start) - 1
        mask[j] = k >= 0 and start < spans[k][1] and end > start
    return np.asarray(ids, np.int64), mask
