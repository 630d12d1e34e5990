"""The planner's traffic model: the collectives one device runs per step of a config on a mesh
shape, with their result bytes by mesh axis (the measure of `jaxpar.inspect.Report.traffic(spans=axis)`:
a collective over two axes counts on both) and the bytes each puts on the wire (ring algorithms).
"""

from __future__ import annotations

import dataclasses

from jaxpar.config import Config
from jaxpar.mesh import AXES
from jaxpar.parallel.gradients import reduction
from jaxpar.plan import moe as moe_costs
from jaxpar.parallel.pipeline.table import hops_per_tick, v_reorder_share
from jaxpar.plan.memory import (_BYTES, _fused_b, _pair_loop, _paired_share, _schedule, _stage_slots, context_block, model_state,
                                muon_deal, schedule_key)


@dataclasses.dataclass(frozen=True)
class Collective:
    """`count` runs per step of a `kind` collective over `axes` with `bytes` of result per device;
    `overlap`: issued inside the layer scan, where it can hide behind the next layer's compute."""
    kind: str
    axes: tuple[str, ...]
    bytes: float
    count: int = 1
    overlap: bool = False
    static: float | None = None
    """How often the HLO states it where that differs from `count` (what `jaxpar.inspect` reads):
    one in a pipeline's action branch is stated in every tick."""
    group: int | None = None
    """The devices of its groups where fewer than its axes hold (context parallelism's: c
    consecutive data ranks), for its wire bytes and its link (`steptime.step_time`)."""
    paired: float = 0.0
    """The share of its runs on DualPipeV's F&B ticks beside the other action's computation, which
    `steptime.step_time` hides behind those ticks' compute: the expert all-to-alls of F's and B's
    one loop (`pipeline.actions.pair`)."""

    def wire(self, n: int) -> float:
        """Bytes one device sends per step over a group of n devices (ring algorithms):
        all-reduce 2(n-1)/n of its result, all-gather and all-to-all (n-1)/n, reduce-scatter (n-1)
        times its (1/n-sized) result, a permute its result."""
        per = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": n - 1,
               "collective-permute": 1.0, "all-to-all": (n - 1) / n}[self.kind]
        return per * self.bytes * self.count


