"""Loading a run configuration: YAML files and presets, dotted `--set` overrides, and back to YAML.

`load_config` returns a `Config` that `jaxpar.config.validate` has checked: everything that does
not need the devices.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Sequence

import yaml

from jaxpar.config.schema import Config, _check_key, from_dict
from jaxpar.config.rules import validate
from jaxpar.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-3` (an exponent without a dot) as a string; researchers write lr that way."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`"model.d_model=256"` -> (["model", "d_model"], 256); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} has no `=`; write it as `--set section.key=value`.")
    key, _, value = text.partition("=")
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise ConfigError(f"override key {key!r} must be `section.key` (e.g. `model.d_model`); "
                          "write it as `--set section.key=value`.")
    try:
        parsed = _yaml(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return path, parsed


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config (or the bundled defaults when `path` is None) and apply `key=value` overrides.

    The result is fully validated except for what needs the devices (mesh sizes), which
    `jaxpar.mesh.make_mesh` checks.
    """
    raw: dict[str, Any] = {}
    where = "the default config"
    if path is not None:
        where = str(path)
        if not os.path.isfile(path):
            what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
            raise ConfigError(f"config file {str(path)!r} {what}; pass the path of a YAML file, "
                              "e.g. `--config configs/tiny_llama.yaml`.")
        try:
            with open(path, encoding="utf-8") as f:
                raw = _yaml(f.read()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            raise ConfigError(f"config file {str(path)!r} is not valid YAML ({getattr(e, 'problem', e)}"
                              f"{f' at line {mark.line + 1}' if mark else ''}); fix the syntax.") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(path)!r} cannot be read ({e.__class__.__name__}: {e}); "
                              "pass a readable UTF-8 YAML file.") from None
        if isinstance(raw, dict) and ("model_type" in raw or "architectures" in raw) and not raw.keys() & \
                {f.name for f in dataclasses.fields(Config)}:
            folder = os.path.dirname(str(path)) or "."
            raise ConfigError(f"config file {str(path)!r} is a Hugging Face model's config.json, not a jaxpar config; "
                              f"convert the model with `python -m jaxpar.convert --from-hf {folder} --to RUN_DIR` "
                              "and pass `--config RUN_DIR/config.yaml`.")
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must be a mapping of sections (model, mesh, ...), "
                              f"got a {type(raw).__name__}; write it as YAML sections like `model: {{d_model: 128}}`.")
    for text in overrides:
        (section, key), value = parse_override(text)
        # A typo in an override is the override's, not the file's: check its key before merging it.
        _check_key(section, key, f"`--set {text.strip()}`")
        if raw.get(section) is None:
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise ConfigError(f"config section `{section}` in {where} is not a mapping; fix the file.")
        raw[section][key] = value
    cfg = from_dict(raw, where)
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
