"""The training program: sharded state initialisation and the jitted, donated train step.

State is built as shapes -> shardings -> `jit(init, out_shardings=...)`, so parameters are born
on their devices and never exist whole on one host. The step is one `jax.jit` program: forward and
backward with one data-axis reduction of every gradient (`jaxpar.parallel.gradients`), clipping,
AdamW on the ZeRO layout of `jaxpar.parallel.zero`.

With `train.master_weights: float32` (16-bit `model.param_dtype`) the step differentiates the
float32 upcast of the stored parameters, so that data-axis reductions, microbatch accumulation,
clipping and the optimizer see float32 gradients (`for_grads` says where the upcast happens); AdamW
updates the float32 master in the optimizer state (laid out like the moments:
ZeRO-1+ shards it over data), and the new stored parameters are the master's 16-bit cast, which
out_shardings all-gathers (in 16 bits) to the parameters' layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar import model
from jaxpar.config import Config, ConfigError, validate
from jaxpar.mesh import AXES, check_cpu_threads, check_mesh, check_sizes, make_mesh
from jaxpar.model import fp8, moe, mtp, qk_clip
from jaxpar.model.layers import document_segments, packed, sequence_layout
from jaxpar.model.loss import cross_entropy, cross_entropy_sum  # noqa: F401 (the loss rule; cross_entropy re-exported)
from jaxpar.model.transformer import REMAT_POLICIES, layer_order, token_ids
from jaxpar.parallel import context, naive
from jaxpar.parallel.gradients import make_loss_and_grads
from jaxpar.parallel.microbatches import guard_non_finite
from jaxpar.parallel.zero import Layout, make_layout
from jaxpar.sharding import compute_rules
from jaxpar.train.data import document_eos, has_loss_mask
from jaxpar.train.optim import lr_schedule, make_optimizer, stored_params, upcast_at_use


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: batches consumed (the data position; skipped steps count)
    params: model.Params
    opt_state: Any
    skipped: jax.Array  # int32 scalar: steps whose loss or gradient was not finite (update dropped);
    # with train.on_nan = stop, a positive count freezes the state (the loop then saves and stops)


def loss_fn(cfg: Config, params: model.Params, batch_BxT1: jax.Array, n_tokens: int | None = None,
            eos: int | None = None, data: int = 1, max_logits: bool = False) -> jax.Array:
    """Loss of `params` on token windows [B, T + 1 + D] (inputs and shifted targets, and D =
    `model.mtp_depth` tokens more for multi-token prediction: `jaxpar.model.mtp.pad`), summed and
    divided by `n_tokens` (default: this batch's targets). A data shard passes the global count, so
    that the shards' losses and gradients add up to those of the whole batch. With `eos`
    (`data.document_mask`: `jaxpar.train.data.document_eos`), each document of a window, ended
    by `eos`, is attended and positioned on its own. With `parallel.context` c > 1, `batch_BxT1` is
    this rank's chunk windows (`jaxpar.parallel.context.windows`, inside the step's shard_map over
    `data` of size `data`). The objective adds the MTP depths' losses (`jaxpar.model.mtp.objective`).
    With `max_logits` (train.qk_clip), (the loss, each layer's per-head largest attention logit
    [layers + mtp_depth, N]: `jaxpar.model.qk_clip.gathered`)."""
    split = context.row_split(cfg)
    inputs, targets = split(batch_BxT1, 0)
    if cfg.parallel.context > 1:
        layout = context.layout(cfg, inputs, data, eos)
    else:
        layout = None if eos is None else packed(document_segments(token_ids(inputs), eos))
    m, remat = model.bind(cfg.model, params), cfg.parallel.remat
    with sequence_layout(layout), qk_clip.recording(max_logits) as maxima:
        y = m.backbone(m.embed_tokens(inputs), remat=remat)
        loss = mtp.objective(m, y, targets, mtp.depth_rows(split, batch_BxT1, cfg.model.mtp_depth, eos),
                             lambda lg, tg: cross_entropy_sum(lg, tg, cfg.model.vocab_size),
                             targets.size if n_tokens is None else n_tokens, REMAT_POLICIES[remat])
    return (loss, qk_clip.gathered(maxima)) if max_logits else loss


def main_loss(cfg: Config, loss: jax.Array, grads: model.Params) -> jax.Array:
    """The next-token loss of a `loss_and_grads` result: its objective, or with multi-token
    prediction the main loss its report leaf carries (what evaluation and the log call `loss`)."""
    return grads["mtp"]["report"][0] if cfg.model.mtp_depth else loss


def _opt_state_shardings(opt_shapes: Any, param_shardings: Any, replicated: NamedSharding,
                         memory_kind: str = "device") -> Any:
    """Adam's moments (subtrees shaped like the parameters, the master copy too) live where their
    parameters live, in `memory_kind` (`pinned_host`: `parallel.offload: optimizer`); everything
    else (step counts) is replicated on the device."""
    params_def = jax.tree.structure(param_shardings)
    is_params = lambda x: jax.tree.structure(x) == params_def  # noqa: E731
    if memory_kind != "device":
        param_shardings = jax.tree.map(lambda s: s.with_memory_kind(memory_kind), param_shardings)
    return jax.tree.map(lambda x: param_shardings if is_params(x) else replicated, opt_shapes, is_leaf=is_params)


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything compiled for one (config, mesh): shardings, `init(key)` and `step(state, batch)`."""

    cfg: Config
    mesh: Mesh
    layout: Layout
    optimizer: optax.GradientTransformation
    state_shardings: TrainState
    batch_sharding: NamedSharding
    init: Callable[[jax.Array], TrainState]
    step: Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]
    loss_and_grads: Callable[[model.Params, jax.Array], tuple[jax.Array, model.Params]]

    def abstract_state(self) -> TrainState:
        """The state as ShapeDtypeStructs with their shardings (to lower without allocating)."""
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        shape = (self.cfg.train.global_batch, self.cfg.model.seq_len + 1)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)


