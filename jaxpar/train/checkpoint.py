"""Checkpoints (orbax): asynchronous, keep-N, in the canonical layout, restorable onto any mesh.

A checkpoint is `<run_dir>/checkpoints/<step>/` with two items:
- `state`: the train state as global arrays: `step`, `params` (the canonical layout, blocks stacked
  `[layers, ...]`, whatever the mesh, schedule or ZeRO stage that saved them), `opt_state` (Adam's
  moments, shaped like the parameters), `skipped`. Orbax writes each array as the shards its
  devices hold (OCDBT), so saving never gathers a whole parameter on one host.
- `meta` (JSON): the resolved config it was saved with, the data position (`step`: the batch the
  run continues with), every parameter's shape, the optimizer state's tree structure, the mesh
  and the process count.

Restoring reads the arrays straight into the shardings of the program that restores them (any
data/stage/model sizes, schedule, ZeRO stage, process count): orbax reads the slices each
device needs. Orbax writes a checkpoint to a temporary directory and renames it when complete, so
an interrupted save is never listed; a complete one whose files were damaged later fails to
restore, is moved aside to `<step>.corrupt` with a warning, and the previous one is used.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax

from jaxpar.config import Config, JaxparError, to_yaml

log = logging.getLogger("jaxpar")

SUBDIR = "checkpoints"


def _version() -> str:
    from jaxpar import __version__

    return __version__


class CheckpointError(JaxparError):
    """A checkpoint that cannot serve this config (shapes, optimizer), or none usable."""


def directory(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), SUBDIR)


def saved_steps(run_dir: str) -> list[int]:
    """Steps of the complete checkpoints in run_dir, oldest first (temporary and corrupt ones excluded)."""
    d = directory(run_dir)
    if not os.path.isdir(d):
        return []
    return sorted(int(name) for name in os.listdir(d) if name.isdigit() and os.path.isdir(os.path.join(d, name)))


def _keystr(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def param_shapes(params: Any) -> dict[str, list[int]]:
    """{"blocks.attn.wq": [L, D, N, H], ...} in tree order."""
    return {_keystr(p): list(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def _as_dict(state) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state, "skipped": state.skipped}


def read_meta(run_dir: str, step: int) -> dict:
    path = os.path.join(directory(run_dir), str(step), "meta", "metadata")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {os.path.dirname(os.path.dirname(path))!r} has no readable metadata "
                              f"({type(e).__name__}); it is damaged: delete it, or resume from another run_dir.") from None


def check_compatible(meta: dict, where: str, params_abstract: Any, opt_abstract: Any) -> None:
    """One sentence naming the first parameter whose saved shape differs from the config's (or
    the optimizer state's structure)."""
    check_compatible_params(meta, where, params_abstract)
    if meta["opt_structure"] != str(jax.tree.structure(opt_abstract)):
        raise CheckpointError(
            f"checkpoint {where!r} holds optimizer state of another structure than this config's optimizer "
            "(train.grad_clip switched between 0 and positive, or train.master_weights changed?); resume with the optimizer settings it was "
            "saved with or use a new train.run_dir.")


def check_compatible_params(meta: dict, where: str, params_abstract: Any) -> None:
    want = param_shapes(params_abstract)
    have = meta["param_shapes"]
    for name, shape in want.items():
        if name not in have:
            raise CheckpointError(
                f"checkpoint {where!r} has no parameter `{name}` that the config's model needs (it was saved by "
                f"a {meta['config']['model']['arch']} model); resume with the model section it was saved with "
                "(its config is in the checkpoint's meta) or use a new train.run_dir.")
        if list(have[name]) != shape:
            raise CheckpointError(
                f"checkpoint {where!r} holds parameter `{name}` with shape {tuple(have[name])}, but the config's "
                f"model gives it shape {tuple(shape)}; resume with the model section it was saved with "
                "(its config is in the checkpoint's meta) or use a new train.run_dir.")
    extra = [n for n in have if n not in want]
    if extra:
        raise CheckpointError(f"checkpoint {where!r} holds parameter `{extra[0]}` that the config's model does not "
                              "have; resume with the model section it was saved with or use a new train.run_dir.")


