"""The training loop: data -> jitted step -> metrics, with no host synchronisation inside the loop.

A step's metrics are read only after the next step has been dispatched, so the host never makes
the devices wait. Only process 0 writes `config.yaml` and `metrics.jsonl`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Callable

import jax
from jax.sharding import Mesh

from jaxpar.config import Config, ConfigError, to_yaml
from jaxpar.mesh import use_cpu_devices
from jaxpar.train.data import batch_at, make_source
from jaxpar.train.step import build

log = logging.getLogger("jaxpar")


def check_run_dir(cfg: Config) -> None:
    """train.run_dir must be a directory that exists or can be created, and be writable."""
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


def train(cfg: Config, *, mesh: Mesh | None = None,
          callback: Callable[[dict], None] | None = None) -> list[dict]:
    """Train `cfg` and return the logged metrics (one dict per logged step).

    Each record has `step` (optimizer steps done), `loss` (on that step's batch, before its
    update), `grad_norm` (before clipping), `lr`, `step_time_s` and `tokens_per_s`. `callback`
    is called with each record as it is logged (the CLI's progress bar).
    """
    use_cpu_devices(cfg.runtime.cpu_devices)
    # Everything a user can get wrong is checked here, before anything is written or compiled.
    check_run_dir(cfg)
    source = make_source(cfg)
    program = build(cfg, mesh)
    tr = cfg.train
    writer = jax.process_index() == 0
    metrics_file = None
    if writer:
        os.makedirs(tr.run_dir, exist_ok=True)
        with open(os.path.join(tr.run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
        metrics_file = open(os.path.join(tr.run_dir, "metrics.jsonl"), "w")

    t = time.perf_counter()
    state = program.init(jax.random.key(tr.seed))
    step_fn = program.step.lower(state, program.abstract_batch()).compile()
    log.info("initialised and compiled in %.1f s", time.perf_counter() - t)

    tokens_per_step = tr.global_batch * cfg.model.seq_len
    records: list[dict] = []
    last = {"time": time.perf_counter(), "step": 0}

    def record(step: int, metrics: dict) -> None:
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for step `step`
        now = time.perf_counter()
        step_time = (now - last["time"]) / (step - last["step"])
        last.update(time=now, step=step)
        rec = {"step": step, **values, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time}
        records.append(rec)
        if metrics_file is not None:
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
        if callback is not None:
            callback(rec)

    pending = None
    try:
        for k in range(tr.steps):
            batch = batch_at(source, k, tr.global_batch, program.batch_sharding)
            state, metrics = step_fn(state, batch)
            if pending is not None:
                record(*pending)
            done = k + 1
            pending = (done, metrics) if done % tr.log_every == 0 or done == tr.steps or done == 1 else None
        if pending is not None:
            record(*pending)
    finally:
        if metrics_file is not None:
            metrics_file.close()
    return records