def build(cfg: Config, mesh: Mesh | None = None) -> Program:
    """Shardings and jitted functions for `cfg` on `mesh` (default: `make_mesh(cfg)`)."""
    validate(cfg)  # a Config built in Python (from_dict, replace) gets the same checks as a file
    mesh = make_mesh(cfg) if mesh is None else mesh
    check_mesh(mesh)
    check_cpu_threads(mesh, cfg)
    check_sizes(cfg, tuple(mesh.shape[a] for a in AXES))
    platform = mesh.devices.flat[0].platform
    if cfg.parallel.context > 1 and cfg.parallel.context_attention == "ring" and mesh.shape["stage"] > 1:
        # The ring's collective-permutes run inside the pipeline's per-stage conditionals; XLA:CPU
        # matched those of different stages with one another (wrong attention, measured).
        raise ConfigError(f"parallel.context_attention = ring cannot be combined with mesh.stage = "
                          f"{mesh.shape['stage']} (the ring's permutes inside the pipeline's stages are not "
                          "verified); set parallel.context_attention=all_gather.")
    if (platform == "cpu" and cfg.parallel.context > 1 and cfg.parallel.context_attention == "all_gather"
            and "float16" in cfg.model.dtype):
        # XLA:CPU aborts compiling the K and V cotangents' 16-bit reduce-scatter over the context
        # groups (Shardy gives its reducer a `copy` root, which AllReducePromotion cannot clone).
        raise ConfigError(f"parallel.context_attention = all_gather with model.dtype = {cfg.model.dtype} does not "
                          "compile on XLA:CPU (its 16-bit reduce-scatter promotion aborts); set model.dtype=float32 "
                          "on CPU, or parallel.context_attention=ring.")
    if cfg.model.attention == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention = cudnn needs an NVIDIA GPU, but the mesh's devices are {platform}; "
                          "set model.attention=auto (cuDNN where it can run, XLA elsewhere) or xla.")
    if cfg.model.moe and cfg.model.moe_kernel == "pallas" and platform not in ("cpu", "gpu"):
        raise ConfigError(f"model.moe_kernel = pallas runs on GPUs (Triton) and on the CPU (interpreted), but the "
                          f"mesh's devices are {platform}; set model.moe_kernel=auto.")
    if cfg.model.moe and cfg.model.moe_exchange == "ragged" and platform == "cpu":
        raise ConfigError("model.moe_exchange = ragged needs a backend that runs jax.lax.ragged_all_to_all (XLA:CPU "
                          "compiles it but cannot run it); set model.moe_exchange=auto (fixed buffers on the CPU) "
                          "or fixed.")
    check_host_memory(cfg, mesh.devices.flat[0])
    check_fp8_device(cfg, mesh.devices.flat[0])
    eos = document_eos(cfg)
    if eos is not None and cfg.model.attention == "cudnn":
        raise ConfigError("data.document_mask = true needs an attention kernel that takes document boundaries, which "
                          "model.attention = cudnn does not here; set model.attention=auto (the tiled kernel on packed "
                          "documents) or xla.")
    names, shapes = model.param_names(cfg.model), model.param_shapes(cfg.model)
    layout = make_layout(cfg, mesh, names, shapes)
    optimizer = make_optimizer(cfg.train, names, mesh, layout.moments)  # (Muon deals its matrices over the mesh)
    schedule = lr_schedule(cfg.train)
    shard = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs,  # noqa: E731
                                       is_leaf=lambda x: isinstance(x, P))
    param_shardings, grad_shardings, moment_shardings = shard(layout.params), shard(layout.grads), shard(layout.moments)
    replicated = NamedSharding(mesh, P())
    c, d = cfg.parallel.context, mesh.shape["data"]
    # Context parallelism: the batch's rows are cut into chunk windows inside the step (ints: the
    # whole batch on every device is B · T · 4 bytes).
    batch_sharding = NamedSharding(mesh, P() if c > 1 else compute_rules(cfg, mesh).spec(("batch", None)))
    masked = has_loss_mask(cfg)
    if cfg.parallel.data_mode == "naive":  # torch DataParallel's pattern, for comparison: its own step
        if masked:
            raise ConfigError(f"data.source = {cfg.data.source!r} has a loss mask (chat data), which "
                              "parallel.data_mode = naive does not apply; use data_mode ddp.")
        naive_loss = lambda p, rows, n: loss_fn(cfg, p, rows, n, eos)  # noqa: E731
        rooted = naive.root_optimizer(optimizer, mesh.shape["data"])
        return _program(cfg, mesh, layout, rooted, batch_sharding,
                        TrainState(replicated, param_shardings, naive.opt_state_shardings(rooted, shapes, mesh),
                                   replicated),
                        naive.make_step(cfg, mesh, layout, optimizer, schedule, naive_loss, TrainState),
                        naive.make_loss_and_grads(cfg, mesh, layout, naive_loss), param_shardings)
    opt_shapes = jax.eval_shape(optimizer.init, shapes)
    # ZeRO-Offload (parallel.offload: optimizer): the state lives in host memory between steps; the
    # update copies it in and its result out (per leaf, as XLA schedules the copies).
    offload = cfg.parallel.offload == "optimizer"
    opt_on_device = _opt_state_shardings(opt_shapes, moment_shardings, replicated)
    opt_stored = _opt_state_shardings(opt_shapes, moment_shardings, replicated, "pinned_host") if offload else opt_on_device
    state_shardings = TrainState(replicated, param_shardings, opt_stored, replicated)
    master = cfg.train.master_weights != "none"
    clipping = cfg.train.qk_clip is not None  # (stage 1, data_mode ddp: the config rules)
    order = layer_order(cfg.model)  # (train.qk_clip: each stack's layers)
    delayed = cfg.model.fp8 and cfg.model.fp8_scaling == "delayed"
    # Where 16-bit parameters become float32 for differentiation (README, "Master weights"). Where
    # gradients are all-reduced per layer as their parameter is used (ZeRO-0/1, one microbatch,
    # data > 1, no pipeline: `jaxpar.parallel.gradients`), the upcast is there too, one layer at a
    # time: the all-reduce runs in float32 and the reduced gradient is stored in 16 bits. Elsewhere
    # the step differentiates the float32 upcast of the stored parameters, a transient copy (4
    # bytes per local parameter; of the shards only, under ZeRO-3).
    at_use = upcast_at_use(cfg, mesh.shape["data"], mesh.shape["stage"])

    def for_grads(params):
        """What is differentiated: the stored parameters, or their (exact) float32 upcast."""
        if not master or at_use:
            return params
        return jax.tree.map(lambda p: p.astype(cfg.train.master_weights), params)

    def grads_for_optimizer(g):
        """With master weights the optimizer takes float32 gradients (a no-op where they are already)."""
        return jax.tree.map(lambda x: x.astype(cfg.train.master_weights), g) if master else g

    if mesh.shape["stage"] > 1:
        from jaxpar.parallel.pipeline import make_pipeline_loss_and_grads, table_of
        from jaxpar.parallel.pipeline.table import schedule_of

        table = table_of(schedule_of(cfg.parallel, mesh.shape["stage"]))
        loss_and_grads = context.wrap_batch(make_pipeline_loss_and_grads(
            cfg, mesh, layout, table, lambda lg, tg: cross_entropy_sum(lg, tg, cfg.model.vocab_size), eos=eos), c, d,
            cfg.model.mtp_depth)
    else:
        loss_and_grads = context.wrap_batch(
            make_loss_and_grads(cfg, mesh, layout, lambda p, rows, n: loss_fn(cfg, p, rows, n, eos, d, clipping),
                                clipping), c, d, cfg.model.mtp_depth)

    def grads_at(params, batch):
        loss, g, _ = grads_and_maxima(params, batch)
        return loss, g

    def grads_and_maxima(params, batch):
        """(loss, gradients, each layer's per-head largest logit [layers, N] or None)."""
        maxima = None
        # (MoE: each sequence's router losses weigh 1 / sequences of the step, `jaxpar.model.moe`.)
        with moe.sequences_per_step(cfg.train.global_batch):
            loss, g = loss_and_grads(for_grads(params), batch)
        if clipping:  # (train.qk_clip: the loss comes with the maxima)
            loss, maxima = loss
        if masked:
            # The executors divide the summed loss by every target of the batch; with a loss mask
            # the mean is over the learned ones: one scale of the loss and every gradient (not of
            # the MoE routers' report, which rides in the gradients as `router_stats`).
            scale = (cfg.train.global_batch * cfg.model.seq_len) / jnp.maximum(jnp.sum(batch[:, 1:] >= 0), 1)
            # (The MTP report, losses too, is scaled with them.)
            loss, g = loss * scale, jax.tree_util.tree_map_with_path(
                lambda path, x: x if moe.is_stats(path) or fp8.is_history(path) else (x * scale).astype(x.dtype), g)
        return loss, grads_for_optimizer(g), maxima

    def update(params_and_opt_state, g, grad_norm, stats, maxima, amaxes):
        params, opt_state = params_and_opt_state
        if offload:  # the new state goes back to host memory below (both branches of the cond agree)
            opt_state = jax.device_put(opt_state, opt_on_device)
        params, opt_state = _update(params, opt_state, g, grad_norm, stats, maxima, amaxes)
        return params, (jax.device_put(opt_state, opt_stored) if offload else opt_state)

    def _update(params, opt_state, g, grad_norm, stats, maxima, amaxes):
        updates, opt_state = optimizer.update(g, opt_state, params, grad_norm=grad_norm)
        # ZeRO-1/2: each device computes the update of its optimizer-state shard only; the new
        # parameters are then all-gathered to their (replicated) storage layout by out_shardings.
        updates = jax.lax.with_sharding_constraint(updates, moment_shardings)
        # train.qk_clip (MuonClip): the heads whose largest logit exceeded tau rescaled, on the
        # updated parameters (the master, then cast, with master weights).
        qk = (lambda p: qk_clip.clip(cfg.model, p, maxima, cfg.train.qk_clip, order)) if clipping else (lambda p: p)
        # (model.fp8_scaling: delayed: this step's amaxes shifted into each FP8 history, outside Adam.)
        fp8_history = (lambda p: fp8.record(p, amaxes, cfg.model.fp8_history)) if delayed else (lambda p: p)
        if master:  # the updated master (a moment-layout shard), cast to the stored dtype
            # (MoE sigmoid_bias routers: the selection bias moves on the master, outside Adam.)
            opt_state = opt_state._replace(master=fp8_history(qk(moe.update_bias(cfg.model, opt_state.master, stats))))
            # Cast on the shard, so that out_shardings all-gathers 16-bit parameters, not the master.
            return jax.lax.with_sharding_constraint(stored_params(opt_state, params), moment_shardings), opt_state
        return fp8_history(qk(moe.update_bias(cfg.model, optax.apply_updates(params, updates), stats))), opt_state

    def step(state: TrainState, batch: jax.Array):
        loss, g, maxima = grads_and_maxima(state.params, batch)
        # MoE: what the routers reported leaves the gradients here (zeros in its place); MTP: the
        # main and each depth's loss likewise.
        g, stats = moe.split_stats(cfg.model, g)
        g, report = mtp.split_report(cfg.model, g)
        amaxes = g  # (model.fp8_scaling: delayed: each FP8 history's "gradient" is this step's amaxes)
        if delayed:
            g = fp8.without_amax(g)
        grad_norm = optax.tree.norm(g)
        ok, next_step, skipped = guard_non_finite(cfg.train.on_nan, loss, grad_norm, state.step, state.skipped)
        # A `cond`, not a `where(ok, new, old)` over the state: the select keeps the old moments
        # alive beside the new ones, so XLA copies every donated moment (+16 bytes per parameter
        # of memory traffic a step); the branch updates them in place, as a plain step does.
        params, opt_state = jax.lax.cond(ok, update, lambda s, *_: s, (state.params, state.opt_state), g, grad_norm,
                                         stats, maxima, amaxes if delayed else None)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "skipped_steps": skipped}
        if stats is not None:
            metrics.update(moe.metrics(cfg.model, stats))
        if report is not None:  # `loss` is the main loss; the objective adds mtp_loss_weight x mtp_loss
            metrics.update(mtp.metrics(cfg.model, report))
        if clipping:  # max_logit, and max_logit_<l> per layer
            metrics.update(qk_clip.metrics(cfg.model, maxima))
        return TrainState(next_step, params, opt_state, skipped), metrics

    return _program(cfg, mesh, layout, optimizer, batch_sharding, state_shardings, step, grads_at, grad_shardings)


