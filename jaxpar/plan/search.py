"""Will a model fit, and which layout trains it fastest? Every valid (data, stage, model) layout, ZeRO
stage, schedule, microbatch count and remat policy of a model on a cluster, costed by the cost
model (`jaxpar.plan.memory`, `.collectives`, `.steptime`) and ranked by predicted step time;
`python -m jaxpar.plan` (`jaxpar.plan.command`) prints the table, JSON or the best layout as a
config, or with `--evaluate` the figures of the one layout a config states (`evaluate`, the same
`estimate`). Validity is decided only by jaxpar's own validation (`jaxpar.config.validate`,
`jaxpar.mesh.check_sizes`, the ZeRO layout's refusals), so a layout jaxpar learns to run is
admitted without a change here. What the CLI prints: `jaxpar.plan.report`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from jaxpar.config import Config, ConfigError, resolve_mesh_shape
from jaxpar.mesh import AXES
from jaxpar.model.flops import model_flops_per_token
from jaxpar.plan.collectives import bytes_per_axis, collectives
from jaxpar.plan.memory import check, memory
from jaxpar.plan.steptime import Roofline, compute_floor, step_time


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Everything the planner predicts for one configuration on one mesh."""

    cfg: Config
    shape: tuple[int, int, int]
    memory: dict[str, int]
    flops_per_step: float
    bytes_per_step: dict[str, float]
    time: dict[str, float]
    mfu: float
    fits: bool
    platform: str = "gpu"
    """Where the step runs (`memory`'s and `collectives`' platform)."""

    def to_dict(self, rank: int | None = None) -> dict[str, Any]:
        """One layout's JSON object (`python -m jaxpar.plan --json`'s rows, `--evaluate --json`):
        `rank` is its place among the layouts that fit, fastest first, as the table numbers them
        (None where it does not fit, or where it was evaluated alone)."""
        return {"rank": rank, "mesh": dict(zip(AXES, self.shape)), "parallel": self.cfg.to_dict()["parallel"],
                "master_weights": self.cfg.train.master_weights,
                "memory_bytes": self.memory, "flops_per_step": self.flops_per_step,
                "bytes_per_step": self.bytes_per_step,
                "collectives": [{"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes, "count": c.count}
                                for c in collectives(self.cfg, self.shape, self.platform)],
                "step_time_s": self.time["total"],
                "step_time_parts_s": self.time, "mfu": self.mfu, "fits": self.fits}


def estimate(cfg: Config, shape: tuple[int, int, int], roof: Roofline, platform: str = "gpu") -> Estimate:
    """The planner's figures for `cfg` on a mesh of `shape` (validity is not checked here: `check`)."""
    mem = memory(cfg, shape, platform)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    flops = model_flops_per_token(cfg) * tokens
    t = step_time(cfg, shape, roof, platform)
    hw = roof.hardware
    peak = hw.peak_flops if cfg.model.dtype in ("bfloat16", "float16") else hw.peak_flops_fp32
    mfu = flops / (t["total"] * peak * math.prod(shape))
    return Estimate(cfg, shape, mem, flops, bytes_per_axis(cfg, shape, platform), t, mfu, mem["total"] <= hw.memory_bytes,
                    platform)


def layout_shape(cfg: Config, devices: int | None = None) -> tuple[int, int, int]:
    """The (data, stage, model) sizes `cfg.mesh` states on `devices` devices (`devices` needed only
    where an axis is -1; given, it must be the mesh's product: `config.resolve_mesh_shape`)."""
    sizes = dict(zip(AXES, (cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model)))
    if devices is None:
        free = [a for a, n in sizes.items() if n == -1]
        if free:
            raise ConfigError(f"mesh.{free[0]} = -1 takes its size from the device count, which was not given; "
                              f"pass it (--devices N) or set mesh.{free[0]} to a size.")
        devices = math.prod(sizes.values())
    return resolve_mesh_shape(cfg.mesh, devices)


def evaluate(cfg: Config, roof: Roofline, platform: str = "gpu", devices: int | None = None) -> Estimate:
    """`estimate` of exactly the layout `cfg` states (its mesh, with a -1 axis filled from
    `devices`; ZeRO stage, schedule, microbatches, remat, SP, master weights, offload), whether or
    not `plan` would enumerate or prune it; raises ConfigError where jaxpar's validation (`check`)
    refuses it."""
    shape = layout_shape(cfg, devices)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **dict(zip(AXES, shape))))
    check(cfg, shape)
    return estimate(cfg, shape, roof, platform)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


