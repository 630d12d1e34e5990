"""What the command lines share: an argument parser whose mistakes end like every other user error
(one `error: ...` line on stderr naming the value and a fix, exit code 2, no usage dump), and the
checks of the paths they are given, which tell a Hugging Face folder, a jaxpar run directory and
a prepared dataset apart so that a folder of the wrong kind is named as such, with the flag that
takes it.

Imports nothing heavy (no JAX): the parsers run before any backend starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

__all__ = ["Parser", "folder_kind", "check_model_folder", "check_run_dir", "check_new_output", "check_at_least"]

KINDS = {
    "hf": "a Hugging Face model folder (config.json)",
    "run": "a jaxpar run directory (config.yaml, checkpoints/)",
    "dataset": "a dataset prepared by `python -m jaxpar.data prepare` (meta.json)",
}


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with one-line errors: `error: <what argparse says>; see `<prog> --help`.`"""

    def error(self, message: str) -> NoReturn:
        self.fail(f"{message}; see `{self.prog} --help`.")

    def fail(self, sentence: str) -> NoReturn:
        """Print `error: <sentence>` and exit 2 (a user mistake found while checking arguments)."""
        print(f"error: {sentence}", file=sys.stderr)
        sys.exit(2)


def folder_kind(path: str) -> str:
    """`missing`, `file`, `hf` (config.json), `run` (config.yaml or checkpoints/), `dataset`
    (meta.json), or `other` (a folder of none of these)."""
    if not os.path.exists(path):
        return "missing"
    if not os.path.isdir(path):
        return "file"
    has = lambda name: os.path.exists(os.path.join(path, name))  # noqa: E731
    if has("config.json"):
        return "hf"
    if has("config.yaml") or has("checkpoints"):
        return "run"
    if has("meta.json"):
        return "dataset"
    return "other"


def check_model_folder(parser: Parser, flag: str, path: str | None, run_flag: str) -> None:
    """`flag` (e.g. --from-hf) must not name a run directory or a dataset (a missing or incomplete
    folder is reported by `jaxpar.hf.read_hf_config`, which says what is missing)."""
    if path is None:
        return
    kind = folder_kind(path)
    if kind == "run":
        parser.fail(f"{flag} {path!r} is {KINDS['run']}, not a Hugging Face model folder; pass it as "
                    f"`{run_flag} {path}`.")
    if kind == "dataset":
        parser.fail(f"{flag} {path!r} is {KINDS['dataset']}, not a model; pass a Hugging Face model folder "
                    "(config.json + *.safetensors).")


def check_run_dir(parser: Parser, flag: str, path: str | None, hf_flag: str) -> None:
    """`flag` (--run-dir) must name a directory, and not a Hugging Face folder or a dataset."""
    if path is None:
        return
    kind = folder_kind(path)
    if kind == "file":
        parser.fail(f"{flag} {path!r} is a file, not a run directory; pass the folder jaxpar.train wrote "
                    "(its train.run_dir).")
    if kind == "hf":
        parser.fail(f"{flag} {path!r} is {KINDS['hf']}, not a jaxpar run directory; pass it as `{hf_flag} {path}`.")
    if kind == "dataset":
        parser.fail(f"{flag} {path!r} is {KINDS['dataset']}, not a run directory; pass the folder jaxpar.train "
                    "wrote (its train.run_dir).")


def check_new_output(parser: Parser, flag: str, path: str | None) -> None:
    """`flag` must name a path whose nearest existing parent is a writable directory (an existing
    output is refused by the writer itself, which never overwrites)."""
    if path is None or os.path.exists(path):
        return
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        parser.fail(f"{flag} {path!r} cannot be created: {existing!r} is not a writable folder; pass a path in "
                    "a folder you can write to.")


def check_at_least(parser: Parser, flag: str, value: float | None, low: float, fix: str) -> None:
    """`flag`'s value (if given) must be at least `low`; `fix` says what to pass instead."""
    if value is not None and value < low:
        parser.fail(f"{flag} {value:g} must be at least {low:g}; {fix}.")
