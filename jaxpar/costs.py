"""The cost model of one config on one mesh, without devices: per-device memory by part, model and
hardware FLOPs, the collectives of a step with their bytes per mesh axis, and a roofline step time.

The memory of parameters, gradients and optimizer state comes from jaxpar's own ZeRO layout
(`jaxpar.parallel.zero`, on an abstract mesh of the candidate's shape, so no device is needed);
the activations a step keeps for its backward pass come from JAX's own linearization of one
transformer block at the per-device shapes of the candidate (`saved_residuals`, traced with
abstract values under the tensor-parallel marks of `jaxpar.sharding`), so remat policies, sequence
parallelism and dtypes count exactly what the program saves. `jaxpar.plan` ranks layouts with it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from jaxpar import model
from jaxpar.config import Config, validate
# Activations: what JAX saves for the backward pass, at the per-device shapes of a candidate.
from jaxpar.costs_activations import _activations, _offloaded, _tap_input_width, _tap_width, saved_activation_bytes  # noqa: F401
from jaxpar import costs_moe
from jaxpar.model.layers import flash_attention_applies
from jaxpar.hardware import Hardware
from jaxpar.mesh import AXES, check_sizes
from jaxpar.model.flops import count_active_params as _count_params, model_flops_per_token
from jaxpar.parallel.gradients import reduction, zero3_gathers
from jaxpar.parallel.reduction import upcast_at_use
from jaxpar.parallel.stages import chunk_model, valid_stage_layout
from jaxpar.parallel.zero import make_layout, state_bytes

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def abstract_mesh(shape: tuple[int, int, int]) -> AbstractMesh:
    """A device-free ("data", "stage", "model") mesh of `shape`, for layouts and rules."""
    return AbstractMesh(tuple(shape), AXES, axis_types=(AxisType.Auto,) * 3)


def check(cfg: Config, shape: tuple[int, int, int]) -> None:
    """jaxpar's own validation of `cfg` on a mesh of `shape` (raises ConfigError): the config
    rules, the mesh-size rules, and the ZeRO layout's refusal of large replicated leaves."""
    validate(cfg)
    check_sizes(cfg, shape)
    _layout(cfg, shape)


# ---------------------------------------------------------------------------------------------
# Model state: parameters, gradients, optimizer state, from jaxpar's ZeRO layout.


def _layout(cfg: Config, shape):
    found = _layout_of(_state_key(cfg, shape[1]), tuple(shape))
    if isinstance(found, Exception):
        raise found
    return found


def _state_key(cfg: Config, p: int) -> Config:
    """`cfg` with the choices the ZeRO layout and the stored state do not read set to defaults, so
    that the planner's candidates that differ only in them share one layout (the schedule,
    microbatches, remat; `make_layout` reads the model, the ZeRO stage, its threshold and the mesh,
    and the stage split where the pipeline gathers its chunks' layer slots on p stages)."""
    par = dataclasses.replace(cfg.parallel, microbatches=1, remat="none", schedule="1f1b")
    if _stage_slots(cfg, p) is None:
        par = dataclasses.replace(par, virtual_stages=1, stage_layers=None)
    return dataclasses.replace(cfg, parallel=par)


@functools.lru_cache(maxsize=4096)
def _layout_of(cfg: Config, shape):
    from jaxpar.config import ConfigError
    mesh = abstract_mesh(shape)
    try:
        return make_layout(cfg, mesh, model.param_names(cfg.model), model.param_shapes(cfg.model)), mesh
    except ConfigError as e:  # refusals cached too: the planner asks again for each variant
        return e


def model_state(cfg: Config, shape: tuple[int, int, int]) -> dict[str, int]:
    """`_model_state`, shared by configs that differ only in what the layout does not read (and,
    unless the pipeline gathers its chunks' layer slots, `jaxpar.parallel.stages`, the stage split)."""
    return _model_state(_state_key(cfg, shape[1]), tuple(shape))


def _stage_slots(cfg: Config, p: int):
    """The pipeline's layer slots where the step gathers the stacks into them (uneven stages, dense
    first layers: `jaxpar.parallel.stages`), else None (even chunks: a reshape of the storage)."""
    if p == 1:
        return None
    slots = valid_stage_layout(cfg.model, p, cfg.parallel.virtual_stages, cfg.parallel.stage_layers)
    return slots if slots is not None and slots.gather else None


@functools.lru_cache(maxsize=4096)
def _model_state(cfg: Config, shape: tuple[int, int, int]) -> dict[str, int]:
    """Per-device bytes of the stored state and of its parts that collectives move:
    params / grads / optimizer (jaxpar.parallel.zero.state_bytes), `local` (the parameters after
    tensor and pipeline splitting, before ZeRO), `sharded` (of `local`, the leaves ZeRO shards
    over data), `blocks_sharded` (of those, the stacked block leaves), `blocks` (all block leaves),
    `staged` (of `local`, the shared leaves a pipeline stores sharded over `stage`), `experts` (of
    `local`, the expert weights expert parallelism splits over data: this rank's E/d experts,
    never ZeRO-sharded nor reduced over data; 0 without it, `jaxpar.costs_moe`)."""
    layout, mesh = _layout(cfg, shape)
    shapes = model.param_shapes(cfg.model)
    # Adam: two moments in the parameter dtype; with master weights, master and moments in float32
    # (3 x 4 bytes, in units of the parameter's bytes), on the same layout.
    per_param = 2 if cfg.train.master_weights == "none" else 3 * 4 // _BYTES[cfg.model.param_dtype]
    acct = state_bytes(layout, shapes, mesh, moments_per_param=per_param)
    # (Per device as used in the step: the shared leaves stored over `stage` are gathered there.)
    base = jax.tree.map(lambda spec, sd: _strip_data(spec, "stage" if sd is not None else None), layout.moments,
                        layout.stage_dims, is_leaf=lambda x: isinstance(x, P))
    out = {"params": acct["params"]["per_device"], "grads": acct["grads"]["per_device"],
           "optimizer": acct["optimizer"]["per_device"]}
    out.update(local=0, sharded=0, blocks_sharded=0, blocks=0, staged=0, experts=0)
    ep, d = costs_moe.expert_parallel(cfg, mesh.shape["data"]), mesh.shape["data"]
    flat_names = jax.tree.leaves(model.param_names(cfg.model), is_leaf=lambda x: isinstance(x, tuple))
    flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_base = jax.tree.leaves(base, is_leaf=lambda x: isinstance(x, P))
    flat_dims = jax.tree.leaves(layout.zero_dims, is_leaf=lambda x: x is None or isinstance(x, int))
    flat_sdims = jax.tree.leaves(layout.stage_dims, is_leaf=lambda x: x is None or isinstance(x, int))
    slots = _stage_slots(cfg, mesh.shape["stage"])
    for (path, s), spec, dim, sdim, names in zip(flat_shapes, flat_base, flat_dims, flat_sdims, flat_names):
        is_block = path[0].key == "blocks"
        if is_block and slots is not None:
            # In the step each stage holds its chunks' slots of every stack (stored with `stage` on
            # another dim: `jaxpar.parallel.stages`).
            kind = path[1].key if cfg.model.mixed else ""
            s = jax.ShapeDtypeStruct((mesh.shape["stage"] * slots.v * slots.width[kind], *s.shape[1:]), s.dtype)
            spec, sdim = P("stage", *_strip_data(spec, "stage")[1:]), None
        nbytes = _leaf_bytes(s, spec, mesh)
        if ep and costs_moe.is_expert_leaf(names):
            # Expert parallelism: this rank's E/d experts (`base` has its data split stripped; the
            # stored state of `state_bytes` counts them so already), never ZeRO-sharded.
            nbytes, dim = nbytes // d, None
            out["experts"] += nbytes
        out["local"] += nbytes
        out["blocks"] += nbytes * is_block
        out["staged"] += nbytes * (sdim is not None)
        if dim is not None:
            out["sharded"] += nbytes
            out["blocks_sharded"] += nbytes * is_block
    return out