class Checkpoints:
    """Saving and restoring the train state of one run (one `Program`)."""

    def __init__(self, cfg: Config, run_dir: str | None = None):
        """Checkpoints of `cfg`'s run in cfg.train.run_dir (or `run_dir`, e.g. a temporary one)."""
        self.cfg = cfg
        self.run_dir = cfg.train.run_dir if run_dir is None else run_dir
        self.dir = directory(self.run_dir)
        self._manager = None
        self.last_saved: int | None = None

    # ---------------------------------------------------------------- checks before anything is written

    def check_resume_rules(self) -> None:
        steps = saved_steps(self.run_dir)
        if steps and self.cfg.train.resume == "never":
            raise CheckpointError(
                f"train.run_dir = {self.cfg.train.run_dir!r} already holds checkpoints (steps {steps}) and "
                "train.resume = never would overwrite them; set train.resume=auto to continue that run, or choose "
                "a new train.run_dir.")

    def candidate(self, program) -> int | None:
        """The newest checkpoint step to resume from (its meta checked against `program`), or None."""
        if self.cfg.train.resume == "never":
            return None
        steps = saved_steps(self.run_dir)
        if not steps:
            return None
        step = steps[-1]
        abstract = program.abstract_state()
        check_compatible(read_meta(self.run_dir, step), os.path.join(self.dir, str(step)),
                         abstract.params, abstract.opt_state)
        return step

    # ---------------------------------------------------------------- orbax

    @property
    def manager(self):
        if self._manager is None:
            import orbax.checkpoint as ocp

            tr = self.cfg.train
            options = ocp.CheckpointManagerOptions(max_to_keep=tr.keep_checkpoints, create=True,
                                                   enable_async_checkpointing=tr.async_checkpoint)
            self._manager = ocp.CheckpointManager(self.dir, options=options)
        return self._manager

    def save(self, state, mesh) -> str:
        """Start saving `state` (asynchronously if configured); returns the checkpoint's directory."""
        import orbax.checkpoint as ocp

        step = int(jax.device_get(state.step))
        path = os.path.join(self.dir, str(step))
        if step == self.last_saved or step in self.manager.all_steps():
            return path
        meta = {"step": step, "config": self.cfg.to_dict(), "config_yaml": to_yaml(self.cfg),
                "param_shapes": param_shapes(state.params), "opt_structure": str(jax.tree.structure(state.opt_state)),
                "mesh": {a: int(s) for a, s in mesh.shape.items()}, "process_count": jax.process_count(),
                "jaxpar_version": _version()}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_as_dict(state)),
                                                        meta=ocp.args.JsonSave(meta)))
        self.last_saved = step
        return path

    def wait(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    def restore(self, program, first: int):
        """Restore the newest restorable checkpoint at or before step `first` into `program`'s
        shardings; a damaged one is moved aside with a warning and the previous one tried."""
        import orbax.checkpoint as ocp

        from jaxpar.train.step import TrainState

        abstract = _as_dict(program.abstract_state())
        for step in reversed([s for s in saved_steps(self.run_dir) if s <= first]):
            path = os.path.join(self.dir, str(step))
            try:
                check_compatible(read_meta(self.run_dir, step), path, abstract["params"],
                                 abstract["opt_state"])
                restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
                state = restored.state
                return TrainState(state["step"], state["params"], state["opt_state"], state["skipped"]), step
            except Exception as e:  # noqa: BLE001  (any failure to read a checkpoint means: damaged)
                if isinstance(e, CheckpointError) and step == first:
                    raise
                reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                log.warning("warning: checkpoint %s is damaged and cannot be restored (%s); moving it to "
                            "%s.corrupt and trying the previous one", path, reason, path)
                self._move_aside(path)
        raise CheckpointError(f"no checkpoint in {self.dir!r} could be restored (each was damaged and moved aside "
                              "to <step>.corrupt); set train.resume=never with a new train.run_dir to start afresh.")

    def _move_aside(self, path: str) -> None:
        if self._manager is not None:  # its cached step list would still name the moved step
            self.close()
        if jax.process_index() == 0:
            target = path + ".corrupt"
            n = 1
            while os.path.exists(target):
                n += 1
                target = f"{path}.corrupt{n}"
            os.rename(path, target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxpar: corrupt checkpoint moved aside")


def run_config(run_dir: str, step: int | None = None) -> tuple[Config, int]:
    """The config a run's checkpoint (default: the newest) was saved with, and its step."""
    from jaxpar.config import from_dict

    steps = saved_steps(run_dir)
    if not steps:
        raise CheckpointError(f"run_dir {run_dir!r} holds no checkpoint ({directory(run_dir)!r} is empty or missing); "
                              "train with train.checkpoint_every > 0, or pass a run_dir that has one.")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise CheckpointError(f"run_dir {run_dir!r} has no checkpoint of step {step} (it has {steps}); pick one of those.")
    return from_dict(read_meta(run_dir, step)["config"]), step


def restore_params(run_dir: str, shardings: Any = None, step: int | None = None) -> tuple[Config, Any]:
    """(config, params) of a run's checkpoint (default: the newest), without the optimizer state.

    `shardings` is a pytree of shardings like the parameters, or a function of the config that
    returns one (default: everything on the first device). For generation and export."""
    import orbax.checkpoint as ocp

    from jaxpar import model

    cfg, step = run_config(run_dir, step)
    if callable(shardings):
        shardings = shardings(cfg)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, model.param_shapes(cfg.model))
    check_compatible_params(read_meta(run_dir, step), os.path.join(directory(run_dir), str(step)),
                            model.param_shapes(cfg.model))
    abstract = {"params": jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                       model.param_shapes(cfg.model), shardings)}
    manager = ocp.CheckpointManager(directory(run_dir), options=ocp.CheckpointManagerOptions(read_only=True))
    try:  # only the parameters are read (partial restore)
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract), partial_restore=True)))
    finally:
        manager.close()
    return cfg, restored.state["params"]


def save_initial(cfg: Config, params: Any, run_dir: str | None = None) -> str:
    """A step-0 checkpoint of `params` with a fresh optimizer state, written synchronously into
    `run_dir` (default cfg.train.run_dir): a run directory that `python -m jaxpar.train` continues
    from (fine-tuning), and that generation and export read. `params` may live on any devices."""
    import jax.numpy as jnp

    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import TrainState, build

    one = cfg.replace(mesh={"data": 1, "stage": 1, "model": 1},
                      parallel={"zero": 0, "microbatches": 1, "virtual_stages": 1, "stage_layers": None,
                                "sequence_parallel": False})
    program = build(one, make_mesh(one, jax.devices()[:1]))
    params = jax.device_put(params, program.state_shardings.params)
    opt_state = jax.jit(program.optimizer.init, out_shardings=program.state_shardings.opt_state)(params)
    zero = jax.device_put(jnp.zeros((), jnp.int32), program.state_shardings.step)
    ckpt = Checkpoints(cfg.replace(train={"async_checkpoint": False}), run_dir)
    try:
        return ckpt.save(TrainState(zero, params, opt_state, zero), program.mesh)
    finally:
        ckpt.close()
