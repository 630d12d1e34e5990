"""The ("data", "stage", "model") device mesh, and simulated CPU devices.

Mode: every axis is `AxisType.Auto` (DESIGN.md decision 7). The train step's loss and gradients
run in a shard_map manual over every axis of size > 1, whose collectives jaxpar writes itself
(tensor parallelism's, the data-axis reductions, the pipeline's hops); GSPMD places the rest from
the shardings: the all-gather of updated parameters under ZeRO-1/2, the gradient norm's partial
sums, the interleaved layer reordering, and all of generation's tensor parallelism
(`jaxpar.generate`). Explicit axes would refuse ops such as a row-parallel matmul or a gather
from a vocab-sharded embedding without a per-op `out_sharding`. A user who brings a mesh with
Explicit axes gets a clear error.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import warnings

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.config import Config, ConfigError, resolve_mesh_shape
from jaxpar.parallel.checks import check_batch, check_data_axis, check_model_axis, check_stage_axis

AXES = ("data", "stage", "model")


# XLA's CPU client runs every device's program on one shared pool of max(cores, devices) threads,
# and a collective holds its thread until every participant has arrived. Its executor starts a
# device's collectives in program order but runs independent ones side by side (a pipeline tick's
# stage hop beside an all-reduce of the other action: `optimization_barrier` orders the HLO
# schedule, not the runtime), so one thread per device is not always enough: every thread can end
# up waiting while a device that they wait for has its next op queued behind them. With 8 devices
# on 8 threads, interleaved 1F1B on (2, 2, 2) with tensor parallelism hung within 300 steps, idle or
# loaded; with 32 or 64 threads no pipelined program hung (README, 3D composition). Eight threads
# per device leave room for every collective a step can have in flight, for 5-20% of step time on
# 2 cores (measured in README).
#
# A device whose step never has two collectives in flight at once needs no more than one thread
# per device: the collective that every waiting thread sits in (they all wait in the earliest
# unfinished one, since every device starts them in the same order) can only lack a device that
# holds no thread, and that device gets one. That is the ZeRO-0 step on a data-only mesh: its
# collectives are all-reduces over `data` (each layer's gradients inside the backward scan, the
# rest after it), and XLA combines independent all-reduces over one group into one, so each
# follows the last (`jaxpar.inspect.collectives_in_flight` counts them in the compiled step). Tensor
# parallelism (model-axis collectives beside the data-axis reduction), ZeRO-1/2/3 (one all-gather
# or reduce-scatter per sharded leaf, not combined: 5-22 in flight on small llamas) and
# pipelines can have several, and get the large pool.
CPU_THREADS_PER_DEVICE = 8
# What `use_cpu_devices` adds to XLA_FLAGS (unless XLA_FLAGS already sets this flag).
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def cpu_threads() -> int:
    """Threads of the CPU client's pools as XLA sizes them (before the device-count floor)."""
    for name in ("PJRT_NPROC", "NPROC"):  # what XLA reads, in its order
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return os.cpu_count() or 1


def one_collective_at_a_time(cfg: Config) -> bool:
    """Whether every device runs `cfg`'s step with at most one collective in flight: ZeRO-0 on a
    data-only mesh (no pipeline stages, no tensor parallelism)."""
    return cfg.mesh.stage == 1 and cfg.mesh.model == 1 and cfg.parallel.zero == 0


def cpu_threads_needed(n: int, cfg: Config | None = None) -> int:
    """Threads the CPU client needs for `n` simulated devices running `cfg`'s step (any step when
    `cfg` is None): one per device (XLA's own floor) when a device never has two collectives in
    flight, else `CPU_THREADS_PER_DEVICE` per device."""
    return n if cfg is not None and one_collective_at_a_time(cfg) else CPU_THREADS_PER_DEVICE * n


