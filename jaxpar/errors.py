"""The errors every layer shares: the foundation's leaf, importing nothing of jaxpar.

A `JaxparError` is a mistake the user can fix; the commands print its sentence as one `error:`
line and exit 2, with no traceback. Each layer derives its own (`ConfigError` here, as the config
and the mesh checks both raise it; `ScheduleError`, `DataError`, `CheckpointError`, `HFError` ...
next to their code; `DataError` here, as the data package's modules share it).
"""

from __future__ import annotations


class JaxparError(Exception):
    """A mistake the user can fix (config, mesh, data, checkpoint); the CLI exits 2 on it."""


class ConfigError(JaxparError, ValueError):
    """An invalid configuration value, key or file."""


class DataError(JaxparError, ValueError):
    """Data that cannot be prepared or cannot serve the configured model (missing, malformed, too short).
    Here, not in `jaxpar.data`, so that the data package's modules share it without importing the
    package (`jaxpar.data.chat`)."""