_REMATS = ("none", "dots", "full")  # by memory saved: a policy later in the list saves at least as much


def stage_split(n_layers: int, p: int) -> tuple[int, ...] | None:
    """Layers per stage for p stages: None when p divides n_layers (the even split); otherwise the
    remainder one each on the middle stages first (the end stages also run the embedding and the
    head), as `parallel.stage_layers`."""
    if n_layers % p == 0 or n_layers < p:
        return None
    counts = [n_layers // p] * p
    for i in ([*range(1, p - 1), 0, p - 1])[:n_layers % p]:
        counts[i] += 1
    return tuple(counts)


def _groups(cfg: Config, devices: int, node_size: int):
    """(data, stage, model), microbatch count and stage split of every candidate group: each
    (data, stage, model) whose product is `devices` with the model axis inside a node and data
    dividing the batch, every divisor of the replica batch as the microbatch count (at least p with
    a pipeline), the stage split of `stage_split`."""
    B = cfg.train.global_batch
    for t in _divisors(devices):
        if t > node_size:
            continue
        for p in _divisors(devices // t):
            d = devices // (t * p)
            per = B // d if B % d == 0 else _context_rows(cfg, (d, p, t))
            if not per:
                continue
            split = stage_split(cfg.model.n_layers, p)
            for m in _divisors(per):
                if p == 1 or m >= p:
                    yield (d, p, t), m, split


def _context_rows(cfg: Config, shape) -> int:
    """Where the batch does not split over `data`, the sequences per device with the least
    context parallelism that splits it (B·c/data; 0 where none does)."""
    d = shape[0]
    for c in sorted({c for c, _ in _contexts(cfg, shape)} - {1}):
        if (cfg.train.global_batch * c) % d == 0:
            return cfg.train.global_batch * c // d
    return 0


def _variants(cfg: Config, shape: tuple[int, int, int], split, m: int | None = None):
    """The ZeRO stage, sequence parallelism (with a model axis), schedule (with a stage axis;
    interleaved, zb_v and dualpipe_v with 2 chunks per stage, where the stages are even; the V
    ones where there is a layer per chunk) and, with 16-bit parameters, a
    float32 master copy or none (`train.master_weights`) of one candidate group."""
    d, p, t = shape
    masters = ("none", "float32") if cfg.model.param_dtype != "float32" else ("none",)
    schedules = [("1f1b", 1)] if p == 1 else [("1f1b", 1), ("zb_h1", 1), ("gpipe", 1), ("1f1b_one_action", 1)]
    if p > 1 and split is None:
        schedules.append(("interleaved_1f1b", 2))
        if cfg.model.n_layers >= 2 * p:  # (a V needs a layer per chunk)
            schedules += [("zb_v", 2), ("dualpipe_v", 2)]
    for zero in (0, 1, 2, 3):
        if d == 1 and zero:
            continue  # nothing to shard over data
        for sp in ((False, True) if t > 1 else (False,)):
            for schedule, v in schedules:
                for master in masters:
                    for ctx in _contexts(cfg, shape):
                        # (each rank's sequences of T/c tokens split into the microbatches)
                        if m is None or (cfg.train.global_batch * ctx[0]) % (d * m) == 0:
                            yield zero, sp, schedule, v, master, ctx


def _contexts(cfg: Config, shape: tuple[int, int, int]):
    """Context parallelism's choices (`parallel.context` c, `parallel.context_attention`): none
    (c 1), and with `data_mode: ddp` each c > 1 dividing the data axis with the sequence cut into
    2c chunks, by all-gather and by ring; under a pipeline by all-gather only (the step refuses
    ring attention there). Dense and MoE models alike (the MoE terms route B·c/(d·m) rows of T/c
    tokens; the router's and capacity mode's gathers over the group are costed)."""
    yield 1, "all_gather"
    d, p, _ = shape
    if cfg.parallel.data_mode != "ddp":
        return
    for c in _divisors(d)[1:]:
        if cfg.model.seq_len % (2 * c) == 0:
            yield c, "all_gather"
            if p == 1:
                yield c, "ring"


def _expert_parallel(cfg: Config, d: int) -> bool:
    """MoE: experts split over `data` where its size divides them, or replicated on d / n_experts
    ranks each where it is a multiple of them (as the config asks), else every data rank holds
    them all (`parallel.expert_parallel: false`, which validation requires there)."""
    m = cfg.model
    return cfg.parallel.expert_parallel and (not m.moe or m.n_experts % d == 0
                                             or (d % m.n_experts == 0 and m.d_model % d == 0))


def _candidate(cfg: Config, shape, m, remat, split, zero, sp, schedule, v, master, ctx=(1, "all_gather")) -> Config:
    d, p, t = shape
    # dataclasses.replace, not Config.replace: these values have the fields' types already, and
    # re-parsing 10^4 configs is slow.
    return dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, data=d, stage=p, model=t),
        parallel=dataclasses.replace(cfg.parallel, zero=zero, sequence_parallel=sp, remat=remat, schedule=schedule,
                                     virtual_stages=v, microbatches=m, stage_layers=split,
                                     expert_parallel=_expert_parallel(cfg, d), context=ctx[0],
                                     context_attention=ctx[1]),
        train=dataclasses.replace(cfg.train, master_weights=master))


