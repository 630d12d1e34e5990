"""XLA flags that fit the installed jaxlib: a GPU preset written as data, and the check that every
flag jaxpar passes is one the installed XLA registers (XLA aborts the process on any other).

`runtime.xla_flags` is `auto` (the GPU preset, on a GPU backend only), `none`, or a string of
flags passed through after the same check. Flags already in the user's `XLA_FLAGS` win (by flag
name, and over every spelling of a preset setting). Everything here runs before JAX starts a
backend: XLA reads `XLA_FLAGS` once, when its first client starts.

Which flags the installed XLA knows is read from its shared libraries: every flag is registered
by name as a NUL-terminated C string literal (`tsl::Flag("xla_gpu_...", ...)`), whereas a
`DebugOptions` field that lost its flag survives only inside the serialized proto descriptor
(length-prefixed, never NUL-delimited). In jaxlib 0.10.2's libjax_common.so, 345 names appear as
such literals; `xla_gpu_enable_pipelined_collectives`, a field whose flag was removed, does not.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import logging
import mmap
import os
import pkgutil
import re
from pathlib import Path

from jaxpar.config import Config, ConfigError
from jaxpar.config.rules import FLAG_TOKEN, syntax_error  # noqa: F401 (the syntax is the config's rule; re-exported)

_REGISTERED = re.compile(rb"\x00(xla_[a-z0-9_]+)(?=\x00)")
log = logging.getLogger("jaxpar")


@dataclasses.dataclass(frozen=True)
class Spelling:
    """One way a setting is written, and the oldest jaxlib that can hold it."""

    name: str
    value: str
    since: tuple[int, int, int]

    @property
    def token(self) -> str:
        return f"--{self.name}={self.value}"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One thing the preset sets; its spellings newest first (the first one jaxlib knows is used)."""

    purpose: str
    spellings: tuple[Spelling, ...]


# Evidence for every spelling (jaxpar needs jaxlib >= 0.10, so no spelling is dated earlier):
# - the `xla_gpu_enable_*` / `*_combine_threshold_bytes` spellings are registered in XLA's
#   xla/debug_options_flags.cc of mid-2025 (before jaxlib 0.10) and in jaxlib 0.10.2's
#   libjax_common.so (scanned, 2026-12-02); openxla/xla#44228 reports the pipelining ones
#   accepted by jaxlib 0.10.1 (and, there, without effect: the pass was not linked in).
# - `xla_gpu_pipeline_*=on|off` is the newer spelling issue 17 names (openxla/xla#45836, July 2026,
#   added on / off / explicit pipelining modes); jaxlib 0.10.2 does not register it, so no release
#   before 0.10.3 can. No binary that holds it was seen: it is chosen only where the scan finds it.
# Values: MaxText's and NVIDIA JAX-Toolbox's GPU recipes (128 MiB all-reduce and all-gather
# buckets, 64 MiB reduce-scatter). Not yet measured on a GPU with jaxpar (README, Efficiency).
_V0100, _V0103 = (0, 10, 0), (0, 10, 3)


def _pipelining(collective: str) -> Setting:
    return Setting(f"pipeline {collective.replace('_', '-')}s out of loops (prefetch one iteration ahead)",
                   (Spelling(f"xla_gpu_pipeline_{collective}", "on", _V0103),
                    Spelling(f"xla_gpu_enable_pipelined_{collective}", "true", _V0100)))


