"""How jaxpar's commands log: jaxpar's own lines on stdout, the libraries' chatter silenced.

Every `python -m jaxpar.<command>` calls `for_cli` first. jaxpar logs on the `jaxpar` logger
(and its children: `jaxpar.progress` has the per-step lines); absl, orbax, etils and JAX's own
INFO/WARNING records (orbax's "no ... found", absl's "CheckpointManager created" notes, JAX's
"platform not found") are not the user's concern and are shown only from ERROR up. An error the
user must act on is an `error:` line on stderr, printed by the command itself.
"""

from __future__ import annotations

import logging

CHATTY = ("absl", "orbax", "etils", "jax", "jax._src", "tensorstore")


class _Print(logging.Handler):
    """A handler that hands each record's message to `emit_line` (a rich console's print, so that
    lines land above a live progress bar)."""

    def __init__(self, emit_line):
        super().__init__()
        self.emit_line = emit_line

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.emit_line(self.format(record))
        except Exception:  # noqa: BLE001  (logging's own rule: a handler never raises)
            self.handleError(record)


def quiet_libraries() -> None:
    """Show the libraries' records from ERROR up only (their INFO and WARNING lines are noise to a
    user of the command line), including absl's own handler once absl is imported."""
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
        absl_logging.set_stderrthreshold("error")
    except ImportError:
        pass


def for_cli(is_main: bool = True, emit_line=None) -> None:
    """Set up a command's logging: jaxpar's lines (INFO on the main process, WARNING elsewhere) as
    plain messages on stdout, flushed at once, or through `emit_line`; the libraries quiet.
    Called again (a test calling several commands' `main`), it replaces its own handler."""
    quiet_libraries()
    logger = logging.getLogger("jaxpar")
    for handler in [h for h in logger.handlers if getattr(h, "_jaxpar_cli", False)]:
        logger.removeHandler(handler)
    # print() looks sys.stdout up at each line (a handler holding the stream would outlive a redirection).
    handler = _Print(emit_line or (lambda text: print(text, flush=True)))
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._jaxpar_cli = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    root = logging.getLogger()
    if not root.handlers:  # else a library's `logging.info(...)` would add a stderr handler that repeats ours
        root.addHandler(logging.NullHandler())
