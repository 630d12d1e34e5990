"""Checkpoints (orbax): asynchronous, keep-N, in the canonical layout, restorable onto any mesh.

A checkpoint is `<run_dir>/checkpoints/<step>/` with two items:
- `state`: the train state as global arrays: `step`, `params` (the canonical layout, blocks stacked
  `[layers, ...]`, whatever the mesh, schedule or ZeRO stage that saved them), `opt_state` (Adam's
  moments, shaped like the parameters), `skipped`. Orbax writes each array as the shards its
  devices hold (OCDBT), so saving never gathers a whole parameter on one host.
- `meta` (JSON): the resolved config it was saved with, the data position (`step`: the batch the
  run continues with), every parameter's shape, the optimizer state's tree structure, the mesh
  and the process count.
Empty arrays of the optimizer state (Muon's placeholder second moments, `jaxpar.train.muon`) are
not written (orbax refuses zero-size arrays): they are saved as empty nodes and made again, empty,
on restore.

A checkpoint saved with another `train.optimizer` (adamw, muon) than the config's is refused in
one sentence; `train.reset_optimizer: true` resumes its parameters, step and skipped count instead,
with a fresh optimizer state (likewise for an optimizer state of another structure).

Restoring reads the arrays straight into the shardings of the program that restores them (any
data/stage/model sizes, schedule, ZeRO stage, process count): orbax reads the slices each
device needs. Orbax writes a checkpoint to a temporary directory and renames it when complete, so
an interrupted save is never listed; a complete one whose files were damaged later fails to
restore, is moved aside to `<step>.corrupt` with a warning, and the previous one is used.

Only damage is damage (`damage()`): a checkpoint is moved aside when reading it fails because of
its files, namely
- a file of it is missing (FileNotFoundError naming a path inside it, or tensorstore NOT_FOUND);
- a file is truncated or its bytes do not decode (tensorstore OUT_OF_RANGE or DATA_LOSS naming a
  path inside it; a JSON, UTF-8 or msgpack decode error);
- its format does not hold: `meta/metadata` unreadable or not jaxpar's, `state/_METADATA` or the
  OCDBT manifest missing or unreadable (`DamagedCheckpoint`).
Anything else propagates unchanged and renames nothing: out of memory (MemoryError, XLA's
RESOURCE_EXHAUSTED), a sharding or shape error of the restoring program, a checkpoint of another
model (CheckpointError), and every other OSError, EIO and ESTALE included: an I/O error may be a
network file system's transient fault as well as a bad disk, jaxpar cannot tell them apart, and a
checkpoint wrongly moved aside costs the run its progress, while a wrongly kept one costs a rerun.
With several processes each one classifies its own outcome and all of them agree (an allgather)
before anything is renamed: one failure that is not damage stops every process, damage seen by any
process moves the checkpoint aside on all of them, and no process waits for another that gave up.

Saving writes jax.Arrays without orbax's replica parallelism (`_save_registry`: its slicing
programs stayed compiled for the rest of the run) and hands the host memory a finished save freed
back to the OS (`release_host_memory`); README's "Memory of saving" has the measurements.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax

from jaxpar.config import Config, JaxparError, from_dict, to_yaml
from jaxpar.version import __version__

log = logging.getLogger("jaxpar")

SUBDIR = "checkpoints"


def _version() -> str:
    return __version__


class CheckpointError(JaxparError):
    """A checkpoint that cannot serve this config (shapes, optimizer), or none usable."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are missing or do not hold jaxpar's format."""


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


def _is_empty(x) -> bool:
    return x is not None and hasattr(x, "shape") and 0 in x.shape


def _without_empty(tree: Any) -> Any:
    """`tree` with its zero-size arrays (or their ShapeDtypeStructs) as None: what is written."""
    return jax.tree.map(lambda x: None if _is_empty(x) else x, tree)


