"""Will a model fit, and which layout trains it fastest? Per-device memory, FLOPs, bytes per mesh axis
and a roofline step time for any config on any cluster, and the ranking of every valid layout.

The memory of parameters, gradients and optimizer state comes from jaxpar's own ZeRO layout
(`jaxpar.parallel.zero`, on an abstract mesh of the candidate's shape, so no device is needed);
the activations a step keeps for its backward pass come from JAX's own linearization of one
transformer block at the per-device shapes of the candidate (`saved_residuals`, traced with
abstract values under the tensor-parallel marks of `jaxpar.sharding`), so remat policies, sequence
parallelism and dtypes count exactly what the program saves. Validity is decided only by jaxpar's
validation (`jaxpar.config.validate`, `jaxpar.mesh.check_sizes`, the ZeRO layout's refusals).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from jaxpar import model
from jaxpar.config import Config, ConfigError, JaxparError, validate
from jaxpar.mesh import AXES, check_sizes
from jaxpar.parallel.zero import make_layout, state_bytes
from jaxpar.plan_presets import Hardware

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
    mesh = abstract_mesh(shape)
    return make_layout(cfg, mesh, model.param_names(cfg.model), model.param_shapes(cfg.model)), mesh


@functools.lru_cache(maxsize=4096)
def _state(cfg: Config, shape: tuple[int, int, int]) -> dict[str, int]:
    """Per-device bytes of the stored state and of its parts that collectives move:
    params / grads / optimizer (jaxpar.parallel.zero.state_bytes), `local` (the parameters after
    tensor and pipeline splitting, before ZeRO), `sharded` (of `local`, the leaves ZeRO shards
    over data), `blocks_sharded` (of those, the stacked block leaves), `blocks` (all block leaves)."""
    layout, mesh = _layout(cfg, shape)
    shapes = model.param_shapes(cfg.model)
    acct = state_bytes(layout, shapes, mesh)
    base = jax.tree.map(lambda spec, d: _strip_data(spec), layout.moments, layout.zero_dims,
                        is_leaf=lambda x: isinstance(x, P))
    out = {"params": acct["params"]["per_device"], "grads": acct["grads"]["per_device"],
           "optimizer": acct["optimizer"]["per_device"]}
    out.update(local=0, sharded=0, blocks_sharded=0, blocks=0)
    flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_base = jax.tree.leaves(base, is_leaf=lambda x: isinstance(x, P))
    flat_dims = jax.tree.leaves(layout.zero_dims, is_leaf=lambda x: x is None or isinstance(x, int))
    for (path, s), spec, dim in zip(flat_shapes, flat_base, flat_dims):
        split = math.prod(mesh.shape[a] for ax in spec for a in ((ax,) if isinstance(ax, str) else ax or ()))
        nbytes = s.size * s.dtype.itemsize // split
        is_block = path[0].key == "blocks"
        out["local"] += nbytes
        out["blocks"] += nbytes * is_block
        if dim is not None:
            out["sharded"] += nbytes
            out["blocks_sharded"] += nbytes * is_block
    return out


def _strip_data(spec: P) -> P:
    def drop(ax):
        kept = tuple(a for a in ((ax,) if isinstance(ax, str) else ax or ()) if a != "data")
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*map(drop, spec))


# ---------------------------------------------------------------------------------------------
# Activations: what JAX saves for the backward pass, at the per-device shapes of a candidate.

_TP_NAMES = ("heads", "mlp", "vocab")


@functools.lru_cache(maxsize=1024)
def saved_activation_bytes(mcfg, rows: int, t: int, sp: bool, remat: str, head: bool) -> tuple[int, int]:
    """(bytes saved for the backward pass, bytes of the largest single saved value) of the loss of
    `rows` sequences through `mcfg.n_layers` blocks (with embedding, head and loss if `head`, else
    the blocks alone) on one device of a `model` axis of size t (tensor parallelism, and sequence
    parallelism if `sp`) under remat policy `remat`.

    Read from JAX's own linearization (`saved_residuals`) of the same code the step runs, traced
    with abstract values under jaxpar's tensor-parallel marks (inside a shard_map on an abstract
    mesh): nothing is allocated, whatever the model's size. Parameters are not counted (they are
    stored anyway)."""
    from jax._src.ad_checkpoint import saved_residuals  # no public spelling in jax 0.10

    from jaxpar.sharding import LOGICAL_NAMES, Rules, TensorParallel, activation_rules
    from jaxpar.train.step import cross_entropy_sum

    names, shapes = model.param_names(mcfg), model.param_shapes(mcfg)
    split = set(_TP_NAMES) | ({"kv_heads"} if mcfg.kv_heads % t == 0 else set())
    local = jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(
        tuple(x // t if name in split and t > 1 else x for x, name in zip(s.shape, n)), s.dtype), shapes, names,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    S = mcfg.seq_len
    if head:
        inputs = jax.ShapeDtypeStruct((rows, S + 1), jnp.int32)
    else:
        inputs = jax.ShapeDtypeStruct((rows, S // t if sp and t > 1 else S, mcfg.d_model), jnp.dtype(mcfg.dtype))
    found: list = []

    def loss(params, x):
        mdl = model.bind(mcfg, params)
        if head:
            logits = mdl(x[:, :-1], remat=remat)
            return cross_entropy_sum(logits, x[:, 1:], mcfg.vocab_size)
        if sp and t > 1:
            x = jax.lax.pcast(x, "model", to="varying")
        return mdl.backbone(x, remat=remat)

    def trace(_):
        # Inside the shard_map every axis is manual: the marks run Megatron's collectives and no
        # sharding constraint is left to place.
        rules = Rules({n: None for n in LOGICAL_NAMES})
        with activation_rules(None, rules, tp=TensorParallel(t, sp, mcfg.n_heads, mcfg.kv_heads)):
            found.extend(saved_residuals(loss, local, inputs))
        return _

    if t > 1:
        mesh = AbstractMesh((t,), ("model",), axis_types=(AxisType.Explicit,))
        jax.make_jaxpr(jax.shard_map(trace, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"model"}))(
            jnp.zeros(()))
    else:  # one device: no marks are active, as in a single-device step
        found.extend(saved_residuals(loss, local, inputs))
    sizes = [aval.size * aval.dtype.itemsize for aval, why in found if not str(why).startswith("from the argument")]
    return sum(sizes), max(sizes, default=0)


@functools.lru_cache(maxsize=1024)
def _bilinear(mcfg, t: int, sp: bool, remat: str, head: bool) -> tuple[float, float, float, float]:
    """(a, b, c, e) with saved bytes = a + b·rows + c·layers + e·rows·layers: every saved value is
    per row (the batch dim) or not (tables, masks), and per layer (the scan stacks it) or not
    (embedding, head, loss), so four traces give the exact bilinear form for any rows and depth."""
    f = {(r, n): saved_activation_bytes(dataclasses.replace(mcfg, n_layers=n), r, t, sp, remat, head)[0]
         for r in (1, 2) for n in (1, 2)}
    e = f[2, 2] - f[1, 2] - f[2, 1] + f[1, 1]
    c = f[1, 2] - f[1, 1] - e
    b = f[2, 1] - f[1, 1] - e
    return f[1, 1] - b - c - e, b, c, e


def _activations(mcfg, rows: int, t: int, sp: bool, remat: str, head: bool) -> dict[str, int]:
    """Saved activations of `rows` sequences through `mcfg.n_layers` layers (`saved`), and of one
    layer with no remat (`layer_all`) and with `remat` (`layer_saved`)."""
    base = dataclasses.replace(mcfg, n_layers=1)
    a, b, c, e = _bilinear(base, t, sp, remat, head)
    _, _, c0, e0 = _bilinear(base, t, sp, "none", head)
    L = mcfg.n_layers
    return {"saved": int(a + b * rows + (c + e * rows) * L), "layer_saved": int(c + e * rows),
            "layer_all": int(c0 + e0 * rows)}


def _schedule(cfg: Config, p: int):
    from jaxpar.parallel.schedules import build
    par = cfg.parallel
    return _cached_schedule(par.schedule, p, par.microbatches, par.virtual_stages)


@functools.lru_cache(maxsize=512)
def _cached_schedule(name: str, p: int, m: int, v: int):
    from jaxpar.parallel.pipeline import table_of
    from jaxpar.parallel.schedules import build, simulate
    sched = build(name, p, m, v)
    return sched, table_of(sched), simulate(sched, 1.0, 2.0)


def memory(cfg: Config, shape: tuple[int, int, int]) -> dict[str, int]:
    """Predicted per-device bytes of one training step of `cfg` on a (data, stage, model) mesh of
    `shape`, by part: `params`, `gradients`, `optimizer`, `activations`, `pipeline_buffers`,
    `gathered_params` (ZeRO-3's all-gathered copies), `batch`, and `total` (what
    `compiled.memory_analysis()` calls arguments + temp; outputs alias the donated state).

    - params, optimizer: the stored state of jaxpar's ZeRO layout (Adam: two moments, in the
      parameter dtype).
    - gradients: what the step holds. One microbatch, ZeRO 0-2: every local gradient at its
      parameter's dtype (ZeRO-2 reduce-scatters after the backward pass, so the full gradient
      exists transiently: README, "Known cost"); ZeRO-3: the data shard. With microbatches, a
      float32 accumulator of the same extent plus one microbatch's gradients. Pipelines: float32
      accumulators of this stage's blocks and of the shared leaves (embeddings, head), reduced
      after the tick loop, plus one chunk's gradients.
    - activations: the values JAX saves for the backward pass (`saved_activation_bytes`) of one
      microbatch (pipelines: of one chunk, which B recomputes from the stashed chunk input), plus
      the working set of the backward pass of one layer: its values that were not saved
      (recomputed) and at least half of its saved values again as cotangents, or the float32
      cotangent of the logits, whichever is larger.
    - pipeline_buffers: the stash (chunk inputs) and the receive buffers the schedule table
      declares, v chunks each.
    """
    d, p, t = shape
    m, mc, par = cfg.model, cfg.model, cfg.parallel
    st = _state(cfg, shape)
    itemsize = _BYTES[m.param_dtype]
    f32 = 4 / itemsize
    micro = par.microbatches
    rows = cfg.train.global_batch // (d * micro)
    sp = par.sequence_parallel and t > 1
    out = {"params": st["params"], "optimizer": st["optimizer"]}
    zero = par.zero
    if p == 1:
        grads = st["local"] if zero < 3 else st["grads"]
        if micro > 1:
            grads = grads * (1 + f32)
        act = _activations(mc, rows, t, sp, par.remat, True)
        saved = act["saved"]
        buffers = 0
        layers = m.n_layers
    else:
        sched, table, _ = _schedule(cfg, p)
        v = par.virtual_stages
        layers = m.n_layers // (p * v) if par.stage_layers is None else max(par.stage_layers)
        chunk = dataclasses.replace(mc, n_layers=layers)
        # The last stage's chunk runs the head and the loss too: the most any stage saves.
        act = _activations(chunk, rows, t, sp, par.remat, True)
        saved = act["saved"]
        msg = rows * (m.seq_len // t if sp else m.seq_len) * m.d_model * _BYTES[m.dtype]
        buffers = v * (table.stash + table.fwd_slots + table.bwd_slots) * msg
        grads = st["local"] * (f32 + 1)
    logits = rows * m.seq_len * m.padded_vocab // t * 4
    recomputed = act["layer_all"] - act["layer_saved"]
    if p == 1:
        transient = max(recomputed, act["layer_all"] // 2, logits)
        if micro > 1:
            # The first microbatch runs before the accumulation loop (it starts the float32
            # accumulator with the gradients' exact type) and XLA gives the loop body buffers of
            # its own: two microbatches' activations, measured so on CPU.
            saved *= 2
    else:
        # A chunk's backward runs inside one tick (vjp of the stashed input); measured on CPU its
        # working set beyond the saved values is what remat recomputes, or the logits' cotangent.
        transient = max(recomputed, logits)
    gathered = 0
    if zero == 3:
        # ZeRO-3 gathers each layer where it is used (two in flight: one used, one prefetched) and
        # the leaves outside the layer scan (embeddings, head) once, kept for the backward pass;
        # with `zero3_gather: step` under a pipeline, this stage's whole parameters for the step.
        blocks_layer = st["blocks"] // max(1, m.n_layers // p)
        shared = st["local"] - st["blocks"]
        gathered = shared + (st["blocks"] if p > 1 and par.zero3_gather == "step" else 2 * blocks_layer)
    out.update(gradients=int(grads), activations=int(saved + transient), pipeline_buffers=int(buffers),
               gathered_params=int(gathered), batch=rows * micro * (m.seq_len + 1) * 4)
    out["total"] = sum(out.values())
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
        all-reduce 2(n-1)/n of its result, all-gather (n-1)/n, reduce-scatter (n-1) times its
        (1/n-sized) result, a permute its result."""
        per = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": n - 1,
               "collective-permute": 1.0}[self.kind]
        return per * self.bytes * self.count


