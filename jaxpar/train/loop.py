"""The training loop: data -> jitted step -> metrics, checkpoints, evaluation, faults.

The host runs at most one step ahead of the devices: a step's metrics are read after the next
step has been dispatched. Only process 0 writes `config.yaml` and `metrics.jsonl`; every process
takes part in saving checkpoints (each writes the shards its devices hold).

Faults:
- The run's end: a checkpoint of the last step is saved (`train.save_final`, default on), so
  export, generation and a longer rerun read the trained weights.
- SIGTERM / SIGINT: the step in flight finishes, a checkpoint is saved, `train` returns with
  `History.stopped` set (one line says where the checkpoint is; the CLI exits 0). A second SIGINT
  interrupts at once.
- A hang (a lost peer, a stalled collective): the watchdog (`runtime.step_timeout_s`,
  `jaxpar.train.watchdog`) dumps every thread's stack to run_dir/hang-<time>.txt and exits 75.
- A non-finite loss or gradient: the update is dropped inside the step (`train.on_nan`); `skip`
  goes on and counts it (`skipped_steps` in the metrics); `stop` saves the state before the bad
  step and raises `TrainingStopped`.
- Resuming (`train.resume: auto`) takes the newest checkpoint in run_dir; a damaged one is moved
  aside with a warning and the previous one is used (`jaxpar.train.checkpoint`). The records of
  metrics.jsonl after the resumed step move to metrics.rewound.jsonl (the resumed run logs those
  steps again), and new records are appended. A fresh run into a run_dir whose metrics.jsonl
  holds records but which has no checkpoint is refused: nothing already written is replaced.

Progress: each logged record is also one line on the `jaxpar.progress` logger (`progress.line`):
what a batch job's log and the Python API show (the CLI shows a live bar on a terminal instead).

Efficiency: each record carries model TFLOP/s per device and MFU (`train.efficiency`), and where
the host spent the step time: `data_time_s` building batches, `dispatch_time_s` in the step call
(enqueueing it; on XLA:CPU part of the run), `device_wait_s` blocked on the devices' results (near
0: the devices were done before the host asked, so the host set the pace). The device time itself
is not measured outside a profile. `train.profile_start` traces steps with
jax.profiler into run_dir/profile; `train.tensorboard` mirrors the records as TensorBoard scalars.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpar.config import Config, ConfigError, to_yaml
from jaxpar.mesh import start_processes, use_cpu_devices
from jaxpar.train import progress
from jaxpar.train.checkpoint import Checkpoints, logged_steps, saved_steps
from jaxpar.train.data import batch_at, eval_batches, make_eval_source, make_source
from jaxpar.train.efficiency import Efficiency
from jaxpar.train.step import build, main_loss
from jaxpar.train.watchdog import Watchdog
from jaxpar.xla_flags import apply as apply_xla_flags

log = logging.getLogger("jaxpar")


class TrainingStopped(RuntimeError):
    """Training stopped on a non-finite loss or gradient (train.on_nan = stop); the CLI exits 3."""

    def __init__(self, message: str, checkpoint: str | None):
        super().__init__(message)
        self.checkpoint = checkpoint


class History(list):
    """The logged metric records (a list of dicts), plus how the run ended."""

    resumed_from: int | None = None
    """The step the run resumed from (None: started afresh)."""
    stopped: str | None = None
    """`SIGTERM` / `SIGINT` when a signal stopped the run early."""
    checkpoint: str | None = None
    """The directory of the last checkpoint saved (None if none was)."""


def check_run_dir(cfg: Config) -> None:
    """train.run_dir must be a directory that exists or can be created, and be writable; and a run
    that would start afresh there must not replace the metrics of an earlier run."""
    d = cfg.train.run_dir
    if os.path.exists(d) and not os.path.isdir(d):
        raise ConfigError(f"train.run_dir = {d!r} is an existing file, not a directory; "
                          "set train.run_dir to a directory path.")
    existing = os.path.abspath(d)
    while not os.path.exists(existing):  # the deepest part of the path that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"train.run_dir = {d!r} lies under the file {existing!r}; "
                          "set train.run_dir to a directory path.")
    if not os.access(existing, os.W_OK):
        raise ConfigError(f"train.run_dir = {d!r} is not writable ({existing!r} refuses writes); "
                          "set train.run_dir to a writable directory.")
    metrics = os.path.join(d, "metrics.jsonl")
    steps = logged_steps(metrics)
    if steps and not saved_steps(d):  # (with checkpoints and resume = never: Checkpoints.check_resume_rules)
        raise ConfigError(
            f"train.run_dir = {d!r} holds the metrics of an earlier run ({len(steps)} records, up to step {max(steps)}) "
            "but no checkpoint to resume from, and a fresh run would replace them; choose a new train.run_dir, "
            f"or move {metrics} away to start afresh there.")


class _StopSignals:
    """SIGTERM/SIGINT set a flag that the loop reads between steps (main thread only)."""

    def __init__(self):
        self.received: str | None = None
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def agreed(self) -> str | None:
        """The stop request, agreed by all processes (a launcher signals each at its own moment)."""
        if jax.process_count() == 1:
            return self.received
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.received is not None))
        return (self.received or "SIGTERM") if np.any(flags) else None


REWOUND = "metrics.rewound.jsonl"


def _rewind_metrics(path: str, upto: int) -> int:
    """Keep the records of steps <= upto in `path` and append the later ones (which a run resumed
    from step `upto` logs again) to metrics.rewound.jsonl beside it; returns how many moved."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
    later = [line for line in lines if json.loads(line).get("step", 0) > upto]
    if not later:
        return 0
    with open(os.path.join(os.path.dirname(path), REWOUND), "a") as f:
        f.writelines(later)
        f.flush()
        os.fsync(f.fileno())
    with open(path + ".tmp", "w") as f:
        f.writelines(line for line in lines if json.loads(line).get("step", 0) <= upto)
    os.replace(path + ".tmp", path)
    return len(later)


