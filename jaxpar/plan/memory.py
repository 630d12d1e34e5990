"""The planner's memory model: per-device bytes of one training step of a config on a mesh shape,
by part, without devices; also `check` (jaxpar's own validation of a layout) and the model state
that the other parts of the cost model read (`model_state`).

The memory of parameters, gradients and optimizer state comes from jaxpar's own ZeRO layout
(`jaxpar.parallel.zero`, on an abstract mesh of the candidate's shape, so no device is needed);
the activations a step keeps for its backward pass come from JAX's own linearization of one
transformer block at the per-device shapes of the candidate (`saved_residuals`, traced with
abstract values under the tensor-parallel marks of `jaxpar.sharding`: `jaxpar.plan.activations`),
so remat policies, sequence parallelism and dtypes count exactly what the program saves.
`jaxpar.plan.search` ranks layouts with it, `jaxpar.plan.collectives` and `jaxpar.plan.steptime`
cost their traffic and time.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from jaxpar import model
from jaxpar.model import fp8
from jaxpar.config import Config, ConfigError, validate
from jaxpar.mesh import AXES, check_sizes
from jaxpar.model.layers import flash_attention_applies
from jaxpar.parallel.gradients import reduction, zero3_gathers
from jaxpar.parallel.reduction import upcast_at_use
from jaxpar.parallel.pipeline.placement import placement_of
from jaxpar.parallel.stages import chunk_model, valid_stage_layout
from jaxpar.parallel.zero import make_layout, state_bytes
from jaxpar.plan import moe as moe_costs
# Activations: what JAX saves for the backward pass, at the per-device shapes of a candidate.
from jaxpar.plan.activations import _activations, _offloaded, _tap_input_width, _tap_width

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
    mesh = abstract_mesh(shape)
    try:
        return make_layout(cfg, mesh, model.param_names(cfg.model), model.param_shapes(cfg.model)), mesh
    except ConfigError as e:  # refusals cached too: the planner asks again for each variant
        return e


def model_state(cfg: Config, shape: tuple[int, int, int]) -> dict[str, int]:
    """`_model_state`, shared by configs that differ only in what the layout does not read (and,
    unless the pipeline gathers its chunks' layer slots, `jaxpar.parallel.stages`, the stage split)."""
    return _model_state(_state_key(cfg, shape[1]), tuple(shape))


def muon_deal(cfg: Config, shape: tuple[int, int, int]):
    """Muon's Newton-Schulz deal over the mesh's ranks (`jaxpar.train.muon.deal`: whole matrices,
    a pipeline's layers within their stage): each rank's FLOPs and owned matrix elements."""
    return _muon_deal(cfg.model, math.prod(shape), shape[1])


@functools.lru_cache(maxsize=256)
def _muon_deal(m, ranks: int, stages: int):
    from jaxpar.train.muon import deal

    return deal(model.param_shapes(m), model.param_names(m), ranks, stages)


def _stage_slots(cfg: Config, p: int):
    """The pipeline's layer slots where the step gathers the stacks into them (uneven stages, dense
    first layers: `jaxpar.parallel.stages`), else None (even chunks: a reshape of the storage)."""
    if p == 1:
        return None
    slots = valid_stage_layout(cfg.model, p, cfg.parallel.virtual_stages, cfg.parallel.stage_layers,
                               placement_of(cfg.parallel.schedule))
    return slots if slots is not None and slots.gather else None


@functools.lru_cache(maxsize=4096)
def _model_state(cfg: Config, shape: tuple[int, int, int]) -> dict[str, int]:
    """Per-device bytes of the stored state and of its parts that collectives move:
    params / grads / optimizer (jaxpar.parallel.zero.state_bytes), `local` (the parameters after
    tensor and pipeline splitting, before ZeRO), `sharded` (of `local`, the leaves ZeRO shards
    over data), `blocks_sharded` (of those, the stacked block leaves), `blocks` (all block leaves),
    `staged` (of `local`, the shared leaves a pipeline stores sharded over `stage`), `experts` (of
    `local`, the expert weights expert parallelism splits over data: this rank's E/d experts,
    never ZeRO-sharded nor reduced over data; 0 without it, `jaxpar.plan.moe`), `fp8_sharded` and
    `fp8_blocks_sharded` (of `sharded` and `blocks_sharded`, the FP8 matmuls' weights, which
    ZeRO-3 gathers as float8 with `model.fp8`)."""
    layout, mesh = _layout(cfg, shape)
    shapes = model.param_shapes(cfg.model)
    # Adam: two moments in the parameter dtype; with master weights, master and moments in float32
    # (3 x 4 bytes, in units of the parameter's bytes), on the same layout.
    per_param = 2 if cfg.train.master_weights == "none" else 3 * 4 // _BYTES[cfg.model.param_dtype]
    acct = state_bytes(layout, shapes, mesh, moments_per_param=per_param)
    if cfg.train.optimizer == "muon":
        # Muon keeps one momentum, not Adam's two, on the leaves it takes (`jaxpar.train.muon`'s
        # rule): one moment less of those leaves (4 bytes with master weights).
        from jaxpar.train.muon import muon_leaves

        takes = muon_leaves(model.param_names(cfg.model))
        theirs = jax.tree.map(lambda t, s: s if t else jax.ShapeDtypeStruct((0,), s.dtype), takes, shapes)
        fewer = 1 if cfg.train.master_weights == "none" else 4 // _BYTES[cfg.model.param_dtype]
        acct["optimizer"]["per_device"] -= state_bytes(layout, theirs, mesh, moments_per_param=fewer)[
            "optimizer"]["per_device"]
    # (Per device as used in the step: the shared leaves stored over `stage` are gathered there.)
    base = jax.tree.map(lambda spec, sd: _strip_data(spec, "stage" if sd is not None else None), layout.moments,
                        layout.stage_dims, is_leaf=lambda x: isinstance(x, P))
    out = {"params": acct["params"]["per_device"], "grads": acct["grads"]["per_device"],
           "optimizer": acct["optimizer"]["per_device"]}
    out.update(local=0, sharded=0, blocks_sharded=0, blocks=0, staged=0, staged_sharded=0, experts=0, fp8_sharded=0,
               fp8_blocks_sharded=0)
    ep, d = moe_costs.expert_parallel(cfg, mesh.shape["data"]), mesh.shape["data"]
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
        if ep and moe_costs.is_expert_leaf(names):
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
            out["staged_sharded"] += nbytes * (sdim is not None)
            if cfg.model.fp8 and fp8.gathered(names):  # ZeRO-3 gathers it as float8 (`fp8.gather`)
                out["fp8_sharded"] += nbytes
                out["fp8_blocks_sharded"] += nbytes * is_block
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


def schedule_key(cfg: Config, p: int) -> tuple:
    """What the table a config runs on p stages depends on (`pipeline.table.schedule_of`): the
    arguments of `_cached_schedule`, `_fused_b`, `_paired_ticks`, `_paired_share` and `steptime._simulated`."""
    from jaxpar.parallel.pipeline.table import deferred_w_slots
    par = cfg.parallel
    return par.schedule, p, par.microbatches, par.virtual_stages, deferred_w_slots(par.schedule, par.remat)


def _schedule(cfg: Config, p: int):
    return _cached_schedule(*schedule_key(cfg, p))


@functools.lru_cache(maxsize=512)
def _cached_schedule(name: str, p: int, m: int, v: int, w_slots: int | None = None):
    from jaxpar.parallel.pipeline import Table
    from jaxpar.parallel.pipeline.schedules import build
    from jaxpar.parallel.pipeline.table import one_message
    sched = build(name, p, m, v, w_slots)
    # `pipeline.table_of` without its full validation of the table (jaxpar's own builders, tested
    # in test_schedules; a third of the planner's time on 1024 devices): the slot counts only.
    counts = sched.slot_counts()
    return sched, Table(rows={}, chunks=sched.virtual_stages, stash=counts["stash"], fwd_slots=counts["fwd"],
                        bwd_slots=counts["bwd"], wstash=counts["wstash"], split=sched.split,
                        placement=sched.placement, one_message=one_message(sched))


@functools.lru_cache(maxsize=512)
def _fused_b(name: str, p: int, m: int, v: int, w_slots: int | None = None) -> bool:
    """Does the schedule hold a fused backward B (not only I and W)?"""
    return any(a.kind == "B" for _, _, a in _cached_schedule(name, p, m, v, w_slots)[0].actions())


def _pair_loop(cfg: Config, p: int) -> bool:
    """Does the config's table have F&B ticks, which run F and B as one loop (`pipeline.actions.pair`)?
    The tick body then states each action's layers twice: in its own conditional and in the loop."""
    return p > 1 and _paired_ticks(*schedule_key(cfg, p)) > 0


@functools.lru_cache(maxsize=512)
def _paired_share(name: str, p: int, m: int, v: int, w_slots: int | None = None) -> float:
    """Of a stage's F, B and I (the actions that run the layers' collectives), the share that runs
    on its F&B ticks (DualPipeV's), averaged over the stages: what `actions.pair`'s one loop can
    hide of each one's collectives behind the other's computation."""
    sched = _cached_schedule(name, p, m, v, w_slots)[0]
    if sched.placement != "v":
        return 0.0
    shares = []
    for s in range(p):
        cells = [row[s] for row in sched.ticks]
        paired = sum({a.kind for a in cell} >= {"F", "B"} for cell in cells)
        acts = sum(a.kind in ("F", "B", "I") for cell in cells for a in cell)
        shares.append(2 * paired / acts if acts else 0.0)
    return sum(shares) / p


@functools.lru_cache(maxsize=512)
def _paired_ticks(name: str, p: int, m: int, v: int, w_slots: int | None = None) -> int:
    """Ticks of a V schedule where a stage runs one microbatch's F beside another's fused B
    (DualPipeV's F&B, `Table.overlap`: `tick.f_and_b` keeps the two independent); 0 under other
    placements, whose F waits for the B of its tick (1F1B's)."""
    sched = _cached_schedule(name, p, m, v, w_slots)[0]
    if sched.placement != "v":
        return 0
    return sum(any({a.kind for a in cell} >= {"F", "B"} for cell in row) for row in sched.ticks)


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
      parameter on the moments' layout; `train.optimizer: muon`: one moment on Muon's leaves).
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
    red = reduction(cfg, d, p)
    # Reduced at use (`Reduction.gradient`), a ZeRO-sharded leaf's gradient is held as its data
    # shard: in the step's outputs, and in the float32 accumulators of microbatches or a pipeline.
    shards = st["local"] - st["sharded"] + st["sharded"] / d if red.at_use and zero >= 1 else st["local"]
    if p == 1:
        if red.at_use and zero >= 1:
            # Reduce-scattered where each layer's gradient arises: the data shards, plus one
            # layer's full gradient in flight (ZeRO-1/2; ZeRO-3's is counted with its gathers).
            # (Expert-parallel experts are never reduced over data: not in flight.)
            layer = (st["blocks"] - st["experts"]) // max(1, m.n_layers) if zero < 3 else 0
            grads = (st["local"] - st["sharded"] + st["sharded"] / d + layer) * g
        else:
            grads = st["local"] * g
        if micro > 1:
            grads = grads + shards * f32
        if par.context > 1:
            act = _context_activations(cfg, m_act, cfg.train.global_batch * par.context // (d * micro), t, sp, shape)
        else:
            act = _activations(m_act, rows, t, sp, par.remat, True, flash)
        act["layers"] -= host
        buffers = 0
    else:
        sched, table = _schedule(cfg, p)
        v = par.virtual_stages
        # Every chunk's program has the same layer slots (a skipped one's residuals are zeros).
        slots = valid_stage_layout(m, p, v, par.stage_layers, placement_of(par.schedule))  # (None: refused by the config check)
        chunk = (chunk_model(m_act, slots) if slots is not None
                 else dataclasses.replace(m_act, n_layers=m.n_layers // (p * v)))
        layers = chunk.n_layers
        # Under context parallelism (c > 1) a microbatch on a device is B·c/(d·m) sequences of
        # T/c tokens (the same tokens as without it): its chunk's activations, the messages
        # between stages and the taps are those rows' (`_context_activations`).
        c = par.context
        seqs, tokens = rows * c, m.seq_len // c
        # The last stage's chunk runs the head and the loss too: the most any stage saves.
        act = (_context_activations(cfg, chunk, seqs, t, sp, shape) if c > 1
               else _activations(chunk, rows, t, sp, par.remat, True, flash))
        msg = seqs * (tokens // t if sp else tokens) * m.d_model * _BYTES[m.dtype]
        # F stashes what B needs (the chunk's saved activations, less its parameters, and the
        # slot for the head's cotangent); with a split table, I writes each weight matmul's
        # input and output cotangent for W into that slot, over what it consumed, and what does
        # not fit into the wstash (`pipeline.stash.pack`: with remat `none` everything fits).
        f = moe_costs.moe_fraction(chunk)  # (per layer: a mixed model's mean of both kinds)
        width = (_tap_width(m, t, mlp=False) + f * moe_costs.tap_width(m, t, moe_costs.routes_sequence_shard(cfg, t))
                 + (1 - f) * (_tap_width(m, t) - _tap_width(m, t, mlp=False)))
        taps = int(seqs * tokens * layers * width * _BYTES[m.dtype]) if table.split else 0
        # Where F stashes the matmuls' inputs itself (in place of the pullbacks' copies), I writes
        # only the output cotangents (`pipeline.stashes_inputs`; an MoE layer's expert inputs
        # counted as written, a small overestimate).
        from jaxpar.parallel.pipeline import stashes_inputs
        if stashes_inputs(par.remat, table.split, _fused_b(*schedule_key(cfg, p)),
                          slots is not None and slots.gather):
            taps -= int(seqs * tokens * layers * (_tap_input_width(m, t, mlp=False)
                                                     + (1 - f) * (_tap_input_width(m, t) - _tap_input_width(m, t, mlp=False)))
                        * _BYTES[m.dtype])
        homeless = max(0, taps - (act["layers"] + msg))
        buffers = ((table.fwd_slots + table.bwd_slots) * msg + table.stash * (act["layers"] + msg)
                   + table.wstash * homeless + (par.remat == "none") * taps)
        # (+ I's output before it is written, measured on CPU; with remat `dots` or `full` XLA
        # writes it into the wstash in place.)
        grads = shards * f32 + st["local"] * g
        if table.placement == "v" and not table.one_message:
            # DualPipeV's F&B ticks (`tick.tick`): F's own stash slot, copied into its stash slot
            # after B's and W's reads, and its own float32 accumulator of the shared leaves' gradients.
            buffers += act["layers"] + msg
            grads += (st["local"] - st["blocks"]) * f32
    grads += upcast
    logits = int(cfg.train.global_batch / (d * micro) * m.seq_len) * m.padded_vocab // t * 4  # (B·T/(d·m) tokens)
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
    _, _, expert = moe_costs.assembled_experts(cfg, (d, p, t), _BYTES[m.dtype])
    if expert:  # replicated experts: each MoE layer's own expert, assembled where used
        held = moe_costs.moe_layers_on_stage(cfg, p) if par.remat == "none" else (1 if platform == "cpu" else 2)
        gathered += held * expert
    if p > 1:  # the shared leaves stored over `stage`, gathered for the step (ZeRO-3: its data shard)
        gathered += st["staged"] / (d if zero == 3 else 1)
    out.update(gradients=int(grads), activations=int(saved + transient), pipeline_buffers=int(buffers),
               gathered_params=int(gathered), batch=(cfg.train.global_batch if par.context > 1 else rows * micro) * (m.seq_len + 1) * 4)
    # (With context parallelism the step takes the batch whole on every device and cuts its rows
    # into the ranks' chunks inside (`parallel.context.windows`): measured on CPU.)
    out["total"] = sum(out.values())
    out["host_activations"] = host  # pinned host memory: not in the device total
    out["host_optimizer"] = host_opt
    return out


def context_block(cfg: Config, shape: tuple[int, int, int]) -> int:
    """Bytes of one rank's K (or V) in a context-parallel step (`parallel.context: c`): its
    B·c/(data·microbatches) sequences' T/c tokens of its kv heads (split over `model` where they
    divide), in the compute dtype."""
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    c = par.context
    rows = cfg.train.global_batch * c // (d * par.microbatches)
    kv = m.kv_heads // t if m.kv_heads % t == 0 else m.kv_heads
    return rows * (m.seq_len // c) * kv * m.head_size * _BYTES[m.dtype]


def _context_activations(cfg: Config, m_act, rows: int, t: int, sp: bool, shape) -> dict[str, int]:
    """`_activations` of a context-parallel rank (`parallel.context: c`): its `rows` = B·c/(d·m) sequences of
    T/c tokens (the same tokens as a data rank's) through `m_act` (the model, or a pipeline
    stage's chunk; an MoE layer's routing traced at T/c-token rows), attention traced on one
    device at T/c (tiled past 512 tokens, as the context's attention always is; below, XLA's
    lse attention, which saves the same q, k, v, output and log-sum-exp). What the context's
    attention holds beyond, per layer: `all_gather` the gathered K and V (c·blk each) while a
    layer's attention runs forward or backward (in the working set; it saves the rank's own and
    gathers again in the backward); `ring` the block in hand and the one arriving, and in the
    backward their dK and dV (4·blk)."""
    c, kind = cfg.parallel.context, cfg.parallel.context_attention
    act = _activations(dataclasses.replace(m_act, seq_len=m_act.seq_len // c), rows, t, sp,
                       cfg.parallel.remat, True, False)
    blk = context_block(cfg, shape)
    if kind == "all_gather":
        act["layer_backward"] += 2 * (c - 1) * blk
    else:
        act["layer_backward"] += 4 * blk
    return act


def _gather_per_step(cfg: Config, p: int) -> bool:
    """ZeRO-3 gathering every shard once per step, before the microbatch or tick loop
    (`jaxpar.parallel.gradients.zero3_gathers`, the executors' rule; DESIGN.md §4 rows 5 and 8)."""
    return cfg.parallel.zero == 3 and zero3_gathers(cfg, p) == "step"