GPU_PRESET: tuple[Setting, ...] = (
    Setting("latency-hiding scheduler (overlaps collectives with compute)",
            (Spelling("xla_gpu_enable_latency_hiding_scheduler", "true", _V0100),)),
    Setting("combine all-reduces up to 128 MiB",
            (Spelling("xla_gpu_all_reduce_combine_threshold_bytes", str(128 * 2**20), _V0100),)),
    Setting("combine all-gathers up to 128 MiB",
            (Spelling("xla_gpu_all_gather_combine_threshold_bytes", str(128 * 2**20), _V0100),)),
    Setting("combine reduce-scatters up to 64 MiB",
            (Spelling("xla_gpu_reduce_scatter_combine_threshold_bytes", str(64 * 2**20), _V0100),)),
    Setting("double-buffer while loops (the layer scan: next layer's collectives beside this one's compute)",
            (Spelling("xla_gpu_enable_while_loop_double_buffering", "true", _V0100),)),
    _pipelining("all_gather"),
    _pipelining("reduce_scatter"),
    _pipelining("all_reduce"),
    # jaxlib 0.10.2's libjax_common.so registers it (scanned, 2026-12-07); XLA's ragged all-to-all
    # reached about 2% of NVLink bandwidth on 8xB200 without this device kernel (issue 45). It
    # matters only where `model.moe_exchange` runs the ragged exchange (GPUs, expert parallelism).
    Setting("the one-shot device kernel of ragged all-to-alls (MoE expert parallelism's ragged exchange)",
            (Spelling("xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel", "true", _V0100),)),
)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `runtime.xla_flags` resolved to: the flags jaxpar adds to XLA_FLAGS and why."""

    mode: str
    """auto, none or flags (a string given in runtime.xla_flags)."""
    backend: str
    jaxlib: str
    added: tuple[str, ...] = ()
    """Tokens jaxpar appends to XLA_FLAGS."""
    kept: tuple[str, ...] = ()
    """Tokens of the user's XLA_FLAGS that replace a preset or config flag."""
    missing: tuple[str, ...] = ()
    """Preset settings (their purpose) that no spelling known to this jaxlib expresses."""
    note: str = ""

    def describe(self) -> str:
        """One line for the CLI."""
        if self.mode == "none":
            return "runtime.xla_flags = none: jaxpar sets no XLA flags"
        head = (f"auto preset for jaxlib {self.jaxlib} on {self.backend}" if self.mode == "auto"
                else f"runtime.xla_flags (checked against jaxlib {self.jaxlib})")
        parts = [f"{head}: " + (" ".join(self.added) if self.added else "nothing set")]
        if self.kept:
            parts.append("kept from XLA_FLAGS: " + " ".join(self.kept))
        if self.missing:
            parts.append("not known to this jaxlib: " + "; ".join(self.missing))
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)


def parse(text: str) -> list[tuple[str, str]]:
    """(name, token) of each `--xla_*` flag in an XLA_FLAGS-style string (other tokens skipped)."""
    return [(m.group(1), m.group(0)) for t in text.split() if (m := FLAG_TOKEN.fullmatch(t))]


def choose(backend: str, version: tuple[int, ...], known: frozenset[str]) -> tuple[list[Spelling], list[str]]:
    """The preset for `backend` on jaxlib `version` whose XLA registers `known`: per setting, its
    newest spelling that this version can hold and `known` holds; and the settings none fits."""
    if backend != "gpu":
        return [], []
    chosen, missing = [], []
    for setting in GPU_PRESET:
        fit = [s for s in setting.spellings if version >= s.since and s.name in known]
        if fit:
            chosen.append(fit[0])
        else:
            missing.append(setting.purpose)
    return chosen, missing


def _aliases(name: str) -> set[str]:
    """Every spelling of the preset setting that `name` spells (just {name} if none)."""
    for setting in GPU_PRESET:
        names = {s.name for s in setting.spellings}
        if name in names:
            return names
    return {name}


def resolve(setting: str, backend: str, version: tuple[int, ...], known: frozenset[str],
            env_flags: str) -> Choice:
    """What `runtime.xla_flags = setting` adds to XLA_FLAGS = `env_flags` (pure; no environment).

    Raises ConfigError naming a flag of `setting` that `known` (the installed XLA's flags) lacks."""
    jaxlib = ".".join(map(str, version))
    if setting == "none":
        return Choice("none", backend, jaxlib)
    if setting == "auto":
        chosen, missing = choose(backend, version, known)
        wanted = [(s.name, s.token) for s in chosen]
        note = "" if backend == "gpu" else f"the backend is {backend}, and the preset is for GPUs"
    else:
        wanted, missing, note = parse(setting), [], ""
        if not known:
            raise ConfigError(
                f"runtime.xla_flags = {setting!r} cannot be checked: no library of the installed jaxlib {jaxlib} "
                "could be read for the flags it registers; put the flags in XLA_FLAGS yourself and set "
                "runtime.xla_flags=none.")
        for name, _ in wanted:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f"did you mean --{close[0]}?" if close else "remove it."
                raise ConfigError(
                    f"runtime.xla_flags names --{name}, which the installed jaxlib {jaxlib} does not register "
                    f"(XLA aborts the process on an unknown flag); {hint}")
    added, kept = [], []
    for name, token in wanted:
        theirs = [t for n, t in parse(env_flags) if n in _aliases(name)]
        if theirs:
            kept.extend(t for t in theirs if t not in kept)
        else:
            added.append(token)
    return Choice("auto" if setting == "auto" else "flags", backend, jaxlib, tuple(added), tuple(kept),
                  tuple(missing), note)