def candidates(cfg: Config, devices: int, node_size: int):
    """Every (config, mesh shape) to consider on `devices` devices: each (data, stage, model) whose
    product is `devices` with the model axis inside a node, every stage count (those that do not
    divide the layers with `parallel.stage_layers`, `stage_split`), each ZeRO stage, remat policy,
    sequence parallelism (with a model axis), schedule (with a stage axis; interleaved, zb_v
    and dualpipe_v with 2 chunks per stage), every microbatch count that divides the replica batch (at least p with a
    pipeline), with 16-bit parameters a float32 master copy or none, and context parallelism
    (`_contexts`)."""
    for shape, m, split in _groups(cfg, devices, node_size):
        for remat in _REMATS:
            for variant in _variants(cfg, shape, split, m):
                yield _candidate(cfg, shape, m, remat, split, *variant), shape


@dataclasses.dataclass(frozen=True)
class Plan:
    """Ranked estimates of the configurations that fit, those estimated that do not (by memory),
    why the others were refused, and how many were pruned unestimated (`to_json` lists the first
    two and counts the others)."""

    ranked: list[Estimate]
    too_big: list[Estimate]
    refused: dict[str, int]  # the first sentence of each ConfigError -> how many candidates
    pruned: dict[str, int] = dataclasses.field(default_factory=dict)
    """'slower': candidates whose compute alone is slower than the `keep`-th fastest that fits;
    'bigger': those that need at least the memory of one found not to fit (the same layout with
    less remat, no SP or fewer microbatches)."""