def _with_empty(restored: Any, abstract: Any) -> Any:
    """The restored tree with `abstract`'s zero-size leaves made again (empty, on their shardings)."""
    import numpy as np

    def fill(a, r):
        if not _is_empty(a):
            return r
        empty = np.zeros(a.shape, a.dtype)
        return jax.device_put(empty, a.sharding) if getattr(a, "sharding", None) is not None else empty

    return jax.tree.map(fill, abstract, restored, is_leaf=_is_empty)


def saved_optimizer(meta: dict) -> str:
    """The `train.optimizer` a checkpoint was saved with (adamw before the key existed)."""
    return meta["config"].get("train", {}).get("optimizer", "adamw")


_META_KEYS = ("step", "config", "param_shapes", "opt_structure")


def read_meta(run_dir: str, step: int) -> dict:
    path = os.path.join(directory(run_dir), str(step), "meta", "metadata")
    try:
        with open(path) as f:
            meta = json.load(f)
        problem = None if isinstance(meta, dict) and all(k in meta for k in _META_KEYS) else "not jaxpar's metadata"
    except FileNotFoundError:
        problem = "missing"
    except ValueError as e:  # JSON or UTF-8 decoding
        problem = f"{type(e).__name__}: {e}"
    if problem is not None:
        raise DamagedCheckpoint(f"checkpoint {os.path.dirname(os.path.dirname(path))!r} has no readable metadata "
                                f"({problem}); it is damaged: delete it, or resume from another run_dir.")
    return meta


# tensorstore's status codes for a file that is absent, shorter than its index says, or undecodable.
_DAMAGE_STATUS = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS")


def _decode_errors() -> tuple[type, ...]:
    errors: tuple[type, ...] = (json.JSONDecodeError, UnicodeDecodeError)
    try:
        import msgpack

        errors += (msgpack.exceptions.UnpackException, msgpack.exceptions.ExtraData)
    except (ImportError, AttributeError):
        pass
    return errors


def damage(error: BaseException, path: str) -> str | None:
    """Why `error`, raised while restoring the checkpoint in `path`, shows that checkpoint is
    damaged (a line for the warning), or None when it does not (the module's docstring has the rule)."""
    path = os.path.abspath(path)
    if isinstance(error, DamagedCheckpoint):
        return str(error)
    if isinstance(error, (FileNotFoundError, NotADirectoryError)):
        where = str(error.filename or error)
        return f"{type(error).__name__}: {error}" if path in where else None
    if isinstance(error, _decode_errors()):
        return f"{type(error).__name__}: {error}"
    text = str(error)
    if isinstance(error, ValueError) and text.split(":", 1)[0] in _DAMAGE_STATUS and path in text:
        return text
    return None


def check_format(path: str) -> None:
    """The files orbax reads first exist and decode (`DamagedCheckpoint` otherwise): without them
    orbax reports a missing tree metadata as a pytree-structure error, indistinguishable from a bug."""
    tree = os.path.join(path, "state", "_METADATA")
    try:
        with open(tree) as f:
            json.load(f)
    except FileNotFoundError:
        raise DamagedCheckpoint(f"checkpoint {path!r} has no tree metadata ({tree} is missing); it is damaged: "
                                "delete it, or resume from another run_dir.") from None
    except ValueError as e:
        raise DamagedCheckpoint(f"checkpoint {path!r} has unreadable tree metadata ({tree}: {type(e).__name__}); "
                                "it is damaged: delete it, or resume from another run_dir.") from None
    manifest = os.path.join(path, "state", "manifest.ocdbt")
    if not os.path.isfile(manifest):
        raise DamagedCheckpoint(f"checkpoint {path!r} has no array index ({manifest} is missing); it is damaged: "
                                "delete it, or resume from another run_dir.")


# Outcome of one process's attempt at a checkpoint.
OK, DAMAGED, FAILED = 0, 1, 2


def agree(outcome: int) -> list[int]:
    """Every process's outcome (OK, DAMAGED or FAILED) of restoring the same checkpoint; all
    processes call it, whatever happened to them (one process: `[outcome]`)."""
    if jax.process_count() == 1:
        return [outcome]
    import numpy as np
    from jax.experimental import multihost_utils

    return [int(x) for x in np.asarray(multihost_utils.process_allgather(np.int32(outcome))).reshape(-1)]