def collectives(cfg: Config, shape: tuple[int, int, int]) -> list[Collective]:
    """The collectives of one step of `cfg` on a mesh of `shape` (scalars such as the loss and the
    gradient norm's partial sums left out: a few bytes)."""
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    st = _state(cfg, shape)
    itemsize, act_size = _BYTES[m.param_dtype], _BYTES[m.dtype]
    micro, zero = par.microbatches, par.zero
    rows = cfg.train.global_batch // (d * micro)
    sp = par.sequence_parallel and t > 1
    out: list[Collective] = []
    if d > 1 and p == 1:
        if zero == 3:
            shared = st["sharded"] - st["blocks_sharded"]
            # Per microbatch: each block layer gathered in the forward and again in the backward
            # pass, the leaves outside the layer scan once; each gradient reduce-scattered.
            out.append(Collective("all-gather", ("data",), 2 * st["blocks_sharded"] + shared, micro, overlap=True))
            out.append(Collective("reduce-scatter", ("data",), st["sharded"] / d, micro, overlap=True))
            if st["local"] > st["sharded"]:
                out.append(Collective("all-reduce", ("data",), st["local"] - st["sharded"], micro, overlap=True))
        else:
            in_scan = zero < 2 and micro == 1  # ZeRO-0/1, one microbatch: per layer in the backward scan
            if zero == 2:
                out.append(Collective("reduce-scatter", ("data",), st["sharded"] / d))
                reduced = st["local"] - st["sharded"]
            else:
                reduced = st["local"]
            if reduced:
                out.append(Collective("all-reduce", ("data",), reduced, overlap=in_scan))
            if zero >= 1 and st["sharded"]:
                out.append(Collective("all-gather", ("data",), st["sharded"]))  # the updated parameters
    if p > 1:
        sched, table, _ = _schedule(cfg, p)
        ticks = sched.num_ticks()
        msg = rows * (m.seq_len // t if sp else m.seq_len) * m.d_model * act_size
        # One forward and one backward ppermute every tick (idle stages send zeros).
        out.append(Collective("collective-permute", ("stage",), msg, 2 * ticks))
        f32 = 4 / itemsize
        shared = st["local"] - st["blocks"]
        # Float32 accumulators reduced once after the tick loop: blocks over data, the shared
        # leaves (embeddings, head; used by the end stages) over data and stage.
        if d > 1:
            out.append(Collective("all-reduce", ("data",), st["blocks"] * f32))
        out.append(Collective("all-reduce", ("data", "stage") if d > 1 else ("stage",), shared * f32))
        if d > 1 and zero >= 1 and st["sharded"]:
            out.append(Collective("all-gather", ("data",), st["sharded"]))
        if par.virtual_stages > 1 or (par.stage_layers is not None and len(set(par.stage_layers)) > 1):
            # The step reorders the block parameters into pipeline order and their gradients back.
            out.append(Collective("collective-permute", ("stage",), st["blocks"] * (p - 1) / p, 2))
    if t > 1:
        out += _tensor_collectives(cfg, rows, t, sp, act_size, p)
    return out


def _tensor_collectives(cfg: Config, rows: int, t: int, sp: bool, act_size: int, p: int) -> list[Collective]:
    """Megatron's activation collectives over `model`: per layer and microbatch, one closing each
    sub-layer each way (all-reduce of b·s·h; under SP an all-gather of b·s·h and a reduce-scatter
    to b·s·h/t), the vocab-parallel embedding's and head's, and again for every recomputed forward
    (remat `full`; a pipeline's B recomputes its chunk)."""
    m, par = cfg.model, cfg.parallel
    micro = par.microbatches
    A = rows * m.seq_len * m.d_model * act_size
    L = m.n_layers // p
    forwards = 1 + (par.remat == "full") + (p > 1)  # forward passes of each layer per microbatch
    out = []
    if sp:
        out.append(Collective("all-gather", ("model",), A, 2 * L * micro * (forwards + 1)))
        out.append(Collective("reduce-scatter", ("model",), A / t, 2 * L * micro * (forwards + 1)))
        out.append(Collective("reduce-scatter", ("model",), A / t, micro))  # embedding, forward
        out.append(Collective("all-gather", ("model",), A, micro))  # head input, forward
        out.append(Collective("all-gather", ("model",), A, micro))  # embedding, backward
        out.append(Collective("reduce-scatter", ("model",), A / t, micro))  # head input, backward
    else:
        out.append(Collective("all-reduce", ("model",), A, 2 * L * micro * (forwards + 1)))
        out.append(Collective("all-reduce", ("model",), A, 2 * micro))  # embedding fwd, head input bwd
    return out