def use_cpu_devices(n: int | None, cfg: Config | None = None) -> None:
    """Run on `n` simulated CPU devices (even on a GPU host), with a thread pool large enough for
    their collectives: `cpu_threads_needed(n, cfg)`, for any program when `cfg` is not given (as
    the test suite does), else for `cfg`'s step. XLA's own pool (max(cores, n) threads) is kept
    when it is enough: a larger one splits every op into more tasks than 2 cores can run. With
    `cfg` (a training process) and `runtime.cpu_malloc: keep`, also `keep_freed_memory`. Must run
    before JAX starts a backend; a PJRT_NPROC already set is kept."""
    if n is None:
        return
    need = cpu_threads_needed(n, cfg)
    if "PJRT_NPROC" not in os.environ and need > max(cpu_threads(), n):  # read by XLA when the CPU client starts
        os.environ["PJRT_NPROC"] = str(need)
    # JAX lowers every collective with channel id 1, and XLA:CPU keys a collective's rendezvous by
    # (devices, channel id): two collectives over one group in flight at once on a device can meet
    # each other's participants. The concurrency-optimized scheduler lets them overlap; with it,
    # TP + ZeRO-2 + accumulation on (2, 1, 4) aborted or summed wrong gradients in 3 of 11 runs on
    # jax 0.10.2 (0 of 24 without it). README, "Simulated devices run one collective per group".
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + CPU_SCHEDULER_FLAG).strip()
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
        if cfg is not None and cfg.runtime.cpu_malloc == "keep":
            keep_freed_memory()  # (no backend yet: none of XLA's threads has an arena)
    except RuntimeError:
        # The backend is already up: fine if it already has what was asked for.
        have = jax.local_device_count()
        if jax.default_backend() != "cpu" or have != n:
            raise ConfigError(
                f"runtime.cpu_devices = {n} cannot be applied: JAX already started with {have} "
                f"{jax.default_backend()} device(s); set it before anything touches JAX "
                f"(or set XLA_FLAGS=--xla_force_host_platform_device_count={n}).") from None


# XLA:CPU allocates an execution's buffers when it starts (a pipelined step of the benchmarks'
# llama: 64 MiB of temp per device) and frees them when it ends. glibc serves blocks above 32 MiB
# with a fresh mmap (and a thread's arena, whose heaps are at most 64 MiB, maps larger ones
# anyway) and unmaps them on free, so every step faults its whole working set in again, a zeroed
# 4 KiB page at a time: 0.1-0.4 s of kernel time per step on the benchmarks' steps, varying with
# what else runs. With one arena, no mmap and a trim threshold of 2 GiB, the freed memory stays in
# the heap and the next step reuses it: README "A CPU training process keeps the memory its steps
# free" (3D composition), DESIGN.md §9.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse instead of returning it to the kernel: one arena,
    no mmap, trim past 2 GiB free (`runtime.cpu_malloc: keep`, which `use_cpu_devices(n, cfg)`
    applies before JAX starts a backend). Returns whether it was set: only on Linux with glibc,
    and not where GLIBC_TUNABLES already sets any of these (the user's choice)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    mine = ("glibc.malloc.arena_max", "glibc.malloc.mmap_max", "glibc.malloc.trim_threshold",
            "glibc.malloc.mmap_threshold")
    if any(t.split("=", 1)[0] in mine for t in os.environ.get("GLIBC_TUNABLES", "").split(":")):
        return False
    import ctypes

    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all([mallopt(M_ARENA_MAX, 1), mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, 2**31 - 1)])