def decide(outcomes: list[int]) -> int:
    """What all processes do with a checkpoint: FAILED if any process failed otherwise than by
    damage (stop, rename nothing), else DAMAGED if any found it damaged (move it aside), else OK."""
    return max(outcomes)


def check_compatible(meta: dict, where: str, params_abstract: Any, opt_abstract: Any, optimizer: str = "adamw",
                     reset: bool = False) -> bool:
    """One sentence naming the first parameter whose saved shape differs from the config's (or
    the optimizer: another `train.optimizer`, or a state of another structure). With `reset`
    (`train.reset_optimizer`) an optimizer state that does not fit is no error: returns True when
    the resumed run is to start a fresh optimizer state, False when the saved one fits."""
    check_compatible_params(meta, where, params_abstract)
    if meta["opt_structure"] == str(jax.tree.structure(opt_abstract)):
        return False
    if reset:
        return True
    saved = saved_optimizer(meta)
    if saved != optimizer:
        raise CheckpointError(
            f"checkpoint {where!r} was saved with train.optimizer = {saved}, but this config trains with "
            f"train.optimizer = {optimizer}; resume with train.optimizer={saved}, or set train.reset_optimizer=true "
            f"to keep its parameters and step and start a fresh {optimizer} state.")
    raise CheckpointError(
        f"checkpoint {where!r} holds optimizer state of another structure than this config's optimizer "
        "(train.grad_clip switched between 0 and positive, or train.master_weights changed?); resume with the optimizer settings it was "
        "saved with, set train.reset_optimizer=true to start a fresh optimizer state, or use a new train.run_dir.")


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