def plan(cfg: Config, devices: int, roof: Roofline, platform: str = "gpu", keep: int | None = None) -> Plan:
    """Enumerate `candidates`, keep those jaxpar's validation accepts, estimate each, rank those
    that fit by predicted step time (and the others by memory).

    Candidates are visited by a floor on their step time (`compute_floor`: the compute alone,
    without bubble or traffic). With `keep`, once `keep` layouts fit, a candidate whose floor is
    above the `keep`-th best time cannot enter the first `keep` rows and is not estimated, so the
    first `keep` rows are exact. Always, a candidate that needs at least the memory of one that
    did not fit (the same layout and ZeRO stage with less remat, SP off where it was on, or fewer
    microbatches) is not estimated."""
    import heapq

    fits, too_big, refused = [], [], {}
    pruned = {"slower": 0, "bigger": 0}
    # A group is a (data, stage, model) with a microbatch count; its remat policies are visited
    # from the one that saves the most memory, so that one found too big prunes the others.
    groups = []
    for shape, m, split in _groups(cfg, devices, roof.hardware.node_size):
        floors = {remat: _floor(cfg, shape, m, remat, roof) for remat in _REMATS}
        groups.append((min(floors.values()), shape, m, split, floors))
    groups.sort(key=lambda g: (g[0], g[1], g[2]))
    best: list[float] = []  # max-heap (negated) of the `keep` best times that fit
    failed: dict[tuple, list[tuple[int, int, int]]] = {}

    def slower(floor):
        return keep and len(best) >= keep and floor > -best[0]

    for i, (floor, shape, m, split, floors) in enumerate(groups):
        if slower(floor):  # (the groups that follow have higher floors still)
            pruned["slower"] += sum(len(_REMATS) * len(list(_variants(cfg, g[1], g[3], g[2]))) for g in groups[i:])
            break
        p = shape[1]
        for r in reversed(range(len(_REMATS))):
            remat = _REMATS[r]
            variants = list(_variants(cfg, shape, split, m))
            if slower(floors[remat]):
                pruned["slower"] += len(variants)
                continue
            for zero, sp, schedule, v, master, ctx in variants:
                key = (shape, zero, schedule, v, master, ctx)
                # Memory falls (or stays) with more remat, with SP and with more microbatches (fewer
                # rows each; without a pipeline only from 2 on: one microbatch has no accumulator).
                if any(sp2 >= sp and r2 >= r and m2 >= m and (p > 1 or m >= 2 or m2 == m)
                       for sp2, r2, m2 in failed.get(key, ())):
                    pruned["bigger"] += 1
                    continue
                cand = _candidate(cfg, shape, m, remat, split, zero, sp, schedule, v, master, ctx)
                try:
                    _check_cached(cand, shape)
                except ConfigError as e:
                    reason = str(e).split(";")[0]
                    refused[reason] = refused.get(reason, 0) + 1
                    continue
                est = estimate(cand, shape, roof, platform)
                if est.fits:
                    fits.append(est)
                    if keep:
                        heapq.heappush(best, -est.time["total"])
                        if len(best) > keep:
                            heapq.heappop(best)
                else:
                    too_big.append(est)
                    failed.setdefault(key, []).append((sp, r, m))
    # Times equal to 3 significant digits are ties (the model is not finer than that); ties go to
    # the layout that moves fewer bytes, then to the one with more memory to spare.
    fits.sort(key=lambda e: (float(f"{e.time['total']:.3g}"), sum(e.bytes_per_step.values()), e.memory["total"]))
    too_big.sort(key=lambda e: e.memory["total"])
    return Plan(fits, too_big, refused, pruned)


def _floor(cfg: Config, shape, m: int, remat: str, roof: Roofline) -> float:
    """`compute_floor` of a candidate group (the other choices do not change it)."""
    c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, remat=remat, microbatches=m,
                                                              stage_layers=None, virtual_stages=1,
                                                              expert_parallel=_expert_parallel(cfg, shape[0])))
    return compute_floor(c, shape, roof)


@functools.lru_cache(maxsize=65536)
def _check_cached(cfg: Config, shape: tuple[int, int, int]) -> None:
    check(cfg, shape)  # a ConfigError is not cached: the same candidate is rarely seen twice