def _leaf_bytes(s, spec: P, mesh) -> int:
    """Bytes of one device's part of a leaf of shape `s` laid out as `spec` on `mesh`."""
    split = math.prod(mesh.shape[a] for ax in spec for a in ((ax,) if isinstance(ax, str) else ax or ()))
    return s.size * s.dtype.itemsize // split


def _strip_data(spec: P, also: str | None = None) -> P:
    def drop(ax):
        kept = tuple(a for a in ((ax,) if isinstance(ax, str) else ax or ()) if a not in ("data", also))
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*map(drop, spec))


def _schedule(cfg: Config, p: int):
    par = cfg.parallel
    return _cached_schedule(par.schedule, p, par.microbatches, par.virtual_stages)


@functools.lru_cache(maxsize=512)
def _cached_schedule(name: str, p: int, m: int, v: int):
    from jaxpar.parallel.pipeline import Table
    from jaxpar.parallel.schedules import build
    sched = build(name, p, m, v)
    # `pipeline.table_of` without its full validation of the table (jaxpar's own builders, tested
    # in test_schedules; a third of the planner's time on 1024 devices): the slot counts only.
    counts = sched.slot_counts()
    return sched, Table(rows={}, chunks=sched.virtual_stages, stash=counts["stash"], fwd_slots=counts["fwd"],
                        bwd_slots=counts["bwd"], wstash=counts["wstash"], split=sched.split)


@functools.lru_cache(maxsize=512)
def _fused_b(name: str, p: int, m: int, v: int) -> bool:
    """Does the schedule hold a fused backward B (not only I and W)?"""
    return any(a.kind == "B" for _, _, a in _cached_schedule(name, p, m, v)[0].actions())


@functools.lru_cache(maxsize=4096)
def _simulated(name: str, p: int, m: int, v: int, b_over_f: float) -> tuple[float, float]:
    """(time in units of F, bubble fraction) of a schedule simulated with F = 1, B = b_over_f."""
    from jaxpar.parallel.schedules import simulate
    sim = simulate(_cached_schedule(name, p, m, v)[0], 1.0, b_over_f)
    return sim.total_time, sim.bubble_fraction


def uses_flash_attention(cfg: Config, platform: str) -> bool:
    """Whether the step's attention is cuDNN's fused kernel: `model.attention: cudnn`, or `auto`
    where `jaxpar.model.layers.flash_attention_applies` (the model's own rule)."""
    m = cfg.model
    return m.attention == "cudnn" or (m.attention == "auto" and flash_attention_applies(m, platform))