def release_host_memory() -> None:
    """Hand the host memory that a finished save freed back to the OS (glibc's `malloc_trim`).

    The host copies of the arrays are freed when the files are committed, but glibc keeps the
    pages of its per-thread arenas (orbax copies and writes from background threads) for later
    allocations, so they would stay in the process's resident memory until the next save. A no-op
    where the C library is not glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _save_registry(replica_parallel: bool = False):
    """Orbax's type handlers, but jax.Arrays saved without replica parallelism (`replica_parallel`:
    orbax's CPU default, for benchmarks/checkpoint.py's comparison).

    Replica-parallel saving (orbax's default on CPU and TPU; off on GPU) splits each replicated
    array into one slice per replica, each cut by a `jit(slice)` that XLA compiles once per array
    shape, slice and device and that jax keeps cached for the rest of the process: on 8 CPU devices
    the default config's first save compiled 64 of them, which held ~100 MiB of resident memory
    for good (benchmarks/checkpoint.py). Without it each replicated array is written whole by its
    first replica; the files and their format are the same."""
    import numpy as np
    import orbax.checkpoint as ocp

    th = ocp.type_handlers
    try:  # the per-array metadata file orbax's default handler writes (array_metadatas/)
        from orbax.checkpoint._src.metadata import array_metadata_store

        store = array_metadata_store.Store()
    except (ImportError, AttributeError):
        store = None
    return th.create_type_handler_registry(
        (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, th.ArrayHandler(use_replica_parallel=replica_parallel, array_metadata_store=store)))


def _is_aborted_read(unraisable) -> bool:
    """The error tensorstore's read callbacks raise when they complete after orbax's restore failed
    on another array and closed its event loop: `RuntimeError('Event loop is closed')`, reported
    with no object. Harmless: the failed restore has been handled (`restore`)."""
    e = unraisable.exc_value
    return unraisable.object is None and isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


def _ignore_reads_after_a_failed_restore() -> None:
    """A damaged checkpoint costs one warning line: drop the 30-50 `Event loop is closed`
    tracebacks that the failed read's remaining callbacks would print (Python's unraisable hook)
    and pass every other unraisable error on to the hook installed before. Installed once."""
    import sys

    previous = sys.unraisablehook
    if getattr(previous, "_jaxpar", False):
        return

    def hook(unraisable):
        if not _is_aborted_read(unraisable):
            previous(unraisable)

    hook._jaxpar = True
    sys.unraisablehook = hook


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
        abstract = program.abstract_state()
        for step in reversed(steps):  # the newest readable metadata (a damaged one is restore's to move aside)
            try:
                meta = read_meta(self.run_dir, step)
            except DamagedCheckpoint:
                continue
            check_compatible(meta, os.path.join(self.dir, str(step)), abstract.params, abstract.opt_state,
                             self.cfg.train.optimizer, self.cfg.train.reset_optimizer)
            break
        return steps[-1]

    # ---------------------------------------------------------------- orbax

    @property
    def manager(self):
        if self._manager is None:
            import orbax.checkpoint as ocp

            tr = self.cfg.train
            options = ocp.CheckpointManagerOptions(
                max_to_keep=tr.keep_checkpoints, create=True, enable_async_checkpointing=tr.async_checkpoint,
                async_options=ocp.AsyncOptions(post_finalization_callback=release_host_memory)
                if tr.async_checkpoint else None)
            self._manager = ocp.CheckpointManager(
                self.dir, options=options,
                item_handlers={"state": ocp.PyTreeCheckpointHandler(type_handler_registry=_save_registry()),
                               "meta": ocp.JsonCheckpointHandler()})
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
        if self.cfg.parallel.data_mode == "naive":  # device 0's optimizer slot, in the canonical layout
            from jaxpar.parallel.naive import canonical_opt_state_on

            state = state._replace(opt_state=canonical_opt_state_on(state.opt_state, mesh))
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_without_empty(_as_dict(state))),
                                                        meta=ocp.args.JsonSave(meta)))
        self.last_saved = step
        if not self.cfg.train.async_checkpoint:
            release_host_memory()
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
        shardings; a damaged one is moved aside with a warning and the previous one tried. Any
        other failure propagates and leaves the checkpoints as they are (the module's docstring)."""
        from jaxpar.train.step import TrainState

        abstract = _as_dict(program.abstract_state())
        naive = program.cfg.parallel.data_mode == "naive"
        if naive:  # saved canonical (any mode's checkpoint), expanded to device 0's slot after reading
            from jaxpar.parallel.naive import canonical_abstract_opt_state, from_canonical_opt_state

            abstract["opt_state"] = canonical_abstract_opt_state(program)
        tr = program.cfg.train
        for step in reversed([s for s in saved_steps(self.run_dir) if s <= first]):
            path = os.path.join(self.dir, str(step))
            state = error = reason = None
            try:
                meta = read_meta(self.run_dir, step)
                check_format(path)
                reset = check_compatible(meta, path, abstract["params"], abstract["opt_state"], tr.optimizer,
                                         self.cfg.train.reset_optimizer)
                state = self._read(path, abstract, fresh_optimizer=reset)
            except Exception as e:  # noqa: BLE001  (classified below, and re-raised unless it is damage)
                error, reason = e, damage(e, path)
            outcomes = agree(OK if error is None else DAMAGED if reason is not None else FAILED)
            verdict = decide(outcomes)
            if verdict == FAILED:
                if error is not None and reason is None:
                    error.add_note(f"jaxpar: raised while restoring checkpoint {path}; this is not damage to the "
                                   "checkpoint's files, so every checkpoint was left as it is.")
                    raise error
                failed = [i for i, o in enumerate(outcomes) if o == FAILED]
                raise CheckpointError(
                    f"process {failed[0]} failed to restore checkpoint {path!r} with an error that is not damage "
                    "(its own log names it); every process stops and the checkpoints are left as they are: fix "
                    "that error and rerun.")
            if verdict == DAMAGED:
                if reason is None:
                    damaged = [i for i, o in enumerate(outcomes) if o == DAMAGED]
                    reason = f"process {damaged[0]} could not read it"
                log.warning("warning: checkpoint %s is damaged and cannot be restored (%s); moving it to "
                            "%s.corrupt and trying the previous one", path, reason.strip().splitlines()[0][:300], path)
                del state
                self._move_aside(path)
                continue
            if reset:  # train.reset_optimizer: its parameters, a fresh optimizer state
                state["opt_state"] = jax.jit(program.optimizer.init, out_shardings=program.state_shardings.opt_state)(
                    state["params"])
                log.info("train.reset_optimizer: checkpoint %s holds %s optimizer state that does not fit this "
                         "config's (train.optimizer = %s); resuming its parameters and step %d with a fresh optimizer "
                         "state",
                         path, saved_optimizer(meta), tr.optimizer, step)
            elif naive:
                state["opt_state"] = from_canonical_opt_state(program, state["opt_state"])
            return TrainState(state["step"], state["params"], state["opt_state"], state["skipped"]), step
        raise CheckpointError(f"no checkpoint in {self.dir!r} could be restored (each was damaged and moved aside "
                              "to <step>.corrupt); set train.resume=never with a new train.run_dir to start afresh.")

    @staticmethod
    def _read(path: str, abstract: dict, fresh_optimizer: bool = False) -> dict:
        """The `state` item of checkpoint `path`, read into `abstract`'s shardings (without the
        optimizer state with `fresh_optimizer`: its "opt_state" is then None).

        The handler directly, not the manager: the manager's restore ends in a barrier of all
        processes, where the others would wait forever for one whose read failed; `restore`'s
        agreement is the barrier instead."""
        import orbax.checkpoint as ocp
        from etils import epath

        _ignore_reads_after_a_failed_restore()

        if fresh_optimizer:
            item = {k: v for k, v in abstract.items() if k != "opt_state"}
            handler = ocp.PyTreeCheckpointHandler()
            try:
                state = handler.restore(epath.Path(path) / "state", args=ocp.args.PyTreeRestore(
                    item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
            finally:
                handler.close()
            return {**state, "opt_state": None}
        handler = ocp.StandardCheckpointHandler()
        try:
            state = handler.restore(epath.Path(path) / "state", args=ocp.args.StandardRestore(_without_empty(abstract)))
        finally:
            handler.close()
        return _with_empty(state, abstract)

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


def logged_steps(path: str) -> list[int]:
    """The steps recorded in a metrics.jsonl (none if it does not exist; unreadable lines skipped)."""
    if not os.path.exists(path):
        return []
    steps = []
    with open(path) as f:
        for line in f:
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    return steps


def newest_trained(run_dir: str, allow_stale: bool = False) -> int:
    """The step of run_dir's newest checkpoint, for export and generation; refused when the run's
    metrics.jsonl logs later steps (the checkpoint misses trained work) unless `allow_stale`."""
    steps = saved_steps(run_dir)
    if not steps:
        raise CheckpointError(f"run_dir {run_dir!r} holds no checkpoint ({directory(run_dir)!r} is empty or missing); "
                              "train it to the end (the last step is saved) or pass a run_dir that has one.")
    logged = max(logged_steps(os.path.join(run_dir, "metrics.jsonl")), default=0)
    if logged > steps[-1] and not allow_stale:
        raise CheckpointError(
            f"run_dir {run_dir!r}: its newest checkpoint is of step {steps[-1]} but its metrics.jsonl logs training "
            f"up to step {logged}, so the weights of the last {logged - steps[-1]} steps were never saved; rerun its "
            "train command to resume and save them, or pass --allow-stale to use step "
            f"{steps[-1]} anyway.")
    return steps[-1]


def run_config(run_dir: str, step: int | None = None) -> tuple[Config, int]:
    """The config a run's checkpoint (default: the newest) was saved with, and its step."""
    steps = saved_steps(run_dir)
    if not steps:
        raise CheckpointError(f"run_dir {run_dir!r} holds no checkpoint ({directory(run_dir)!r} is empty or missing); "
                              "train it to the end (the last step is saved) or pass a run_dir that has one.")
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