def _program(cfg: Config, mesh: Mesh, layout: Layout, optimizer: optax.GradientTransformation,
             batch_sharding: NamedSharding, state_shardings: TrainState, step: Callable, loss_and_grads: Callable,
             grad_shardings: Any) -> Program:
    """The one assembly of a `Program` (every data mode): `init` places fresh parameters and the
    optimizer's state by `state_shardings`; `step` donates the state; `loss_and_grads` returns
    the gradients laid out by `grad_shardings`."""
    replicated = NamedSharding(mesh, P())

    def init(key: jax.Array) -> TrainState:
        params = model.init_params(cfg.model, key)
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jnp.zeros((), jnp.int32))

    return Program(
        cfg=cfg, mesh=mesh, layout=layout, optimizer=optimizer, state_shardings=state_shardings,
        batch_sharding=batch_sharding,
        init=jax.jit(init, out_shardings=state_shardings),
        step=jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, replicated), donate_argnums=0),
        loss_and_grads=jax.jit(loss_and_grads, in_shardings=(state_shardings.params, batch_sharding),
                               out_shardings=(replicated, grad_shardings)),
    )


def check_host_memory(cfg: Config, device) -> None:
    """Remat `offload` keeps saved activations, `parallel.offload: optimizer` the optimizer state,
    in `pinned_host` memory: refused (before compiling) on a backend whose devices have none."""
    par = cfg.parallel
    if par.remat != "offload" and par.offload == "none":
        return
    try:
        kinds = sorted({m.kind for m in device.addressable_memories()})
    except (AttributeError, NotImplementedError, RuntimeError):  # a backend without memory kinds
        kinds = []
    if "pinned_host" in kinds:
        return
    have = f"the {device.platform} backend's devices have {kinds or 'no memory kinds'}"
    if par.remat == "offload":
        raise ConfigError(f"parallel.remat = offload needs pinned_host memory to offload to, but {have}; set "
                          "parallel.remat=dots (the same values kept in device memory) or dots_except_mlp.")
    raise ConfigError(f"parallel.offload = {par.offload} needs pinned_host memory to keep the optimizer state "
                      f"in, but {have}; set parallel.offload=none (and parallel.zero=1 or more to shard it).")


def check_fp8_device(cfg: Config, device) -> None:
    """`model.fp8` on a GPU: refused (before compiling) below compute capability 8.9 (Ada; Hopper is
    9.0), which has no FP8 tensor cores for XLA's cuBLASLt FP8 GEMMs. Elsewhere (CPU, emulated) it
    runs."""
    if not cfg.model.fp8 or device.platform != "gpu":
        return
    capability = getattr(device, "compute_capability", None)
    if capability is not None and tuple(int(v) for v in str(capability).split(".")[:2]) < (8, 9):
        raise ConfigError(f"model.fp8 = true needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper), "
                          f"but this GPU ({getattr(device, 'device_kind', 'unknown')}) has {capability}; set "
                          "model.fp8=false.")


def lower_step(cfg: Config, mesh: Mesh | None = None) -> tuple[jax.stages.Compiled, Mesh]:
    """Compile the train step of `cfg` without allocating state (for `jaxpar.inspect` and tests)."""
    program = build(cfg, mesh)
    compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
    return compiled, program.mesh