def memory(cfg: Config, shape: tuple[int, int, int], platform: str = "gpu") -> dict[str, int]:
    """Predicted per-device bytes of one training step of `cfg` on a (data, stage, model) mesh of
    `shape`, by part: `params`, `gradients`, `optimizer`, `activations`, `pipeline_buffers`,
    `gathered_params` (ZeRO-3's all-gathered copies, and a pipeline's shared leaves gathered over
    `stage`), `batch`, and `total` (what
    `compiled.memory_analysis()` calls arguments + temp; outputs alias the donated state).

    - params, optimizer: the stored state of jaxpar's ZeRO layout (Adam: two moments, in the
      parameter dtype; with `train.master_weights`, the float32 master and moments: 12 bytes per
      parameter on the moments' layout).
    - gradients: what the step holds. One microbatch: ZeRO-0 every local gradient at its
      parameter's dtype; ZeRO-1/2 the data shards plus one layer's full gradient in flight (each
      layer reduce-scattered inside the backward scan); ZeRO-3: the data shard. With microbatches, a
      float32 accumulator of the same extent plus one microbatch's gradients. Pipelines: float32
      accumulators of this stage's blocks and of the shared leaves (embeddings, head), reduced
      after the tick loop, plus one chunk's gradients. With master weights gradients are float32,
      and where the step differentiates a float32 copy of the stored parameters
      (`jaxpar.parallel.reduction.upcast_at_use` false) that copy is counted here too; where the upcast
      is per layer, reduced gradients are stored in the parameter dtype.
    - activations: the values JAX saves for the backward pass (`saved_activation_bytes`) of one
      microbatch (two with accumulation: see below; pipelines: of one chunk, which F stashes), plus the working set of the backward pass of one layer: its
      values that were not saved (recomputed) and at least half of its saved values again as
      cotangents (a pipeline's B, too, runs one layer at a time from its stash slot; uneven
      stages: a slot more); or the float32 cotangent of the logits, whichever is larger.
      These working sets are the modelled part (measured on CPU: README, "Planning a run").
    - pipeline_buffers: the stash (F's residuals; with a split table also what I keeps for W,
      written over them) and the receive buffers the schedule table declares, v chunks each, and
      the wstash of what does not fit in a stash slot.
    - host_optimizer (not in `total`): with `parallel.offload: optimizer` on a GPU, the optimizer
      state (moments, master), in pinned host memory; `optimizer` is then 0.
    - host_activations (not in `total`): what remat `offload` keeps in pinned host memory, the
      matmul outputs of every layer (one layer's are back on the device, in activations' working
      set, while its backward runs). On XLA:CPU nothing is offloaded: 0, and they count as `dots`.
    """
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    st = model_state(cfg, shape)
    itemsize = _BYTES[m.param_dtype]
    f32 = 4 / itemsize
    master, at_use = cfg.train.master_weights != "none", upcast_at_use(cfg, d, p)
    # With master weights and no per-layer upcast, what is differentiated is a float32 copy: its
    # gradients (and ZeRO-3's gathered layers) are float32 and the model saves its casts of it.
    g = f32 if master and not at_use else 1.0
    upcast = (st["local"] if par.zero < 3 else st["params"]) * f32 if master and not at_use else 0
    m_act = dataclasses.replace(m, param_dtype="float32") if master and not at_use else m
    micro = par.microbatches
    rows = cfg.train.global_batch // (d * micro)
    sp = par.sequence_parallel and t > 1
    # parallel.offload: optimizer keeps the optimizer state in pinned host memory (on a GPU; XLA:CPU
    # counts it among the device arguments). The update's device copies are not modelled.
    host_opt = st["optimizer"] if par.offload == "optimizer" and platform != "cpu" else 0
    out = {"params": st["params"], "optimizer": st["optimizer"] - host_opt}
    zero = par.zero
    flash = uses_flash_attention(cfg, platform)
    # Remat `offload` (refused under a pipeline): the layer scan's saved matmul outputs on the host.
    host = _offloaded(m_act, rows, t, sp, par.remat, flash, platform) if p == 1 else 0
    if p == 1:
        if zero == 3 or (zero in (1, 2) and reduction(cfg, d, p).at_use):
            # Reduce-scattered where each layer's gradient arises: the data shards, plus one
            # layer's full gradient in flight (ZeRO-1/2; ZeRO-3's is counted with its gathers).
            # (Expert-parallel experts are never reduced over data: not in flight.)
            layer = (st["blocks"] - st["experts"]) // max(1, m.n_layers) if zero < 3 else 0
            grads = (st["local"] - st["sharded"] + st["sharded"] / d + layer) * g
        else:
            grads = st["local"] * g
        if micro > 1:
            grads = grads + (st["local"] if zero < 3 else st["grads"]) * f32
        act = _activations(m_act, rows, t, sp, par.remat, True, flash)
        act["layers"] -= host
        buffers = 0
    else:
        sched, table = _schedule(cfg, p)
        v = par.virtual_stages
        # Every chunk's program has the same layer slots (a skipped one's residuals are zeros).
        slots = valid_stage_layout(m, p, v, par.stage_layers)  # (None: refused by the config check)
        chunk = (chunk_model(m_act, slots) if slots is not None
                 else dataclasses.replace(m_act, n_layers=m.n_layers // (p * v)))
        layers = chunk.n_layers
        # The last stage's chunk runs the head and the loss too: the most any stage saves.
        act = _activations(chunk, rows, t, sp, par.remat, True, flash)
        msg = rows * (m.seq_len // t if sp else m.seq_len) * m.d_model * _BYTES[m.dtype]
        # F stashes what B needs (the chunk's saved activations, less its parameters, and the
        # slot for the head's cotangent); with a split table, I writes each weight matmul's
        # input and output cotangent for W into that slot, over what it consumed, and what does
        # not fit into the wstash (`pipeline._pack`: with remat `none` everything fits).
        f = costs_moe.moe_fraction(chunk)  # (per layer: a mixed model's mean of both kinds)
        width = (_tap_width(m, t, mlp=False) + f * costs_moe.tap_width(m, t, costs_moe.routes_sequence_shard(cfg, t))
                 + (1 - f) * (_tap_width(m, t) - _tap_width(m, t, mlp=False)))
        taps = int(rows * m.seq_len * layers * width * _BYTES[m.dtype]) if table.split else 0
        # Where F stashes the matmuls' inputs itself (in place of the pullbacks' copies), I writes
        # only the output cotangents (`pipeline.stashes_inputs`; an MoE layer's expert inputs
        # counted as written, a small overestimate).
        from jaxpar.parallel.pipeline import stashes_inputs
        if stashes_inputs(par.remat, table.split, _fused_b(par.schedule, p, par.microbatches, v),
                          slots is not None and slots.gather):
            taps -= int(rows * m.seq_len * layers * (_tap_input_width(m, t, mlp=False)
                                                     + (1 - f) * (_tap_input_width(m, t) - _tap_input_width(m, t, mlp=False)))
                        * _BYTES[m.dtype])
        homeless = max(0, taps - (act["layers"] + msg))
        buffers = ((table.fwd_slots + table.bwd_slots) * msg + table.stash * (act["layers"] + msg)
                   + table.wstash * homeless + (par.remat == "none") * taps)
        # (+ I's output before it is written, measured on CPU; with remat `dots` or `full` XLA
        # writes it into the wstash in place.)
        grads = st["local"] * (f32 + g)
    grads += upcast
    logits = rows * m.seq_len * m.padded_vocab // t * 4
    # What remat recomputes in a layer's backward: `layer_backward` counts what the layer's
    # backward holds with no remat (every rule's residuals, and xla_lse attention's query block
    # being differentiated), `layer_saved` what the policy keeps. Under `none` nothing is
    # recomputed but inside SwiGLU's and xla_lse attention's own backward rules.
    recomputed = act["layer_backward"] - act["layer_saved"] if par.remat != "none" else 0
    if platform == "gpu":
        # Outside the layer scan XLA's GPU fusions fold the loss's elementwise work into the
        # backward pass, so the values JAX saves there (several [batch, seq, vocab] float32 arrays)
        # do not materialize; what does is the float32 logits, reused in place for their
        # cotangent, and with bf16/fp16 compute a half-size copy of that cotangent for the head's
        # two backward matmuls (measured on an H200: README, "Planning a run").
        head = int(logits * (1.5 if m.dtype != "float32" else 1.0))
        working = 0
    else:
        # XLA's CPU backend materializes them: the saved values as traced, and the logits'
        # cotangent as a working set of its own (measured on CPU).
        head, working = act["outside"], logits
    saved = (act["layers"] if p == 1 else 0) + head  # (a pipeline's are in its stash)
    # With microbatches every one runs inside the accumulation loop: one microbatch's
    # activations at a time. A layer's backward holds what remat recomputed beside the
    # cotangents of about half its saved values, or half of what it holds as cotangents. A
    # pipeline's F writes each layer's residuals straight into its stash slot and B reads them
    # back one layer at a time (DESIGN.md §5.3): its tick's working set is what remat recomputes
    # and the cotangents of about half the layer's saved values, not half of all it holds
    # (measured on CPU: with that term too, the 1F1B and ZB-H1 cases of tests/test_plan.py read
    # +17% and +19%, without it +12% and +13%).
    transient = max(recomputed + act["layer_saved"] // 2, working)
    if p == 1:
        transient = max(transient, act["layer_backward"] // 2)
    if p > 1 and _stage_slots(cfg, p) is not None:
        # Where the stages' layer slots are gathered (uneven stages) the step's peak is
        # elsewhere, about a slot above that (measured on CPU: README, "Planning a run").
        transient = act["layers"] + max(recomputed, working)
    saved += act["fixed"]
    gathered = 0
    if zero == 3:
        # ZeRO-3 gathers each layer where it is used and the leaves outside the layer scan
        # (embeddings, head) once, kept for the backward pass; with `zero3_gather: step` (and
        # microbatches or a pipeline), all of this device's parameters, kept for the step. Layers
        # in flight: one on CPU (its scheduler runs each gather just before its use: measured),
        # two on GPU (the latency-hiding scheduler prefetches the next layer's gather).
        # (Expert-parallel experts are stored whole on their rank: never gathered.)
        blocks = st["blocks"] - st["experts"]
        blocks_layer = blocks // max(1, m.n_layers // p)
        shared = st["local"] - st["blocks"]
        in_flight = 1 if platform == "cpu" else 2
        gathered = (shared + (blocks if _gather_per_step(cfg, p) else in_flight * blocks_layer)) * g
        if not _gather_per_step(cfg, p):  # gathered per use in the compute dtype (matrices: nearly all of it)
            gathered = gathered * min(1.0, _BYTES[m.dtype] / itemsize)
    _, _, expert = costs_moe.assembled_experts(cfg, (d, p, t), _BYTES[m.dtype])
    if expert:  # replicated experts: each MoE layer's own expert, assembled where used
        held = costs_moe.moe_layers_on_stage(cfg, p) if par.remat == "none" else (1 if platform == "cpu" else 2)
        gathered += held * expert
    if p > 1:  # the shared leaves stored over `stage`, gathered for the step (ZeRO-3: its data shard)
        gathered += st["staged"] / (d if zero == 3 else 1)
    out.update(gradients=int(grads), activations=int(saved + transient), pipeline_buffers=int(buffers),
               gathered_params=int(gathered), batch=rows * micro * (m.seq_len + 1) * 4)
    out["total"] = sum(out.values())
    out["host_activations"] = host  # pinned host memory: not in the device total
    out["host_optimizer"] = host_opt
    return out


# ---------------------------------------------------------------------------------------------
# Traffic: result bytes of the collectives one device runs per step, by mesh axis (the measure of
# `jaxpar.inspect.Report.traffic(spans=axis)`: a collective over two axes counts on both), and
# the bytes each puts on the wire (ring algorithms).


@dataclasses.dataclass(frozen=True)
class Collective:
    """`count` runs per step of a `kind` collective over `axes` with `bytes` of result per device;
    `overlap`: issued inside the layer scan, where it can hide behind the next layer's compute."""
    kind: str
    axes: tuple[str, ...]
    bytes: float
    count: int = 1
    overlap: bool = False

    def wire(self, n: int) -> float:
        """Bytes one device sends per step over a group of n devices (ring algorithms):
        all-reduce 2(n-1)/n of its result, all-gather and all-to-all (n-1)/n, reduce-scatter (n-1)
        times its (1/n-sized) result, a permute its result."""
        per = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": n - 1,
               "collective-permute": 1.0, "all-to-all": (n - 1) / n}[self.kind]
        return per * self.bytes * self.count


def collectives(cfg: Config, shape: tuple[int, int, int]) -> list[Collective]:
    """The collectives of one step of `cfg` on a mesh of `shape` (scalars such as the loss and the
    gradient norm's partial sums left out: a few bytes)."""
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    st = model_state(cfg, shape)
    itemsize, act_size = _BYTES[m.param_dtype], _BYTES[m.dtype]
    micro, zero = par.microbatches, par.zero
    red = reduction(cfg, d, p)  # where the step reduces and gathers (the executors read the same)
    rows = cfg.train.global_batch // (d * micro)
    sp = par.sequence_parallel and t > 1
    # With master weights gradients are reduced in float32, and what ZeRO-3 gathers is the float32
    # upcast of its shards (jaxpar.train.step); the updated parameters are gathered in 16 bits.
    gb = 4 / itemsize if cfg.train.master_weights != "none" else 1.0
    # Expert parallelism's experts (`jaxpar.costs_moe`): never reduced over data, never ZeRO-sharded.
    ep = st["experts"]
    out: list[Collective] = []
    if d > 1 and p == 1:
        if zero == 3:
            shared = st["sharded"] - st["blocks_sharded"]
            if red.gather == "step":
                # zero3_gather: step: every shard gathered once before the microbatch loop and
                # kept for the step.
                out.append(Collective("all-gather", ("data",), st["sharded"] * gb, 1, overlap=True))
            else:
                # Per microbatch: each block layer gathered in the forward and again in the
                # backward pass, the leaves outside the layer scan once.
                out.append(Collective("all-gather", ("data",), (2 * st["blocks_sharded"] + shared) * gb, micro,
                                      overlap=True))
            # Each gradient reduce-scattered, per microbatch. (With zero3_gather: step the step
            # reduce-scatters once, after the microbatch loop: DESIGN.md §4 row 5, §9.)
            out.append(Collective("reduce-scatter", ("data",), st["sharded"] / d * gb, micro, overlap=True))
            if st["local"] - ep > st["sharded"]:
                out.append(Collective("all-reduce", ("data",), (st["local"] - ep - st["sharded"]) * gb, micro,
                                      overlap=True))
        else:
            # At use (one microbatch, or ZeRO-2 per microbatch): per layer in the backward scan,
            # once per microbatch; else once after the accumulation loop.
            in_scan = red.at_use
            runs = micro if in_scan else 1
            if zero >= 1:
                out.append(Collective("reduce-scatter", ("data",), st["sharded"] / d * gb, runs, overlap=in_scan))
                reduced = st["local"] - ep - st["sharded"]
            else:
                reduced = st["local"] - ep
            if reduced:
                out.append(Collective("all-reduce", ("data",), reduced * gb, runs, overlap=in_scan))
            if zero >= 1 and st["sharded"]:
                out.append(Collective("all-gather", ("data",), st["sharded"]))  # the updated parameters
    if p > 1:
        sched, table = _schedule(cfg, p)
        ticks = sched.num_ticks()
        msg = rows * (m.seq_len // t if sp else m.seq_len) * m.d_model * act_size
        # One forward and one backward ppermute every tick (idle stages send zeros).
        out.append(Collective("collective-permute", ("stage",), msg, 2 * ticks))
        f32 = 4 / itemsize
        shared = st["local"] - st["blocks"]
        # Float32 accumulators reduced once after the tick loop: blocks over data, the shared
        # leaves (embeddings, head; used by the end stages) over data and stage.
        if zero == 2 and red.at_use:
            # Reduce-scattered by every B where its seed is transposed (per microbatch).
            out.append(Collective("reduce-scatter", ("data",), st["blocks_sharded"] / d, micro, overlap=True))
            if st["blocks"] - ep > st["blocks_sharded"]:
                out.append(Collective("all-reduce", ("data",), (st["blocks"] - ep - st["blocks_sharded"]) * f32))
        elif d > 1 and zero >= 1:
            # ZeRO-1/2 (zero2_reduce: step) and ZeRO-3 under a pipeline: the float32 accumulators
            # reduce-scattered after the tick loop; ZeRO-3 gathers each chunk's layers where F and B
            # use them (per microbatch: forward, recomputed forward, backward), or once per step.
            # (With zero3_gather: microbatch the step reduce-scatters per layer per B inside the
            # loop instead, in the parameter dtype; this counts one reduction after the loop:
            # DESIGN.md §4, §9.)
            out.append(Collective("reduce-scatter", ("data",), st["blocks_sharded"] * f32 / d))
            if st["blocks"] - ep > st["blocks_sharded"]:
                out.append(Collective("all-reduce", ("data",), (st["blocks"] - ep - st["blocks_sharded"]) * f32))
            if zero == 3:
                uses = 1 if _gather_per_step(cfg, p) else 3 * micro
                out.append(Collective("all-gather", ("data",), st["blocks_sharded"] * gb, uses, overlap=True))
        elif d > 1:
            out.append(Collective("all-reduce", ("data",), (st["blocks"] - ep) * f32))
        # The shared leaves stored sharded over `stage` (large ones: embeddings, head) are gathered
        # over `stage` before the loop and their gradients reduce-scattered over it after; the
        # others are all-reduced (over data and stage together).
        staged = st["staged"]
        if staged:
            out.append(Collective("all-gather", ("stage",), staged))
            out.append(Collective("reduce-scatter", ("stage",), staged * f32 / p))
            if d > 1:
                out.append(Collective("all-reduce", ("data",), staged * f32))
        if shared > staged:
            out.append(Collective("all-reduce", ("data", "stage") if d > 1 else ("stage",), (shared - staged) * f32))
        if d > 1 and zero in (1, 2) and st["sharded"]:
            out.append(Collective("all-gather", ("data",), st["sharded"]))
        if _stage_slots(cfg, p) is not None:
            # Each stage's layer slots by an all-to-all over stage (`pipeline._to_slots`), of the
            # stored parameters (ZeRO-3: data shards), and the gradients back after their data
            # reduction (ZeRO 1-3: data shards).
            shards = st["blocks"] - st["blocks_sharded"] + st["blocks_sharded"] / d
            out.append(Collective("all-to-all", ("stage",), shards if zero == 3 else st["blocks"]))
            out.append(Collective("all-to-all", ("stage",), shards if zero >= 1 else st["blocks"]))
        elif par.virtual_stages > 1:
            # The step reorders the block parameters into pipeline order and their gradients back
            # (GSPMD places an all-to-all over stage each way).
            out.append(Collective("all-to-all", ("stage",), st["blocks"], 2))
    if t > 1:
        out += _tensor_collectives(cfg, rows, t, sp, act_size, p, d)
    volume, count = costs_moe.all_to_all(cfg, shape, rows, act_size)
    if count:  # tokens to their experts and back: the expert compute waits on them (exposed)
        out.append(Collective("all-to-all", ("data",), volume, count))
        out.append(Collective("all-to-all", ("data",), *costs_moe.expert_ids(cfg, shape, rows)))
    volume, count, _ = costs_moe.assembled_experts(cfg, shape, act_size)
    if count:  # replicated experts: each rank's expert assembled from the slices of every rank
        out.append(Collective("all-to-all", ("data",), volume, count))
    return out


def _gather_per_step(cfg: Config, p: int) -> bool:
    """ZeRO-3 gathering every shard once per step, before the microbatch or tick loop
    (`jaxpar.parallel.gradients.zero3_gathers`, the executors' rule; DESIGN.md §4 rows 5 and 8)."""
    return cfg.parallel.zero == 3 and zero3_gathers(cfg, p) == "step"


def _tensor_collectives(cfg: Config, rows: int, t: int, sp: bool, act_size: int, p: int, d: int) -> list[Collective]:
    """Megatron's activation collectives over `model`: per layer and microbatch, one closing each
    sub-layer each way (all-reduce of b·s·h; under SP an all-gather of b·s·h and a reduce-scatter
    to b·s·h/t), the vocab-parallel embedding's and head's, and again for every recomputed forward
    (remat `full`; a pipeline's B runs from what F saved). Remat `dots` saves the matmul outputs but
    not an all-gathered input, so under SP the backward pass gathers again, nor the all-reduce
    closing attention, so without SP it all-reduces that again (`offload` saves what `dots`
    does; `dots_except_mlp` saves attention's output after that all-reduce, but its backward
    gathers the inputs again under SP as `dots`' does). Small ones: the
    gradients of kv projections replicated over `model` (n_kv_heads < t) and, under SP, of the
    norms, all-reduced per layer."""
    m, par = cfg.model, cfg.parallel
    micro = par.microbatches
    A = rows * m.seq_len * m.d_model * act_size
    L = m.n_layers // p
    forwards = 1 + (par.remat == "full")  # forward passes of each layer per microbatch
    dots = par.remat in ("dots", "offload")
    out = []
    sub = _tp_sublayers(cfg, L, t)
    if sp:
        gathers = forwards + 1 + (dots or par.remat == "dots_except_mlp")
        out.append(Collective("all-gather", ("model",), A, sub * micro * gathers))
        out.append(Collective("reduce-scatter", ("model",), A / t, sub * micro * (forwards + 1)))
        out.append(Collective("reduce-scatter", ("model",), A / t, micro))  # embedding, forward
        out.append(Collective("all-gather", ("model",), A, micro))  # head input, forward
        out.append(Collective("all-gather", ("model",), A, micro))  # embedding, backward
        out.append(Collective("reduce-scatter", ("model",), A / t, micro))  # head input, backward
    else:
        out.append(Collective("all-reduce", ("model",), A, 2 * L * micro * (forwards + 1)))
        out.append(Collective("all-reduce", ("model",), A, 2 * micro))  # embedding fwd, head input bwd
        if dots:
            # Remat `dots` saves the matmul outputs, not what the all-reduce closing attention
            # made of them; the norm after it needs that value, so the backward pass all-reduces
            # again (the MLP's is the next layer's saved input; measured).
            out.append(Collective("all-reduce", ("model",), A, L * micro))
    small = 0
    if m.kv_heads % t:  # replicated kv projections: their weight gradients summed over model ranks
        bias = 1 if m.qkv_bias else 0  # (and their biases' gradients)
        small += 2 * (m.d_model + bias) * m.kv_heads * m.head_size * _BYTES[m.param_dtype]
    if m.qk_norm and t > 1:  # the q and k norm scales, shared by heads on every model rank
        small += 2 * m.head_size * _BYTES[m.param_dtype]
    if sp:  # norm parameters see a slice of the sequence on each rank
        small += 2 * m.d_model * (2 if m.arch == "gpt2" else 1) * _BYTES[m.param_dtype]
    if small:
        out.append(Collective("all-reduce", ("model",), small * L, micro))
    experts = costs_moe.whole_experts_bytes(cfg, d, t) * _moe_layers(cfg, L)
    if experts:  # experts whole on every model rank: their gradients summed over model where used
        out.append(Collective("all-reduce", ("model",), experts, micro))
    return out


def _moe_layers(cfg: Config, L: int) -> int:
    """MoE layers among L layers of one stage (all, or a mixed model's share)."""
    return round(L * costs_moe.moe_fraction(cfg.model))


def _tp_sublayers(cfg: Config, L: int, t: int) -> int:
    """Sub-layers of L layers closed by an activation collective over `model`: attention and the
    MLP of each, less the MoE layers whose routed experts are whole on every model rank
    (`expert_tensor_parallel: false`: each rank routes its own sequence shard) and which have no
    shared experts (those stay tensor-parallel, `enter_tp`/`exit_tp` of their own)."""
    return 2 * L - (_moe_layers(cfg, L) if costs_moe.routes_sequence_shard(cfg, t) and not cfg.model.n_shared_experts
                    else 0)


# ---------------------------------------------------------------------------------------------
# FLOPs and the roofline step time.


def hardware_flops_per_token(cfg: Config, p: int) -> float:
    """FLOPs the devices run per token: the model FLOPs, a tied output projection (GPT-2, tied llamas: 2·d·V
    forward, twice that backward, outside N), and the recomputed forwards: remat `full`
    recomputes every block (2·N + 4·L·d·S), `dots` and `offload` the attention core (4·L·d·S),
    `dots_except_mlp` the attention core and the MLP's matmuls whose outputs its backward needs
    (up and gate, not down: 2·L·D·F each). A pipeline adds nothing: B (or I and W) runs from what
    F saved."""
    m, remat = cfg.model, cfg.parallel.remat
    n = _count_params(m, False)
    attn_fwd = 4 * m.n_layers * m.n_heads * m.head_size * m.seq_len
    total = model_flops_per_token(cfg) + (6 * m.d_model * m.padded_vocab if m.tied else 0)
    forward = 2 * n + attn_fwd
    # MoE layers (`jaxpar.costs_moe`): the experts' forward again under dots_except_mlp; the
    # dense layers' MLP inputs (every layer of a dense model, some of a mixed one).
    experts_again = costs_moe.recomputed_flops_per_token(m, remat) if m.moe else 0
    mlp_in = 2 * (m.n_layers - m.n_moe_layers) * m.d_model * m.d_ff * (2 if m.arch == "llama" else 1)
    return total + experts_again + {"none": 0, "full": forward, "dots": attn_fwd, "offload": attn_fwd,
                                   "dots_except_mlp": attn_fwd + mlp_in}[remat]


# The compute model, calibrated on jaxpar's own steps on one H200 (`benchmarks/plan_calibrate.py`;
# README, "Planning a run"): a step's compute is the sum of its parts, each at the rate of what
# bounds it. `matmul`: the weight matmuls at their FLOPs over the measured large-matmul rate (782
# of 989 TFLOP/s, benchmarks/results/gpu_h200.json) plus their operands and results through HBM,
# so that a small per-device GEMM (a thin microbatch, a wide tensor-parallel split) runs further
# from the peak; `flash`: cuDNN's attention kernel, its FLOPs over the dense peak (fitted: the
# seconds per FLOP at peak); `scores`: XLA's attention, its float32 [seq, seq] scores through HBM
# (fitted: passes); `elementwise`: norms, residuals and activation functions, HBM passes over each
# layer's [tokens, d_model + d_ff/t] values (fitted); `layer_pass`: seconds per layer pass (kernel
# launches, the scan's bookkeeping; fitted); `head`: the float32 logits, 4 passes; `optimizer`:
# Adam's update reading and writing the stored state once.
MATMUL_EFFICIENCY = 782.2 / 989.0
CALIBRATION = {"flash": 2.85, "scores": 6.6, "elementwise": 13.2, "layer_pass": 7.34e-5}


def compute_terms(cfg: Config, shape: tuple[int, int, int], hw: Hardware) -> dict[str, float]:
    """The parts of one device's compute in a step, each in seconds at coefficient 1 (`CALIBRATION`
    weighs the fitted ones): the device's layers (n_layers / p, or the busiest stage's:
    `busiest_stage_layers`) for every microbatch at its
    per-device shapes (rows = global_batch / (data x microbatches) sequences, tensor-parallel
    dims divided by t), the head and loss (a 1/p share with a pipeline) and the optimizer update."""
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    peak = hw.peak_flops if m.dtype in ("bfloat16", "float16") else hw.peak_flops_fp32
    act = _BYTES[m.dtype]
    rows = cfg.train.global_batch // (d * par.microbatches)
    M, S, D, F, hd = rows * m.seq_len, m.seq_len, m.d_model, m.d_ff, m.head_size
    H, K = m.n_heads // t, (m.kv_heads // t if m.kv_heads % t == 0 else m.kv_heads)
    gemm_units = 3 + (par.remat == "full")  # forward, the two backward matmuls, a recomputed forward
    again = par.remat != "none"  # every policy recomputes attention's core and the elementwise work
    if m.arch == "llama":
        shapes = [(D, (H + 2 * K) * hd), (H * hd, D), (D, 2 * F // t), (F // t, D)]
    else:
        shapes = [(D, 3 * H * hd), (H * hd, D), (D, F // t), (F // t, D)]

    def gemm_rows(rows, k, n, units, peak=peak, act=act):
        return units * (2 * rows * k * n / (MATMUL_EFFICIENCY * peak) + (rows * k + k * n + rows * n) * act / hw.hbm_bw)

    def gemm(k, n, units):
        return gemm_rows(M, k, n, units)

    width = F // t
    if m.moe:  # the MoE layers' matmuls instead of the dense MLP's (`jaxpar.costs_moe`; the router in float32)
        f = costs_moe.moe_fraction(m)  # a mixed model (`model.moe_layers`): per layer, the mean of both kinds
        dense_mlp = sum(gemm(k, n, gemm_units) for k, n in shapes[2:])
        shapes = shapes[:2]
        moe = f * costs_moe.gemm_terms(cfg, shape, M, gemm_rows, gemm_units, lambda r, k, n, u: gemm_rows(
            r, k, n, u, peak=hw.peak_flops_fp32, act=4)) + (1 - f) * dense_mlp
        width = f * costs_moe.mlp_width(m, t, costs_moe.routes_sequence_shard(cfg, t)) + (1 - f) * width
    else:
        moe = 0.0

    V = m.padded_vocab // t
    layers, micro = busiest_stage_layers(cfg, p), par.microbatches
    core = 4 * rows * S * S * H * hd * (3 + again)
    flash = uses_flash_attention(cfg, "gpu")
    st = model_state(cfg, shape)
    return {
        "matmul": micro * (layers * (sum(gemm(k, n, gemm_units) for k, n in shapes) + moe) + gemm(D, V, 3) / p),
        "flash": micro * layers * core / peak if flash else 0.0,
        "scores": 0.0 if flash else micro * layers * (3 + again) * rows * H * S * S * 4 / hw.hbm_bw,
        "elementwise": micro * layers * (3 + again) * M * (D + width) * act / hw.hbm_bw,
        "layer_pass": micro * layers * (3 + again),
        "head": micro * 4 * M * V * 4 / hw.hbm_bw / p,
        "optimizer": (2 * st["params"] + st["grads"] + 2 * st["optimizer"]) / hw.hbm_bw,
    }


def busiest_stage_layers(cfg: Config, p: int) -> float:
    """The layers the busiest of p pipeline stages runs: n_layers / p for an even split, the most
    any stage's chunks hold otherwise (`parallel.stage_layers`, dense first layers; a skipped slot
    costs nothing)."""
    if p == 1:
        return float(cfg.model.n_layers)
    slots = valid_stage_layout(cfg.model, p, cfg.parallel.virtual_stages, cfg.parallel.stage_layers)
    return cfg.model.n_layers / p if slots is None else float(slots.layers_per_chunk().sum(-1).max())


def compute_seconds(cfg: Config, shape: tuple[int, int, int], hw: Hardware) -> float:
    """One device's compute time in a step, no bubble: `compute_terms` weighed by `CALIBRATION`."""
    return sum(v * CALIBRATION.get(k, 1.0) for k, v in compute_terms(cfg, shape, hw).items())


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The stated assumptions of the step-time model."""

    hardware: Hardware
    compute_efficiency: float | None = None
    """Fraction of the dense peak all FLOPs are charged at; None: the compute model
    (`compute_seconds`) decides it for each layout."""
    devices: int = 8
    collective_matmul: bool = False
    """Whether XLA's windowed einsum overlaps each forward tensor-parallel collective with the
    matmul it feeds (`--xla_gpu_threshold_for_windowed_einsum_mib`, with
    `--xla_gpu_multi_streamed_windowed_einsum`: registered by jaxlib 0.10.2; jaxpar's GPU flags do
    not set them, so off by default)."""

    def bandwidth(self, axis: str, shape: tuple[int, int, int]) -> float:
        """Per-direction bytes/s of one device on `axis`: devices are laid out with `model`
        innermost, then `stage`, then `data` (jaxpar.mesh), so an axis stays on NVLink while the
        group it spans fits in one node."""
        d, p, t = shape
        span = {"model": t, "stage": t * p, "data": d * p * t}[axis]
        return self.hardware.intra_node_bw if span <= self.hardware.node_size else self.hardware.inter_node_bw

    def efficiency(self, cfg: Config, shape: tuple[int, int, int]) -> float:
        """The fraction of the dense peak this layout's FLOPs run at: the override, or the compute
        model's hardware FLOPs over its time."""
        if self.compute_efficiency is not None:
            return self.compute_efficiency
        d, p, t = shape
        m, hw = cfg.model, self.hardware
        peak = hw.peak_flops if m.dtype in ("bfloat16", "float16") else hw.peak_flops_fp32
        flops = hardware_flops_per_token(cfg, p) * cfg.train.global_batch * m.seq_len / (d * p * t)
        return flops / (peak * compute_seconds(cfg, shape, hw))


def compute_floor(cfg: Config, shape: tuple[int, int, int], roof: Roofline) -> float:
    """A floor under `step_time`: the compute of one device with no bubble and no exposed traffic
    (what the planner visits candidates by, and prunes with)."""
    d, p, t = shape
    m, hw = cfg.model, roof.hardware
    if roof.compute_efficiency is None:  # (less the optimizer's update, which the ZeRO stage changes)
        terms = compute_terms(cfg, shape, hw)
        return sum(v * CALIBRATION.get(k, 1.0) for k, v in terms.items() if k != "optimizer")
    peak = (hw.peak_flops if m.dtype in ("bfloat16", "float16") else hw.peak_flops_fp32) * roof.compute_efficiency
    return hardware_flops_per_token(cfg, p) * cfg.train.global_batch * m.seq_len / (d * p * t) / peak


def step_time(cfg: Config, shape: tuple[int, int, int], roof: Roofline) -> dict[str, float]:
    """Predicted seconds per step, by part:

    - compute: the hardware FLOPs of each device at `Roofline.efficiency` of the dense peak (the
      compute model's, or the stated override; bf16 peak for bf16/fp16 compute, TF32 for float32);
      with a pipeline, the schedule's simulated time (each tick takes its slowest stage; F and B
      of a microbatch at their FLOPs), bubble included.
    - model traffic, per layer as the compiled program can overlap it (XLA's latency-hiding
      scheduler, which jaxpar enables on GPU): a forward collective sits between the matmuls that
      need it, exposed; a backward one (the activation gradient's) runs beside the same
      sub-layer's weight-gradient matmul, which does not need it, exposed only past that matmul's
      time; with `Roofline.collective_matmul` (XLA's windowed einsum) the forward ones hide behind
      the matmuls they feed likewise. The last layer's has nothing after it to hide behind.
    - stage traffic: exposed (the lock-step pipeline sends after each tick's compute).
    - data traffic: collectives inside the layer scan (ZeRO-0/1's per-layer gradient all-reduce,
      ZeRO-3's gathers and reduce-scatters) run beside the next layer's compute, exposed past it
      and for the last layer; reductions after a microbatch or tick loop and the all-gather of
      updated parameters are exposed.
    """
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    hw = roof.hardware
    efficiency = roof.efficiency(cfg, shape)
    peak = (hw.peak_flops if m.dtype in ("bfloat16", "float16") else hw.peak_flops_fp32) * efficiency
    tokens = cfg.train.global_batch * m.seq_len
    flops = hardware_flops_per_token(cfg, p) * tokens / (d * p * t)
    bubble = 0.0
    if p > 1:
        # One microbatch through one stage's layers: F its forward FLOPs, B the rest (the backward
        # and what remat recomputes; a split table's I and W share it evenly), at the stated
        # fraction of peak; the simulator adds the bubble.
        per_microbatch = flops / par.microbatches
        fwd = per_microbatch * (model_flops_per_token(cfg) / 3 + (2 * m.d_model * m.padded_vocab if m.tied
                                                                  else 0)) / hardware_flops_per_token(cfg, p)
        # The simulated time is linear in the costs at a fixed B/F ratio: simulate once per ratio.
        total, bubble = _simulated(par.schedule, p, par.microbatches, par.virtual_stages,
                                   round((per_microbatch - fwd) / fwd, 6))
        compute = total * fwd / peak
    else:
        compute = flops / peak
    exposed = {"data": 0.0, "stage": 0.0, "model": 0.0}
    hidden = 0.0
    for c in collectives(cfg, shape):
        n = math.prod(dict(zip(AXES, shape))[a] for a in c.axes)
        seconds = c.wire(n) / roof.bandwidth(max(c.axes, key=lambda a: {"model": 0, "stage": 1, "data": 2}[a]), shape)
        axis = c.axes[0] if len(c.axes) == 1 else "data"
        if c.overlap:
            hidden += seconds
        else:
            exposed[axis] += seconds
    busy = flops / peak  # the compute without the bubble: what a collective can run beside
    layers = max(1.0, m.n_layers / p)
    exposed["data"] += max(hidden / layers, hidden - busy)
    if t > 1:
        # Of the weight matmuls (2N FLOPs per token each way), what a collective can overlap: the
        # forward's (one per forward pass) and the weight gradient's.
        share = 2 * _count_params(m, False) / hardware_flops_per_token(cfg, p)
        forwards = 1 + (par.remat == "full")
        backward = exposed["model"] / (1 + forwards)
        forward = exposed["model"] - backward
        if roof.collective_matmul:
            forward = max(forward / layers, forward - busy * share * forwards)
        exposed["model"] = forward + max(backward / layers, backward - busy * share)
    total = compute + sum(exposed.values())
    return {"compute": compute, "bubble_fraction": bubble, **{f"{k}_comm": v for k, v in exposed.items()},
            "total": total}


# ---------------------------------------------------------------------------------------------
# One configuration's figures, and the ranking of every valid layout.


def bytes_per_axis(cfg: Config, shape: tuple[int, int, int]) -> dict[str, float]:
    """Result bytes of the collectives of one step on each axis (a collective spanning two axes
    counts on both), as `jaxpar.inspect.Report.traffic(spans=axis)` reads them from the HLO."""
    out = {a: 0.0 for a in AXES}
    for c in collectives(cfg, shape):
        for a in c.axes:
            out[a] += c.bytes * c.count
    return out


def compiled_bytes_per_axis(cfg: Config, shape: tuple[int, int, int]) -> dict[str, float]:
    """`bytes_per_axis` as the HLO states it statically, which is what `jaxpar.inspect` counts.

    The two differ only for tensor parallelism inside a pipeline: there the executor's F and B sit
    in `lax.cond`s evaluated every tick, and the inspector counts every branch as taken in every
    tick (an upper bound), where the step really runs one branch per action. Per tick the program
    holds F (the embedding's collective and the chunk's forward), B of the last chunk (forward,
    head, backward) and B of the others (forward without the last sub-layer's collective, whose
    result the vjp drops, and backward); remat adds the recomputed forward to both B branches."""
    out = bytes_per_axis(cfg, shape)
    d, p, t = shape
    if p == 1 or t == 1:
        return out
    m, par = cfg.model, cfg.parallel
    rows = cfg.train.global_batch // (d * par.microbatches)
    A = rows * m.seq_len * m.d_model * _BYTES[m.dtype]
    Lc = m.n_layers // (p * par.virtual_stages)
    ticks = _schedule(cfg, p)[0].num_ticks()
    full, dots = par.remat == "full", par.remat == "dots"
    S2 = _tp_sublayers(cfg, Lc, t)  # (2 per layer, less MoE layers routing their sequence shard)
    if par.sequence_parallel:
        # (dots_except_mlp gathers again as dots; offload is refused under a pipeline.)
        regather = S2 * (full or dots or par.remat == "dots_except_mlp")
        # F: the chunk forward, the head's input gather and (its backward) scatter, the
        # embedding's scatter; B or I: the chunk backward (and what remat recomputes).
        gathers = (S2 + 1) + (S2 + regather + S2 * full)
        # (dots: attention's closing reduce-scatter again, as the all-reduce below; fitted to the
        # compiled pipelines, -13% -> -9%, and not in `_tensor_collectives`' SP count, where the
        # one-stage case measured -1.8% without it.)
        scatters = (1 + S2 + 1) + (S2 + S2 * full + Lc * dots)
        static = ticks * (gathers * A + scatters * A / t)
    else:
        again = 2 * Lc * full + Lc * dots  # (dots: attention's closing all-reduce, again)
        static = ticks * A * ((1 + 2 * Lc + 1) + (2 * Lc + again))
    executed = sum(c.bytes * c.count for c in _tensor_collectives(cfg, rows, t, par.sequence_parallel, _BYTES[m.dtype], p, d)
                   if c.bytes >= A / t)
    out["model"] += static - executed
    return out