# --------------------------------------------------------------------------------------------
# The installed jaxlib


def registered_flags(path: str | os.PathLike) -> frozenset[str]:
    """The flag names a shared library registers (NUL-delimited `xla_*` literals)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return frozenset()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return frozenset(x.decode() for x in _REGISTERED.findall(m))


def xla_libraries() -> list[Path]:
    """The shared libraries of jaxlib and of installed PJRT plugins (jax_plugins: CUDA, ROCm)."""
    roots = []
    for name in ("jaxlib", "jax_plugins"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots += [Path(p) for p in spec.submodule_search_locations]
    return sorted(p for r in roots for p in r.rglob("*.so*") if p.is_file())


@functools.lru_cache(maxsize=None)
def installed_flags() -> frozenset[str]:
    """Flags every XLA in this installation registers (each library that registers `xla_dump_to`
    parses XLA_FLAGS itself, and any of them aborts on a flag it lacks): their intersection."""
    sets = [s for s in map(registered_flags, xla_libraries()) if "xla_dump_to" in s]
    return frozenset.intersection(*sets) if sets else frozenset()


def jaxlib_version() -> tuple[int, ...]:
    from jaxlib import version

    return tuple(int(x) for x in re.findall(r"\d+", version.__version__)[:3])


def gpu_plugin_installed() -> bool:
    """Whether a CUDA or ROCm PJRT plugin is installed (JAX then prefers the GPU backend)."""
    spec = importlib.util.find_spec("jax_plugins")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(m.name.startswith(("xla_cuda", "xla_rocm")) for m in pkgutil.iter_modules(spec.submodule_search_locations))


def expected_backend(cfg: Config) -> str:
    """The backend JAX will start for `cfg`, decided without starting it: cpu under
    runtime.cpu_devices; else the first of JAX_PLATFORMS; else gpu when a GPU plugin is installed."""
    import jax

    if cfg.runtime.cpu_devices is not None:
        return "cpu"
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        first = platforms.split(",")[0].strip().lower()
        return "gpu" if first in ("cuda", "rocm", "gpu") else first
    return "gpu" if gpu_plugin_installed() else "cpu"


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public API says whether a backend is up

    return getattr(xla_bridge, "backends_are_initialized", lambda: False)()


def apply(cfg: Config) -> Choice:
    """Resolve runtime.xla_flags and append its flags to os.environ["XLA_FLAGS"]; before JAX
    starts a backend (after, flags not yet in XLA_FLAGS cannot be applied: auto logs a warning and
    notes it, a string is refused)."""
    setting = cfg.runtime.xla_flags
    backend = expected_backend(cfg)
    needs_scan = setting not in ("auto", "none") or backend == "gpu"
    known = installed_flags() if needs_scan else frozenset()
    choice = resolve(setting, backend, jaxlib_version(), known, os.environ.get("XLA_FLAGS", ""))
    if choice.added and _backend_started():
        if choice.mode == "flags":
            raise ConfigError(
                f"runtime.xla_flags = {setting!r} cannot be applied: JAX already started its backend (XLA reads "
                "XLA_FLAGS once, when it starts); set it before anything touches JAX, or put the flags in XLA_FLAGS.")
        log.warning("runtime.xla_flags = auto: the preset's %s cannot be applied: JAX's backend had already "
                    "started (XLA reads XLA_FLAGS once, when it starts); set XLA_FLAGS before anything touches JAX",
                    " ".join(choice.added))
        choice = dataclasses.replace(choice, added=(), note="not applied: JAX's backend had already started")
    if choice.added:
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *choice.added]).strip()
    return choice