def _tensorboard_writer():
    """tensorboardX's SummaryWriter class, or a ConfigError when it is not installed."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError("train.tensorboard = true needs the tensorboardX package, which is not installed; "
                          "pip install 'jaxpar[tensorboard]', or set train.tensorboard=false.") from None
    return SummaryWriter


def _init_state(cfg: Config, program):
    """Fresh parameters (from train.seed, or model.init_from's Hugging Face weights)."""
    state = program.init(jax.random.key(cfg.train.seed))
    if cfg.model.init_from is not None:
        from jaxpar import hf

        params = hf.load_params(cfg.model.init_from, cfg, program.state_shardings.params)
        state = state._replace(params=params, opt_state=jax.jit(
            program.optimizer.init, out_shardings=program.state_shardings.opt_state)(params))
    return state


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What a run checks and builds before it writes anything (`preflight`): once per run, for the
    CLI (which prints its summary from it) and `train` alike."""

    cfg: Config
    program: Any
    """The `jaxpar.train.step.Program` (its mesh: `program.mesh`)."""
    xla: Any
    """What `jaxpar.xla_flags.apply` set."""
    source: Any
    eval_source: Any
    summary_writer: Any
    """tensorboardX's SummaryWriter class with train.tensorboard, else None."""
    checkpoints: Checkpoints
    resume_step: int | None
    """The newest checkpoint to resume from (None: a fresh start)."""


def preflight(cfg: Config, mesh: Mesh | None = None) -> Prepared:
    """Everything a user can get wrong, checked before anything is written or compiled, and the
    pieces of the run built once: XLA flags and processes (before a backend starts), the run
    directory, TensorBoard, the data, the resume rules, the program (mesh, layout, shardings), the
    checkpoint to resume from, and `model.init_from`'s folder against the config."""
    xla = apply_xla_flags(cfg)  # before anything can start a backend
    if xla.added:
        log.info("xla flags: %s", xla.describe())
    start_processes(cfg)
    use_cpu_devices(cfg.runtime.cpu_devices, cfg)
    tr = cfg.train
    check_run_dir(cfg)
    summary_writer = _tensorboard_writer() if tr.tensorboard else None
    source = make_source(cfg)
    eval_source = make_eval_source(cfg) if tr.eval_every > 0 else None
    ckpt = Checkpoints(cfg)
    ckpt.check_resume_rules()
    program = build(cfg, mesh)
    resume_step = ckpt.candidate(program)
    if cfg.model.init_from is not None and resume_step is None:
        from jaxpar import hf

        hf.check_matches(cfg.model, cfg.model.init_from)
    return Prepared(cfg, program, xla, source, eval_source, summary_writer, ckpt, resume_step)


def train(cfg: Config, *, mesh: Mesh | None = None, callback: Callable[[dict], None] | None = None,
          prepared: Prepared | None = None) -> History:
    """Train `cfg` and return the logged metrics (a `History`: one dict per logged step).

    Each record has `step` (optimizer steps done), `loss` (on that step's batch, before its
    update), `grad_norm` (before clipping), `lr`, `skipped_steps` (non-finite steps so far),
    `step_time_s`, `tokens_per_s`, `model_tflops_per_device`, `mfu` (with a known peak),
    `data_time_s`, `dispatch_time_s` and `device_wait_s` (per step, over the steps since the last
    record; the rest of step_time_s is other host work: records, checkpoints); with
    evaluation, `val_loss` and `val_ppl` at eval steps. `callback` is called with each record as
    it is logged (the CLI's progress bar); each record is also logged as one line
    (`jaxpar.train.progress`). `prepared`: the run's `preflight` already done (the CLI's), else
    done here.
    """
    progress.default_handler()
    run = preflight(cfg, mesh) if prepared is None else prepared
    tr, program, ckpt, resume_step = cfg.train, run.program, run.checkpoints, run.resume_step
    SummaryWriter, source, eval_source = run.summary_writer, run.source, run.eval_source

    writer = jax.process_index() == 0
    metrics_path = os.path.join(tr.run_dir, "metrics.jsonl")
    metrics_file = None
    if writer:
        os.makedirs(tr.run_dir, exist_ok=True)
        with open(os.path.join(tr.run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))

    history = History()
    t = time.perf_counter()
    watchdog = Watchdog(cfg.runtime.step_timeout_s, program.mesh.devices.flat[0].platform, tr.run_dir,
                        writer=writer)
    with watchdog:
        watchdog.arm("the start-up (restore, first compile, first step)", startup=True)
        if resume_step is not None:
            state, history.resumed_from = ckpt.restore(program, resume_step)
            log.info("resumed from %s", os.path.join(ckpt.dir, str(history.resumed_from)))
            if writer:
                moved = _rewind_metrics(metrics_path, history.resumed_from)
                if moved:
                    log.info("metrics.jsonl: %d records after step %d moved to %s (those steps run again)",
                             moved, history.resumed_from, REWOUND)
            if tr.on_nan == "stop" and int(jax.device_get(state.skipped)) > 0:
                # Stop mode freezes on skipped > 0; a count carried over from a skip-mode run restarts.
                log.info("train.on_nan = stop: skipped_steps (%d from the earlier run) restarts at 0",
                         int(jax.device_get(state.skipped)))
                state = state._replace(skipped=state.skipped * 0)
        else:
            state = _init_state(cfg, program)
        if writer:  # appended to: a fresh run reaches here only without earlier records (check_run_dir)
            metrics_file = open(metrics_path, "a")
        try:
            return _run(cfg, program, ckpt, state, history, watchdog, metrics_file, SummaryWriter, eval_source,
                        source, callback, t)
        finally:
            if metrics_file is not None:
                metrics_file.close()


def _run(cfg, program, ckpt, state, history, watchdog, metrics_file, SummaryWriter, eval_source, source,
         callback, t) -> History:
    """The steps of `train` from `state` on (compiling first), with its records, evaluations,
    checkpoints and faults."""
    tr = cfg.train
    writer = jax.process_index() == 0
    events = None
    if writer and SummaryWriter is not None:  # a resumed run purges the events after its checkpoint
        events = SummaryWriter(os.path.join(tr.run_dir, "tensorboard"), purge_step=(
            None if history.resumed_from is None else history.resumed_from + 1))
    step_fn = program.step.lower(state, program.abstract_batch()).compile()
    if eval_source is None:
        evaluate = None
    else:
        val = eval_batches(eval_source, cfg, program.batch_sharding)
        # The loss of every layout (pipeline, tensor, ZeRO) is the one of loss_and_grads; its
        # gradients are dropped (an evaluation costs about eval_batches training steps).
        eval_fn = program.loss_and_grads.lower(state.params, val[0]).compile()

        def evaluate(params) -> dict:
            t0 = time.perf_counter()
            loss = sum(float(main_loss(cfg, *eval_fn(params, b))) for b in val) / len(val)
            last["time"] += time.perf_counter() - t0  # not counted in the step time
            return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
    log.info("initialised and compiled in %.1f s", time.perf_counter() - t)

    tokens_per_step = tr.global_batch * cfg.model.seq_len
    efficiency = Efficiency.of(cfg, program.mesh.devices.size, program.mesh.devices.flat[0].device_kind)
    first = int(jax.device_get(state.step))
    last = {"time": time.perf_counter(), "step": first}
    # Host seconds since the last record: building batches, dispatching steps, blocked on the devices.
    spent = {"data": 0.0, "dispatch": 0.0, "wait": 0.0}

    def wait(x, fetch: bool = True):
        """`x` on the host (`fetch=False`: only ready); the time blocked counts as waiting for the devices."""
        t0 = time.perf_counter()
        out = jax.block_until_ready(x)
        if fetch:
            out = jax.device_get(out)
        spent["wait"] += time.perf_counter() - t0
        return out

    def record(step: int, metrics: dict, extra: dict) -> None:
        values = {k: float(v) for k, v in wait(metrics).items()}  # waits for step `step`
        values["skipped_steps"] = int(values["skipped_steps"])
        now = time.perf_counter()
        steps = max(step - last["step"], 1)
        step_time = (now - last["time"]) / steps
        last.update(time=now, step=step)
        rec = {"step": step, **values, **extra, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
               **efficiency.metrics(step_time), "data_time_s": spent["data"] / steps,
               "dispatch_time_s": spent["dispatch"] / steps, "device_wait_s": spent["wait"] / steps}
        spent.update(data=0.0, dispatch=0.0, wait=0.0)
        history.append(rec)
        if metrics_file is not None:
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
        if events is not None:
            for key, value in rec.items():
                if key != "step":
                    events.add_scalar(key, value, step)
            events.flush()
        progress.log.info(progress.line(rec, tr.steps, step_time * (tr.steps - step)))
        if callback is not None:
            callback(rec)

    def save(state, why: str) -> str:
        watchdog.arm(f"the checkpoint save of step {int(jax.device_get(state.step))} ({why})")
        try:
            return ckpt.save(state, program.mesh)
        finally:
            watchdog.disarm()

    def nan_stop(step: int) -> None:
        """Step `step` was not finite: the state froze before it (train.on_nan = stop)."""
        # The frozen state is the state before step `step`; its `skipped` was 0 then (stop mode).
        history.checkpoint = save(state._replace(skipped=state.skipped * 0), "stopped on a non-finite step")
        close()
        raise TrainingStopped(
            f"step {step} had a non-finite loss or gradient; the last good state (after step {step - 1}) is "
            f"saved in {history.checkpoint}; inspect the data and learning rate, then resume from it "
            "(train.resume=auto), or set train.on_nan=skip to drop such steps.", history.checkpoint)

    def close() -> None:
        """Finish the checkpoint writes in flight (under the watchdog: a stalled write is a hang too)."""
        watchdog.arm("finishing the checkpoint writes")
        ckpt.close()
        watchdog.disarm()

    pending = None  # (step, metrics, logged?) of the step dispatched before
    # Steps profile_start .. profile_start + profile_steps - 1 (numbered from 1) run under a trace.
    trace = (None if tr.profile_start is None else
             (tr.profile_start, min(tr.profile_start + tr.profile_steps - 1, tr.steps)))
    tracing = False
    tick = time.perf_counter()
    try:
        with _StopSignals() as signals:
            for k in range(first, tr.steps):
                done = k + 1
                now = time.perf_counter()
                if k > first:  # the host's time for the last step (the first one compiles and warms up)
                    watchdog.timed(now - tick)
                tick = now
                watchdog.arm(f"step {done}", startup=k == first)
                if trace is not None and done == trace[0]:
                    jax.profiler.start_trace(os.path.join(tr.run_dir, "profile"))
                    tracing = True
                t0 = time.perf_counter()
                batch = batch_at(source, k, tr.global_batch, program.batch_sharding)
                t1 = time.perf_counter()
                spent["data"] += t1 - t0
                state, metrics = step_fn(state, batch)
                spent["dispatch"] += time.perf_counter() - t1
                if tracing and done == trace[1]:
                    wait(state.step)  # the traced steps' device work ends inside the trace
                    jax.profiler.stop_trace()
                    tracing = False
                    log.info("profiled steps %d-%d into %s", trace[0], trace[1], os.path.join(tr.run_dir, "profile"))
                if pending is not None:
                    p_step, p_metrics, p_log = pending
                    if tr.on_nan == "stop" and int(wait(p_metrics["skipped_steps"])) > 0:
                        nan_stop(p_step)
                    if p_log:
                        record(p_step, p_metrics, {})
                is_last = done == tr.steps
                log_now = done % tr.log_every == 0 or is_last or k == first
                extra = {}
                if evaluate is not None and (done % tr.eval_every == 0 or is_last):
                    # The step just dispatched may still run: its remaining device time is the
                    # step's (device_wait_s), not the evaluation's (taken out of step_time_s).
                    wait((state, metrics), fetch=False)
                    extra = evaluate(state.params)
                if extra:  # record this step now, with its evaluation
                    if tr.on_nan == "stop" and int(wait(metrics["skipped_steps"])) > 0:
                        nan_stop(done)
                    record(done, metrics, extra)
                    pending = None
                else:
                    pending = (done, metrics, log_now)
                if is_last and pending is not None:  # the final save below stores a finite state
                    p_step, p_metrics, _ = pending
                    if tr.on_nan == "stop" and int(wait(p_metrics["skipped_steps"])) > 0:
                        nan_stop(p_step)
                if (tr.checkpoint_every > 0 and done % tr.checkpoint_every == 0) or (is_last and tr.save_final):
                    history.checkpoint = save(state, "the last step" if is_last else "train.checkpoint_every")
                watchdog.disarm()
                stop = signals.agreed()
                if stop is not None and not is_last:
                    history.stopped = stop
                    break
            if pending is not None:
                p_step, p_metrics, _ = pending
                if tr.on_nan == "stop" and int(wait(p_metrics["skipped_steps"])) > 0:
                    nan_stop(p_step)
                record(p_step, p_metrics, {})
            if history.stopped is not None:
                history.checkpoint = save(state, f"stopped by {history.stopped}")
                log.warning("stopped by %s after step %d: checkpoint saved in %s; run the same command to resume",
                            history.stopped, int(jax.device_get(state.step)), history.checkpoint)
        close()
    finally:
        watchdog.disarm()
        if tracing:
            jax.profiler.stop_trace()
        if events is not None:
            events.close()
    return history