def memory_wall(cfg: Config, devices: int, node_size: int = 8, platform: str = "gpu") -> list[tuple[str, dict]]:
    """The memory wall, step by step: per-device memory of `cfg` as each strategy is added on
    `devices` devices (each row's layout is validated by jaxpar; a row it refuses carries the reason
    instead of figures). For an MoE model the data-parallel rows split the experts over data where
    the data size divides them (expert parallelism, as the config says) and say so, else keep them
    replicated, and the tensor-parallel row is repeated with the experts replicated. Each
    row trains one sequence per device per microbatch, without accumulation (a pipeline streams
    2p microbatches), so that its gradients are the 4 bytes per parameter of the textbook count."""
    t = min(node_size, devices)
    while t > 1 and (cfg.model.n_heads % t or devices % t):
        t //= 2
    p = 1  # (a stage count that does not divide the layers splits them as `stage_split` does)
    while p * 2 * t <= devices and devices % (p * 2 * t) == 0 and cfg.model.n_layers >= p * 2 and p * 2 <= 16:
        p *= 2
    rows = []

    E = cfg.model.n_experts

    def add(label, shape, **par):
        d, stages = shape[0], shape[1]
        m = 2 * stages if stages > 1 else 1
        if cfg.model.moe and cfg.parallel.expert_parallel and d > 1 and "expert_parallel" not in par:
            if not _expert_parallel(cfg, d):  # the experts do not split over this data size: each rank keeps them all
                par["expert_parallel"] = False
                label += f" (experts replicated: {E} over {d})"
            elif E % d:
                label += f" (EP: each of {E} experts on {d // E} ranks)"
            else:
                label += f" (EP: {E // d} of {E} experts per rank)"
        c = cfg.replace(mesh=dict(zip(AXES, shape)), train={"global_batch": d * m},
                        parallel={"microbatches": m, "stage_layers": stage_split(cfg.model.n_layers, stages), **par})
        try:
            check(c, shape)
        except ConfigError as e:
            rows.append((label, _shape_label(shape, c), str(e).split(";")[0]))
            return
        rows.append((label, _shape_label(shape, c), memory(c, shape, platform)))

    add("one device", (1, 1, 1))
    add(f"data parallel x{devices} (replicated)", (devices, 1, 1))
    for z in (1, 2, 3):
        add(f"ZeRO-{z} over {devices}", (devices, 1, 1), zero=z)
    add(f"tensor parallel x{t} + ZeRO-1 over {devices // t}", (devices // t, 1, t), zero=1)
    if cfg.model.moe and devices // t > 1:  # the same layout without expert parallelism, for contrast
        add("  the same, experts replicated", (devices // t, 1, t), zero=1, expert_parallel=False)
    add("+ sequence parallel", (devices // t, 1, t), zero=1, sequence_parallel=True)
    add(f"+ pipeline x{p} (1F1B)", (devices // (t * p), p, t), zero=1, sequence_parallel=True)
    add("+ remat full", (devices // (t * p), p, t), zero=1, sequence_parallel=True, remat="full")
    return rows


def _shape_label(shape, c):
    par = c.parallel
    return f"({shape[0]}, {shape[1]}, {shape[2]}) m={par.microbatches}"


def to_json(result: Plan) -> dict[str, Any]:
    """The object `--json` prints: `layouts`, every layout the search estimated, those that fit
    first with `rank` 1, 2, ... in the table's order, then those that do not fit (`fits` false,
    `rank` None) by memory; `not_estimated`, the layouts skipped unestimated, by reason
    (`Plan.pruned`): `slower`, those whose compute alone is slower than the `keep`-th fastest that
    fits (0 where the search ran without `keep`, as `--json` does unless given --top), and
    `bigger`, those that need at least the memory of a listed layout that does not fit (by the
    planner's rule that memory does not fall with less remat, SP off or fewer microbatches: taken
    not to fit); and `refused`, how many jaxpar's validation refused, by reason."""
    return {"layouts": [e.to_dict(i) for i, e in enumerate(result.ranked, 1)] + [e.to_dict() for e in result.too_big],
            "not_estimated": dict(result.pruned), "refused": dict(result.refused)}
