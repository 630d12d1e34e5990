"""Shared test helpers: run a few steps of a config on a mesh and collect what parity compares."""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.config import Config
from jaxpar.mesh import make_mesh
from jaxpar.train.data import batch_at, make_source
from jaxpar.train.step import build


def single_device(cfg: Config) -> Config:
    """The same run on one device: mesh (1, 1, 1), no parallelism."""
    return cfg.replace(mesh={"data": 1, "stage": 1, "model": 1})


def run_steps(cfg: Config, devices=None, grads: bool = True) -> dict:
    """Losses of every step, gradients at the initial parameters (first batch), final parameters.

    Runs on the first data x stage x model devices unless `devices` is given.
    """
    if devices is None:
        devices = jax.devices()[:cfg.mesh.data * cfg.mesh.stage * cfg.mesh.model]
    mesh = make_mesh(cfg, devices)
    program = build(cfg, mesh)
    source = make_source(cfg)
    state = program.init(jax.random.key(cfg.train.seed))
    batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(cfg.train.steps)]
    if grads:  # at the initial parameters, on the first batch
        grads = jax.device_get(program.loss_and_grads(state.params, batches[0])[1])
    losses = []
    for batch in batches:
        state, metrics = program.step(state, batch)
        losses.append(float(metrics["loss"]))
    return {"losses": np.array(losses), "grads": grads, "params": jax.device_get(state.params)}


def run_reference(cfg: Config, grads: bool = True) -> dict:
    return run_steps(single_device(cfg).replace(parallel={"zero": 0, "microbatches": 1}),
                     devices=jax.devices()[:1], grads=grads)


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