def collectives(cfg: Config, shape: tuple[int, int, int], platform: str = "gpu") -> list[Collective]:
    """The collectives of one step of `cfg` on a mesh of `shape` on `platform` (which decides MoE's
    token exchange: `jaxpar.plan.moe.exchange`) (scalars such as the loss and the gradient norm's
    partial sums left out: a few bytes)."""
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    st = model_state(cfg, shape)
    itemsize, act_size = _BYTES[m.param_dtype], _BYTES[m.dtype]
    micro, zero = par.microbatches, par.zero
    red = reduction(cfg, d, p)  # where the step reduces and gathers (the executors read the same)
    rows = cfg.train.global_batch // (d * micro)
    if par.context > 1:  # B·c/(d·m) sequences of T/c tokens each: per token as rows of T
        rows = cfg.train.global_batch / (d * micro)
    sp = par.sequence_parallel and t > 1
    # With master weights gradients are reduced in float32, and what ZeRO-3 gathers is the float32
    # upcast of its shards (jaxpar.train.step); the updated parameters are gathered in 16 bits.
    gb = 4 / itemsize if cfg.train.master_weights != "none" else 1.0
    # Expert parallelism's experts (`jaxpar.plan.moe`): never reduced over data, never ZeRO-sharded.
    ep = st["experts"]
    out: list[Collective] = []
    if p == 1:
        out += _data_reductions(cfg, red, gb, groups=((st["local"] - ep, st["sharded"]),))
        if d > 1 and zero == 3:
            blocks, shared = _gathered(st, "blocks_sharded", gb, itemsize), _shared_gathered(st, gb, itemsize)
            if red.gather == "step":
                # zero3_gather: step: every shard gathered once before the microbatch loop and
                # kept for the step.
                out.append(Collective("all-gather", ("data",), blocks + shared, 1, overlap=True))
            else:
                # Per microbatch: each block layer gathered in the forward and again in the
                # backward pass, the leaves outside the layer scan once.
                out.append(Collective("all-gather", ("data",), 2 * blocks + shared, micro, overlap=True))
    if p > 1:
        sched, table = _schedule(cfg, p)
        ticks = sched.num_ticks()
        msg = rows * (m.seq_len // t if sp else m.seq_len) * m.d_model * act_size
        # The tick's hops (idle stages send zeros): F's output and B's gradient, each both ways under
        # the V unless no stage sends two in a tick (`pipeline.hops_per_tick`).
        # (On DualPipeV's F&B ticks both hops wait for the loop of F and B: exposed too.)
        hops = hops_per_tick(table.placement, p, table.one_message)
        out.append(Collective("collective-permute", ("stage",), msg, hops * ticks))
        f32 = 4 / itemsize
        v = par.virtual_stages
        # What is reduced or gathered at use sits in the tick's action branches (B or W; F and B
        # or I for ZeRO-3's gathers), which the HLO states once per tick and chunk each (F and a
        # fused B twice where F&B ticks run them as one loop, `_pair_loop`).
        stated = 1 + _pair_loop(cfg, p)
        branches = _fused_b(*schedule_key(cfg, p)) * stated + table.split
        shared, shared_sh = st["local"] - st["blocks"], st["sharded"] - st["blocks_sharded"]
        out += _data_reductions(cfg, red, gb, static=ticks * branches / v, groups=(
            (st["blocks"] - ep, st["blocks_sharded"]), (shared, shared_sh)))
        # The shared leaves (embeddings, head; used by the end stages) are summed over `stage` after
        # the tick loop (after their data reduction, in float32): reduce-scattered where they are
        # stored sharded over `stage` (large ones, gathered over it before the loop), else all-reduced.
        staged, staged_sh = st["staged"], st["staged_sharded"]
        div = d if d > 1 and zero >= 1 else 1  # (a ZeRO-sharded leaf's data shard)
        if staged:
            out.append(Collective("all-gather", ("stage",), staged - staged_sh + staged_sh / (div if zero == 3 else 1)))
            out.append(Collective("reduce-scatter", ("stage",), (staged - staged_sh + staged_sh / div) * f32 / p))
        if shared > staged:
            rest, rest_sh = shared - staged, shared_sh - staged_sh
            out.append(Collective("all-reduce", ("stage",), (rest - rest_sh + rest_sh / div) * f32))
        if d > 1 and zero == 3:
            blocks, shared_g = _gathered(st, "blocks_sharded", gb, itemsize), _shared_gathered(st, gb, itemsize)
            if red.gather == "step":
                out.append(Collective("all-gather", ("data",), blocks + shared_g, 1, overlap=True))
            else:
                # Each chunk's layers gathered where F and B (or I) use them, per microbatch (B's
                # backward reuses what its recomputed forward gathered, whatever the remat policy:
                # measured), the shared leaves where the end stages' F and B use them.
                uses = 2
                out.append(Collective("all-gather", ("data",), blocks, uses * micro, overlap=True,
                                      static=ticks * uses * stated / v))
                if shared_sh:
                    out.append(Collective("all-gather", ("data",), shared_g, micro, overlap=True, static=ticks))
        if table.placement == "v" and _stage_slots(cfg, p) is None:
            # The V's chunks from model order and the gradients back (`pipeline.stash.v_chunks`): the
            # stored parameters (ZeRO-3: data shards) and the reduced gradients (ZeRO 1-3: shards),
            # each by two collective-permutes over `stage`.
            shards = st["blocks"] - st["blocks_sharded"] + st["blocks_sharded"] / d
            share = v_reorder_share(p)
            out.append(Collective("collective-permute", ("stage",), share * (shards if zero == 3 else st["blocks"])))
            out.append(Collective("collective-permute", ("stage",), share * (shards if zero >= 1 else st["blocks"])))
        elif _stage_slots(cfg, p) is not None or par.virtual_stages > 1:
            # Each stage's layer slots by an all-to-all over stage (`pipeline.stash.to_slots`), or
            # the interleaved chunks reordered into pipeline order (GSPMD's all-to-all over stage),
            # of the stored parameters (ZeRO-3: data shards), and the gradients back after their
            # data reduction (ZeRO 1-3: data shards).
            shards = st["blocks"] - st["blocks_sharded"] + st["blocks_sharded"] / d
            out.append(Collective("all-to-all", ("stage",), shards if zero == 3 else st["blocks"]))
            out.append(Collective("all-to-all", ("stage",), shards if zero >= 1 else st["blocks"]))
    if d > 1 and zero in (1, 2) and st["sharded"]:
        out.append(Collective("all-gather", ("data",), st["sharded"]))  # the updated parameters
    if t > 1:
        out += _tensor_collectives(cfg, rows, t, sp, act_size, p, d)
    out += context_collectives(cfg, shape)
    out += muon_collectives(cfg, shape)
    volume, count = moe_costs.all_to_all(cfg, shape, rows, act_size, platform)
    if count:  # tokens to their experts and back: the expert compute waits on them (exposed), but
        # on DualPipeV's F&B ticks, in one loop beside the other action's computation (`paired`)
        share = _paired_share(*schedule_key(cfg, p)) if _pair_loop(cfg, p) else 0.0
        out.append(Collective("all-to-all", ("data",), volume, count, paired=share))
        ids, counts = moe_costs.expert_ids(cfg, shape, rows, platform), moe_costs.expert_counts(cfg, shape, platform)
        if ids[1]:  # the fixed exchange: each buffer row's local expert
            out.append(Collective("all-to-all", ("data",), *ids, paired=share))
        if counts[1]:  # the ragged exchange: every rank's per-expert counts
            out.append(Collective("all-gather", ("data",), *counts, paired=share))
    volume, count, _ = moe_costs.assembled_experts(cfg, shape, act_size)
    if count:  # replicated experts: each rank's expert assembled from the slices of every rank
        out.append(Collective("all-to-all", ("data",), volume, count))
    return out


def _gathered(st: dict, key: str, gb: float, itemsize: int) -> float:
    """Bytes one ZeRO-3 gather of the `key` (`blocks_sharded` or `sharded`) shards moves: as stored
    (times `gb`), but the FP8 matmuls' weights (`fp8_<key>`, `model.fp8`) at 1 byte per element."""
    return (st[key] - st["fp8_" + key]) * gb + st["fp8_" + key] / itemsize


def _shared_gathered(st: dict, gb: float, itemsize: int) -> float:
    """`_gathered` of the sharded leaves outside the block stacks (embeddings, head, MTP modules)."""
    return _gathered(st, "sharded", gb, itemsize) - _gathered(st, "blocks_sharded", gb, itemsize)


def muon_collectives(cfg: Config, shape: tuple[int, int, int]) -> list[Collective]:
    """Muon's momentum to its owning ranks and the orthogonalized update back
    (`jaxpar.train.muon.orthogonalize_owned`, its deal `muon.deal`), in `train.muon_ns_dtype`,
    exposed (between the backward pass and the update): over `model` (tensor parallelism splits
    every matrix) and over `data` under ZeRO-1+ (the state's shards), one all-to-all each way of
    the rank's owned matrices; under ZeRO-0 the stacks are sliced from the replicated momentum and
    the updates all-gathered over `data` (the data group's owned matrices). Never over `stage`: a
    stage's layers are dealt within it."""
    d, p, t = shape
    if cfg.train.optimizer != "muon" or d * p * t == 1:
        return []
    owned = muon_deal(cfg, shape).owned * _BYTES[cfg.train.muon_ns_dtype]
    out = [Collective("all-to-all", ("model",), owned, 2)] if t > 1 else []
    if d > 1:
        out.append(Collective("all-to-all", ("data",), owned, 2) if cfg.parallel.zero >= 1
                   else Collective("all-gather", ("data",), owned * d))
    return out


def context_collectives(cfg: Config, shape: tuple[int, int, int]) -> list[Collective]:
    """Context parallelism's collectives over `data` (`jaxpar.parallel.context`), in groups of c
    consecutive data ranks, per layer (of this device's stage: n_layers / p) and microbatch,
    blk = `context_block`:

    - `all_gather`: K and V all-gathered in the forward (result c·blk each; each device receives
      (c − 1)·blk) and again in the backward (the forward saves the rank's own K and V only), their
      cotangents reduce-scattered in the backward (result blk each, the same received). Remat
      `full`'s recomputed forward gathers the same K and V as the backward: XLA keeps one
      (measured: the same bytes as remat `none`). The gathers feed the attention at once:
      exposed; the backward's scatters run beside the layer's remaining backward.
    - `ring`: (K, V) passed c − 1 hops forward, and in the backward c − 1 hops of (K, V) and c of
      (dK, dV) (the last takes them home), each a permute of blk (remat `full`'s recomputed hops
      are the backward's (K, V) hops: one kept, measured). Each hop runs beside the tile computation of the block in hand:
      overlappable (`overlap`). (Refused under a pipeline.)
    - MoE (`jaxpar.model.moe`): per MoE layer and microbatch, in the backward, the router's
      per-sequence expert counts (float32 [B·c/(d·m), E]) all-gathered over the group
      (`router_losses`: result c x that); in capacity mode, the forward and the backward's report
      gather the group's expert choices (int32, k per token) into whole sequences (`keep_mask`:
      result B·c/(d·m) x T x k x 4 bytes; remat `full`'s recomputed one is the backward's).

    With `data.document_mask` the int32 token ids [B_loc, T] are all-gathered once per microbatch.
    (The all-to-alls cutting the batch into the ranks' zigzag chunks, a few bytes per token, are
    left out.) Under a pipeline these sit in the tick's action branches, which the HLO states once
    per tick each (`Collective.static`): F's forward, and each backward branch (B, or a split
    table's I); a layer scan of the chunk's n_layers / (p·v) layers (measured: 1F1B, ZB-H1)."""
    d, p, t = shape
    m, par = cfg.model, cfg.parallel
    c = par.context
    if c <= 1:
        return []
    blk = context_block(cfg, shape)
    L, micro = m.n_layers // p, par.microbatches
    seqs = cfg.train.global_batch * c // (d * micro)  # a microbatch's sequences on a device
    moe_layers = _moe_layers(cfg, L)
    if p > 1:
        sched, table = _schedule(cfg, p)
        # Per tick, the layers of one chunk: F's forward and each backward branch's (B, or I).
        per_tick = sched.num_ticks() / par.virtual_stages
        stated = 1 + _pair_loop(cfg, p)  # (F and a fused B stated again in the F&B loop)
        branches = _fused_b(*schedule_key(cfg, p)) * stated + table.split

        def static(fwd: int, bwd: int) -> float:
            """How often the HLO states one run `fwd` times per layer in F, `bwd` in a backward."""
            return per_tick * (fwd * stated + branches * bwd)
    else:
        def static(fwd, bwd):
            return None
    if par.context_attention == "all_gather":
        out = [Collective("all-gather", ("data",), c * blk, 4 * L * micro, group=c, static=static(2 * L, 2 * L)),
               Collective("reduce-scatter", ("data",), blk, 2 * L * micro, overlap=True, group=c,
                          static=static(0, 2 * L))]
    else:
        hops = 2 * (c - 1) + 2 * (c - 1) + 2 * c
        out = [Collective("collective-permute", ("data",), blk, hops * L * micro, overlap=True, group=c)]
    if moe_layers:
        # (The router's losses and report run in its backward only.)
        out.append(Collective("all-gather", ("data",), c * seqs * m.n_experts * 4, moe_layers * micro, group=c,
                              static=static(0, moe_layers)))
        if m.capacity_factor is not None:
            out.append(Collective("all-gather", ("data",), seqs * m.seq_len * m.experts_per_token * 4,
                                  2 * moe_layers * micro, group=c, static=static(moe_layers, moe_layers)))
    if cfg.data.document_mask:
        out.append(Collective("all-gather", ("data",), seqs * m.seq_len * 4, micro, group=c,
                              static=static(par.virtual_stages, 0)))  # (F's, once a tick)
    return out


def _tensor_collectives(cfg: Config, rows: int, t: int, sp: bool, act_size: int, p: int, d: int) -> list[Collective]:
    """Megatron's activation collectives over `model`: per layer and microbatch, one closing each
    sub-layer each way (all-reduce of b·s·h; under SP an all-gather of b·s·h and a reduce-scatter
    to b·s·h/t), the vocab-parallel embedding's and head's, and again for every recomputed forward
    (remat `full`; a pipeline's B runs from what F saved). Remat `dots` saves the matmul outputs but
    not an all-gathered input, so under SP the backward pass gathers again, nor the all-reduce
    closing attention, so without SP it all-reduces that again (`offload` saves what `dots`
    does; `dots_except_mlp` saves attention's output after that all-reduce, but its backward
    gathers the inputs again under SP as `dots`' does). Small ones: the
    gradients of kv projections replicated over `model` (n_kv_heads < t), of MLA's latent
    projections and norms and, under SP, of the norms, all-reduced per layer."""
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
    if m.mla and t > 1:  # MLA's latent projections and their norms, replicated on every model rank
        r_q = m.q_lora_rank or 0
        small += (m.d_model * r_q + r_q + m.d_model * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank) \
            * _BYTES[m.param_dtype]
    if m.qk_norm and t > 1:  # the q and k norm scales, shared by heads on every model rank
        small += 2 * m.head_size * _BYTES[m.param_dtype]
    if sp:  # norm parameters see a slice of the sequence on each rank
        small += 2 * m.d_model * (2 if m.arch == "gpt2" else 1) * _BYTES[m.param_dtype]
    if small:
        out.append(Collective("all-reduce", ("model",), small * L, micro))
    experts = moe_costs.whole_experts_bytes(cfg, d, t) * _moe_layers(cfg, L)
    if experts:  # experts whole on every model rank: their gradients summed over model where used
        out.append(Collective("all-reduce", ("model",), experts, micro))
    return out


def _moe_layers(cfg: Config, L: int) -> int:
    """MoE layers among L layers of one stage (all, or a mixed model's share)."""
    return round(L * moe_costs.moe_fraction(cfg.model))


def _tp_sublayers(cfg: Config, L: int, t: int) -> int:
    """Sub-layers of L layers closed by an activation collective over `model`: attention and the
    MLP of each, less the MoE layers whose routed experts are whole on every model rank
    (`expert_tensor_parallel: false`: each rank routes its own sequence shard) and which have no
    shared experts (those stay tensor-parallel, `enter_tp`/`exit_tp` of their own)."""
    return 2 * L - (_moe_layers(cfg, L) if moe_costs.routes_sequence_shard(cfg, t) and not cfg.model.n_shared_experts
                    else 0)


def _data_reductions(cfg: Config, red, gb: float, groups, static: float | None = None) -> list[Collective]:
    """The data-axis reductions of the gradients, read from the executors' one rule
    (`jaxpar.parallel.gradients.Reduction.gradient`): for each group of leaves (its bytes, and of
    those the bytes ZeRO shards over data; expert-parallel experts left out), a reduce-scatter of
    the sharded part and an all-reduce of the rest, in the dtype, at the place and as often as the
    rule says. `static`: how often the HLO states one reduced at use (a pipeline's tick branches)."""
    out = []
    f32 = 4 / _BYTES[cfg.model.param_dtype]
    for nbytes, sharded in groups:
        for part, is_sharded in ((sharded, True), (nbytes - sharded, False)):
            rule = red.gradient(is_sharded)
            if rule is None or not part:
                continue
            use = rule.when == "use"
            out.append(Collective(rule.op, ("data",), (part / red.data if rule.op == "reduce-scatter" else part)
                                  * (f32 if rule.float32 else gb), rule.per_step, overlap=use,
                                  static=static if use and red.pipeline else None))
    return out


def bytes_per_axis(cfg: Config, shape: tuple[int, int, int], platform: str = "gpu") -> dict[str, float]:
    """Result bytes of the collectives of one step on each axis (a collective spanning two axes
    counts on both), as `jaxpar.inspect.Report.traffic(spans=axis)` reads them from the HLO."""
    out = {a: 0.0 for a in AXES}
    for c in collectives(cfg, shape, platform):
        for a in c.axes:
            out[a] += c.bytes * c.count
    return out


def compiled_bytes_per_axis(cfg: Config, shape: tuple[int, int, int], platform: str = "gpu") -> dict[str, float]:
    """`bytes_per_axis` as the HLO states it statically, which is what `jaxpar.inspect` counts
    (`platform`: the one the program was compiled for; cpu for jaxpar's tests).

    The two differ inside a pipeline: there the executor's F and B sit in `lax.cond`s evaluated
    every tick, and the inspector counts every branch as taken in every tick (an upper bound),
    where the step really runs one branch per action: the data-axis collectives at use
    (`Collective.static`) and tensor parallelism's. Per tick the program
    holds F (the embedding's collective and the chunk's forward), B of the last chunk (forward,
    head, backward) and B of the others (forward without the last sub-layer's collective, whose
    result the vjp drops, and backward); remat adds the recomputed forward to both B branches.
    Where F&B ticks run F and B as one loop (`_pair_loop`) the tick states them both again."""
    out = {a: 0.0 for a in AXES}
    for c in collectives(cfg, shape, platform):
        for a in c.axes:
            out[a] += c.bytes * (c.count if c.static is None else c.static)
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
    out["model"] += static * (1 + _pair_loop(cfg, p)) - executed
    return out