def _launcher() -> str | None:
    """The multi-process launcher this process runs under, if any (what jax.distributed detects)."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in env:
        return "SLURM"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "Open MPI"
    if "JAX_COORDINATOR_ADDRESS" in env:
        return "JAX_COORDINATOR_ADDRESS"
    return None


def start_processes(cfg: Config) -> None:
    """Join a multi-process run with `jax.distributed.initialize` before JAX starts a backend.

    With runtime.coordinator / num_processes / process_id given, those are used; otherwise JAX
    detects the launcher (SLURM `srun`, Open MPI `mpirun`, Kubernetes through
    JAX_COORDINATOR_ADDRESS). A single process does nothing. CPU processes exchange collectives
    through gloo (simulated devices: `runtime.cpu_devices` per process)."""
    rt = cfg.runtime
    if jax.distributed.is_initialized():
        return
    if rt.num_processes is not None:
        if rt.num_processes == 1:
            return
        kwargs = {"coordinator_address": rt.coordinator, "num_processes": rt.num_processes,
                  "process_id": rt.process_id}
    elif _launcher() is not None:
        kwargs = {}
    else:
        return
    if rt.cpu_devices is not None or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as e:
        raise ConfigError(f"jax.distributed.initialize({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) "
                          f"failed ({str(e).splitlines()[0][:200]}); check runtime.coordinator and that every "
                          "process was started.") from None


def make_mesh(cfg: Config, devices: list | None = None) -> Mesh:
    """Build the mesh for `cfg` over `devices` (default: all devices), `model` innermost.

    `jax.make_mesh` orders devices by the physical topology, so the innermost axis (`model`,
    the chattiest) lands on the most tightly connected devices (one node's NVLink domain)
    and `data`, the outermost, spans nodes.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(cfg.mesh, len(devices))
    check_sizes(cfg, shape)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def check_sizes(cfg: Config, shape: tuple[int, int, int]) -> None:
    """What the config requires of resolved (data, stage, model) sizes."""
    check_batch(cfg, shape[0])
    check_data_axis(cfg, shape[0])
    check_stage_axis(cfg, shape[1])
    check_model_axis(cfg, shape[2])


def check_mesh(mesh: Mesh) -> None:
    """Refuse a user-built mesh that jaxpar cannot run on, in one sentence."""
    if tuple(mesh.axis_names) != AXES:
        raise ConfigError(f"mesh axes {tuple(mesh.axis_names)} must be {AXES}; build the mesh with "
                          "jaxpar.mesh.make_mesh(config).")
    explicit = [a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Auto]
    if explicit:
        raise ConfigError(f"mesh axes {explicit} are not AxisType.Auto, but jaxpar places collectives "
                          "through sharding constraints on Auto axes; build the mesh with "
                          "jaxpar.mesh.make_mesh(config) or pass axis_types=(AxisType.Auto,) * 3.")


def check_cpu_threads(mesh: Mesh, cfg: Config | None = None) -> None:
    """Warn, once, when simulated CPU devices share too few threads for the collectives of `cfg`'s
    step (of any step without `cfg`): a hang risk, see `cpu_threads_needed`; `use_cpu_devices`
    sets enough before JAX starts."""
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    n = len(devices)
    if cfg is not None:  # the mesh's own sizes, whatever the config's -1 resolved to
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **{a: mesh.shape[a] for a in AXES}))
    need = cpu_threads_needed(n, cfg)
    if n < 2 or devices[0].platform != "cpu" or max(cpu_threads(), n) >= need:
        return
    warnings.warn(f"{n} CPU devices share {max(cpu_threads(), n)} threads, and collectives running side by "
                  f"side can exhaust them and hang; set PJRT_NPROC={need} before JAX "
                  "starts (or call jaxpar.mesh.use_cpu_devices).", RuntimeWarning, stacklevel=3)


def describe(mesh: Mesh, cfg: Config | None = None) -> str:
    """One line per axis: its size and the strategy on it (with `cfg`, context parallelism's
    groups on `data`); then the device grid."""
    roles = {"data": "data parallelism", "stage": "pipeline stages", "model": "tensor parallelism"}
    if cfg is not None and cfg.parallel.context > 1:
        c = cfg.parallel.context
        roles["data"] = (f"data parallelism; context parallelism: groups of {c} ranks split each sequence, "
                         f"{cfg.parallel.context_attention} attention")
    lines = [f"  {a:<6} {mesh.shape[a]:>3}  ({roles[a]})" for a in AXES]
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    kind = mesh.devices.flat[0].device_kind
    lines.append(f"  devices: {mesh.devices.size} x {kind}; ids by (data, stage, model): "
                 + np.array2string(ids, separator=",").replace("\n", ""))
    return "\n".join(lines)
