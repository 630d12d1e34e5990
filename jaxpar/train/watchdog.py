"""The watchdog: a hung step or checkpoint save ends the process, so that a job restarts it.

On GPUs a lost peer or a collective fault stalls a step with no error: every process of the
run waits in a collective forever. The training loop arms the watchdog with a deadline before
each step and each save (`arm`); a background thread checks it. Past the deadline it writes every
thread's Python stack (`faulthandler`) to `<run_dir>/hang-<time>.txt`, prints one line and ends
the process with `EXIT_HUNG` (75, sysexits' EX_TEMPFAIL: "try again"). A job script or SLURM's
`--requeue` reruns the command, and the run resumes from its last checkpoint.

The deadline (`runtime.step_timeout_s`, `limits`):
- a number of seconds: each step and each save; the start-up (restore, first compile, first
  step) gets at least `STARTUP_S`, since compiling a large model legitimately takes minutes;
- `auto`: off on CPU (a simulated device cannot hang on a peer); on other platforms `STARTUP_S`
  until `WARMUP_STEPS` steps are timed, then `AUTO_FACTOR` x their median step time, at least
  `AUTO_FLOOR_S`;
- `off`: never.
A step's time here is the host's time between two steps (dispatch, waiting for the previous
step's metrics): a hang shows there, since the loop blocks on each step's metrics one step later.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

log = logging.getLogger("jaxpar")

EXIT_HUNG = 75
STARTUP_S = 1800.0
AUTO_FACTOR = 10.0
AUTO_FLOOR_S = 300.0
WARMUP_STEPS = 10


def limits(setting: float | str, platform: str) -> tuple[float | None, float | None]:
    """(start-up limit, step limit before warm-up) in seconds for `runtime.step_timeout_s` on
    `platform`; None: no limit. Under `auto` the step limit is set after warm-up (`Watchdog.timed`)."""
    if setting == "off" or (setting == "auto" and platform == "cpu"):
        return None, None
    if setting == "auto":
        return STARTUP_S, STARTUP_S
    return max(float(setting), STARTUP_S), float(setting)


class Watchdog:
    """A deadline the loop re-arms before each step and save; past it, the stacks are dumped and the
    process exits with EXIT_HUNG. A no-op when the limits are None."""

    def __init__(self, setting: float | str, platform: str, run_dir: str, *, writer: bool = True,
                 poll_s: float = 1.0):
        self.auto = setting == "auto"
        self.startup_s, self.step_s = limits(setting, platform)
        self.run_dir = run_dir
        self.writer = writer
        self.poll_s = poll_s
        self._deadline: float | None = None
        self._what = ""
        self._step_times: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.startup_s is not None

    def __enter__(self) -> "Watchdog":
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, name="jaxpar-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def arm(self, what: str, startup: bool = False) -> None:
        """From now, `what` (e.g. "step 12") must end within the step limit (the start-up limit
        when `startup`)."""
        limit = self.startup_s if startup else self.step_s
        with self._lock:
            self._what = what
            self._deadline = None if limit is None else time.monotonic() + limit

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def timed(self, step_time_s: float) -> None:
        """One step's time after the first: under `auto`, the step limit follows the median of the
        first WARMUP_STEPS of them."""
        if not (self.auto and self.enabled) or len(self._step_times) >= WARMUP_STEPS:
            return
        self._step_times.append(step_time_s)
        if len(self._step_times) == WARMUP_STEPS:
            median = sorted(self._step_times)[WARMUP_STEPS // 2]
            self.step_s = max(AUTO_FACTOR * median, AUTO_FLOOR_S)
            log.info("watchdog: a step or save that takes over %.0f s ends the run (exit %d)", self.step_s, EXIT_HUNG)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                self.fire(what)

    def fire(self, what: str) -> None:
        """Dump every thread's stack, say so in one line, and end the process (no cleanup: the main
        thread is stuck, and anything that waits for it would hang too)."""
        path = None
        if self.writer:
            try:
                os.makedirs(self.run_dir, exist_ok=True)
                path = os.path.join(os.path.abspath(self.run_dir),
                                    f"hang-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt")
                with open(path, "w") as f:
                    f.write(f"jaxpar watchdog: {what} exceeded its time limit; every thread's stack follows.\n\n")
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
            except OSError:
                path = None
        where = f"; stacks in {path}" if path else ""
        sys.stderr.write(f"error: {what} did not finish within runtime.step_timeout_s (a hang){where}; "
                         f"exiting with code {EXIT_HUNG}: rerun the command to resume from the last checkpoint.\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_HUNG)
