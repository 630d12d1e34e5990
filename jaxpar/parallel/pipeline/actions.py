"""The tick's actions, as functions of one stage's plan (`plan.StagePlan`) and traced inputs
(`plan.Stage`): F (`forward`), B or I (`backward`) and W (`weight_grads`), DualPipeV's F beside a
B as one loop (`pair`, from F's and B's own parts), and what they hand the model (a chunk's
parameters, the seeds ZeRO-2 differentiates, the shards ZeRO-3 gathers at use).

F saves what B needs: the residuals of each layer's `jax.vjp` (what the remat policy keeps), less
the parameters among them (B takes those from the parameters themselves, so the stash holds
activations only), in the layer's row of its stash slot; the embedding's residuals and the head's
cotangent beside them. Their structure is the plan's (`StagePlan.residuals`), recorded by the
abstract trace of F that builds it (`record`). With a split table the weight matmuls are not
differentiated: they take taps, whose cotangents (input, output cotangent) I saves for W
(`jaxpar.model.layers.split_backward`); where F stashes the inputs itself (`stash_inputs`), the
taps carry output cotangents only."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import model
from jaxpar.model.layers import document_segments, packed, sequence_layout, split_backward, weight_gradient
from jaxpar.model import fp8, mtp, qk_clip
from jaxpar.model.transformer import REMAT_POLICIES, block_bodies, layer_order, scan_layers, stack, token_ids
from jaxpar.parallel import context, microbatches
from jaxpar.parallel.gradients import _seed, mark_for_use
from jaxpar.parallel.pipeline.setup import DATA, STAGE
from jaxpar.parallel.pipeline.stash import get_row, param_leaves, set_row
from jaxpar.sharding import vary, varying_axes, zeros_like_varying

# (`plan` is a `plan.StagePlan`, `st` a `plan.Stage`, `rec` a `plan.Recording`: the plan module
# builds its plan by tracing `forward`, so this module does not import it.)

# -- what the actions hand the model --------------------------------------------------------------


def zeros(plan, shape, dtype=None, axes=None):
    """Zeros that vary over the manual axes their contents vary on (default: an activation's)."""
    dtype = plan.setup.cfg.model.dtype if dtype is None else dtype
    axes = plan.act_axes if axes is None else axes
    return jax.lax.pcast(jnp.zeros(shape, dtype), axes, to="varying") if axes else jnp.zeros(shape, dtype)


def zero_taps(plan) -> dict:
    """path -> (x, g) zeros of a tapped weight's pair, [n, ...] (x None where F stashes it)."""
    return {k: (None if plan.stash_inputs else zeros(plan, (plan.chunk_layers[k], *xs), xd, ax),
                zeros(plan, (plan.chunk_layers[k], *gs), gd, ax))
            for k, (xs, xd, gs, gd, ax, _) in plan.taps.items()}


def kind_taps(plan) -> dict:
    """kind -> the zero taps of that stack's tapped weights, [n, ...] (`zero_taps`)."""
    taps = zero_taps(plan)
    return {kind: {k_: taps[k_] for k_ in plan.kind_paths[kind] if k_ in taps} for kind in plan.kinds}


def chunk_params(st, k):
    """Local chunk k's block parameters, [layers per chunk, ...]."""
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, k, 0, keepdims=False), st.blocks)


def diff_blocks(plan, full_bl):  # one chunk: [layers per chunk, ...]; its zero dim is the stacked one's
    return jax.tree.map(lambda w, dim, m: _seed(w, dim, plan.setup.d) if m else w, full_bl, plan.block_dims,
                        plan.block_mask)


def diff_shared(plan, st):
    return jax.tree.map(lambda w, dim, m: _seed(w, dim, plan.setup.d) if m else w, st.shared, plan.shared_dims,
                        plan.shared_mask)


def handed_blocks(plan, diff, full):
    """One chunk's blocks as `hand_out` receives them (`gradients.mark_for_use`)."""
    return mark_for_use(plan.setup.reduction, diff, full, plan.block_dims)


def handed_shared(plan, st, diff):
    return mark_for_use(plan.setup.reduction, diff, st.shared, plan.shared_dims)


def ends(plan, st, k):
    """Does this (stage, local chunk) hold the first / the last chunk of the model? (The last is
    the last local chunk of `Setup.last_stage`: stage p-1's, or stage 0's under the V.)"""
    return (st.index == 0) & (k == 0), (st.index == plan.setup.last_stage) & (k == plan.setup.v - 1)


def active(plan, st, k):
    """This (stage, local chunk)'s active layer slots per stack (None: every slot is)."""
    if not plan.setup.slots.gather:
        return None
    return {kind: jnp.asarray(a)[st.index, k] for kind, a in plan.setup.slots.active.items()}


def layer_indices(plan) -> dict:
    """kind -> [0, n) for the stack's n layers in a chunk: what the actions' layer loops
    (`transformer.scan_layers`) scan in place of the layers' parameters, each step taking its
    layer from the stage's parameters itself (`layer_params`)."""
    return {kind: jnp.arange(plan.n_layers[kind]) for kind in plan.kinds}


def layer_params(plan, st, k, kind, j):
    """(parameters, what is differentiated) of layer j of local chunk k's stack `kind`, sliced
    from the stage's [chunks, layers, ...] leaves at [k, j] in one step. (Slicing the chunk first,
    `chunk_params`, then its layers in the loop made XLA copy the chunk's parameters on every F
    and every B or I of a stage with more than one chunk: a temp buffer of the chunk's size,
    measured from the compiled step.)"""
    full = jax.tree.map(lambda w: jax.lax.dynamic_slice(w, (k, j, *[0] * (w.ndim - 2)), (1, 1, *w.shape[2:])
                                                        ).reshape(w.shape[2:]), stack(st.blocks, kind))
    diff = jax.tree.map(lambda w, dim, m: _seed(w, dim, plan.setup.d) if m else w, full, plan.layer_dims[kind],
                        stack(plan.block_mask, kind))
    return full, diff


def bodies(plan, st, k):
    """kind -> one layer of chunk k (`jaxpar.model.transformer.block_bodies`), under the remat policy."""
    s = plan.setup
    blocks = model.bind(s.chunk_cfg, {"blocks": chunk_params(st, k)}).blocks
    return block_bodies(s.chunk_cfg, blocks, s.cfg.parallel.remat, active(plan, st, k))[1]


def microbatch(setup, st, mb):
    """Microbatch mb's input and target tokens [b, seq] (under context parallelism each sequence's
    two chunks, from its chunk windows: `parallel.context.row_split`), and the inputs and targets
    of its multi-token prediction depths (`jaxpar.model.mtp.depth_rows`)."""
    rows, split = st.micro[mb], context.row_split(setup.cfg)
    return (*split(rows, 0), mtp.depth_rows(split, rows, setup.cfg.model.mtp_depth, setup.eos))


def chunk_forward(plan, st, blocks, shared, x_in, tokens, first, k):
    """The chunk as the unpipelined model runs it (the taps' recording trace, `plan._taps`)."""
    s = plan.setup
    x = jax.lax.cond(first, lambda: model.bind(s.chunk_cfg, shared).embed_tokens(tokens), lambda: x_in)
    return model.bind(s.chunk_cfg, {"blocks": blocks}).backbone(x, remat=s.cfg.parallel.remat,
                                                                active=active(plan, st, k))


# -- residuals: what F stashes and B rebuilds its pullbacks from ----------------------------------


def take_residuals(plan, rec, name: str, pullback, known: list) -> tuple:
    """A pullback's residuals to stash: each is a parameter ("p", its index in `known`) or an
    activation ("s", its stash leaf), stashed once however many times the pullback refers to it
    (e.g. one layer input saved by the q, k and v matmuls). The structure, per `name`, is what B
    unflattens: recorded into `rec` by the plan's trace, and every trace of F must find the same."""
    leaves, treedef = jax.tree.flatten(pullback)
    ids = {id(w): i for i, w in enumerate(known)}
    stashed, where = {}, []
    for r in leaves:
        if id(r) in ids:
            where.append(("p", ids[id(r)]))
        else:
            where.append(("s", stashed.setdefault(id(r), (len(stashed), r))[0]))
    where = tuple(where)
    planned = rec.residuals if rec is not None else plan.residuals
    if name in planned and where != planned[name][1]:
        raise AssertionError(f"the residuals of {name!r} differ between traces of F")
    if rec is not None:
        rec.residuals[name] = (treedef, where)
    return tuple(r for _, r in stashed.values())


def take_inputs(plan, rec, kind: str, saved: tuple, inputs: dict) -> tuple:
    """The tapped matmuls' inputs to stash beside a layer's residuals (`stash_inputs`: path -> x,
    each once however many matmuls share it, e.g. q, k and v), their leaves numbered after the
    residuals': `x_source`, path -> (kind, leaf). Every trace of F must find the same."""
    extra, where = {}, {}
    for path, x in sorted(inputs.items()):
        where[path] = (kind, len(saved) + extra.setdefault(id(x), (len(extra), x))[0])
    source = rec.x_source if rec is not None else plan.x_source
    known = {path: w for path, w in source.items() if w[0] == kind}
    if known and known != where:
        raise AssertionError(f"the tapped inputs of {kind!r} differ between traces of F")
    if rec is not None:
        rec.x_source.update(where)
    return tuple(x for _, x in extra.values())


def pullback(plan, name: str, saved, known: list):
    """The pullback `take_residuals` took apart, from the stashed leaves and the parameters."""
    treedef, where = plan.residuals[name]
    return jax.tree.unflatten(treedef, [known[i] if kind == "p" else saved[i] for kind, i in where])


# -- F ------------------------------------------------------------------------------------------


def forward(plan, st, x_in, mb, k, stash, slot, g_shared, rec=None):
    """F: the chunk's output, run one layer at a time under `jax.vjp`, each layer's residuals
    written straight into row (slot, layer) of the stash (no stacked copy: DESIGN.md §5.3); on the
    first chunk the embedding, on the last the loss and its backward through the head (the chunk
    output's cotangent, stashed too, and the head's gradients, added to the float32 `g_shared`
    inside the head's `cond`). With `rec` (and `stash` None): the plan's trace, which records the
    residuals' structure and types into `rec`. Returns (y, stash, g_shared, loss, maxima): under
    train.qk_clip each layer's per-head largest logit (kind -> [layers of the chunk's stack, N],
    "mtp" -> [depths, N] on the last chunk, -inf elsewhere), else {}."""
    s = plan.setup
    tokens, targets, depths = microbatch(s, st, mb)
    with sequence_layout(_layout_of(s, tokens)):
        x, embed_saved, sh = _embed(plan, st, x_in, tokens, k, rec)
        # (Under a split table each weight matmul takes its tap from the layer's `linear`: the
        # bodies are built, and traced, inside the split context.)
        with _split(plan):
            (y, layers), tops = scan_layers(s.chunk_cfg, layer_indices(plan),
                                            (x, None if stash is None else stash["layers"]),
                                            _f_layer(plan, st, k, slot, rec), kind_taps(plan) if s.table.split else None)
        return _head(plan, st, k, y, targets, depths, sh, embed_saved, layers, tops, stash, slot, g_shared, rec)


def _layout_of(s, tokens):
    """The microbatch's layout (packed documents, a context-parallel shard), read by its embedding
    and attention; B and W use what F saved (the attention keeps what it needs as residuals)."""
    if s.cfg.parallel.context > 1:
        return context.layout(s.cfg, tokens, s.d, s.eos)
    return None if s.eos is None else packed(document_segments(token_ids(tokens), s.eos))


def _split(plan):
    return split_backward({}, plan.stash_inputs) if plan.setup.table.split else contextlib.nullcontext()


def _embed(plan, st, x_in, tokens, k, rec):
    """F's start: the chunk's input, the embedding's output on the first chunk (a cond, not a
    select: under tensor parallelism the lookup ends in a collective, under ZeRO-3 the
    embedding's gather, that the other stages must not pay for; the shared parameters are bound
    inside the branch for that reason), and its residuals to stash."""
    s = plan.setup
    first, _ = ends(plan, st, k)
    sh = diff_shared(plan, st)
    x, pull_embed = jax.vjp(lambda sh: jax.lax.cond(
        first, lambda: model.bind(s.chunk_cfg, handed_shared(plan, st, sh)).embed_tokens(tokens), lambda: x_in), sh)
    return x, take_residuals(plan, rec, "embed", pull_embed, param_leaves(st.shared, sh)), sh


def _f_layer(plan, st, k, slot, rec):
    """F's layer function for `scan_layers` (chunk k's bodies, built here under train.qk_clip's
    recording): (kind, _, tap, i, (x, stash layers)) -> ((y, stash layers), the layer's largest
    logits or None) of chunk k's layer i, its residuals written into row (slot, i)."""
    s = plan.setup
    with qk_clip.recording(s.clipping):
        body = bodies(plan, st, k)

    def layer(kind, _, tap, i, carry):
        x, stash_layers = carry
        full_l, diff_l = layer_params(plan, st, k, kind, i)
        diff = plan.flat_kind(kind, diff_l)
        fixed = {p_: w for p_, w in diff.items() if p_ in plan.taps}  # (split: the taps differentiate these)

        def f(rest, x, tap):
            handed = mark_for_use(s.reduction, plan.unflat_kind(kind, {**fixed, **rest}), full_l, plan.layer_dims[kind])
            # (The body reports beside y, `block_bodies`: with `stash_inputs` the tapped matmuls'
            # inputs, which their pullbacks do not keep; under train.qk_clip its largest logits.)
            return body[kind](x, (handed, tap, i))

        y, pull, aux = jax.vjp(f, {p_: w for p_, w in diff.items() if p_ not in fixed}, x, tap, has_aux=True)
        saved = take_residuals(plan, rec, kind, pull, param_leaves(full_l, diff_l))
        if plan.stash_inputs:
            saved = (*saved, *take_inputs(plan, rec, kind, saved, aux["inputs"]))
        top = aux.get(qk_clip.KEY)  # (train.qk_clip) this layer's per-head largest logit [N]
        if stash_layers is None:
            rec.layer_avals[kind] = [jax.typeof(r) for r in saved]
            return (y, None), top
        return (y, {**stash_layers, kind: tuple(jax.lax.dynamic_update_slice(
            b, vary(r, varying_axes(b)).reshape(1, 1, -1).astype(b.dtype), (slot, i, 0))
            for b, r in zip(stash_layers[kind], saved))}), top

    return layer


def _head(plan, st, k, y, targets, depths, sh, embed_saved, layers, tops, stash, slot, g_shared, rec):
    """F's end: on the last chunk the loss and its backward through the head (its gradients added
    inside the head's `cond`: the other chunks' F fills no vocabulary-sized zeros; multi-token
    prediction's modules run here too, on the last stage, and report their blocks' largest logits
    under train.qk_clip), and the embedding's residuals and the head's cotangent into the slot."""
    s = plan.setup
    _, last = ends(plan, st, k)

    def objective(sh, y):
        with qk_clip.recording(s.clipping and s.cfg.model.mtp_depth > 0) as recorded:
            loss = mtp.objective(model.bind(s.chunk_cfg, handed_shared(plan, st, sh)), y, targets, depths, s.loss_sum,
                                 s.n_tokens, REMAT_POLICIES[s.cfg.parallel.remat])
        return loss, (qk_clip.gathered(recorded) if recorded else None)

    def head(g):
        loss, pull, top = jax.vjp(objective, sh, y, has_aux=True)
        dsh, dy = pull(jnp.ones_like(loss))
        return loss, microbatches.add_f32(g, dsh), dy, top

    def no_head(g):
        top = None
        if s.clipping and s.cfg.model.mtp_depth:  # (-inf: no logit of the MTP blocks on this chunk)
            top = jnp.tile(qk_clip.none(st.shared["mtp"]["blocks"], y)[None], (s.cfg.model.mtp_depth, 1))
        return zeros(plan, (), jnp.float32, (*s.data_axes, STAGE)), g, zeros_like_varying(y), top

    loss, g_shared, dy, mtp_top = jax.lax.cond(last, head, no_head, g_shared)
    maxima = {}
    if s.clipping:  # kind -> [layers of the chunk's stack, N]; "mtp" -> [depths, N]
        maxima = {**tops, **({"mtp": mtp_top} if mtp_top is not None else {})}
    end = (*embed_saved, dy)
    if stash is None:
        rec.end_avals = [jax.typeof(r) for r in end]
        rec.maxima = {key: jax.typeof(a) for key, a in maxima.items()}
        return y, None, g_shared, loss, maxima
    end = tuple(set_row(b, vary(r, varying_axes(b)).reshape(-1), slot) for b, r in zip(stash["ends"], end))
    return y, {"ends": end, "layers": layers}, g_shared, loss, maxima


# -- B or I -------------------------------------------------------------------------------------


def backward(plan, st, stash, slot, cot, k, g_shared):
    """B, or I with a split table: the chunk's gradients from what F saved (no second forward),
    one layer at a time, last to first, each layer's residuals read from row (slot, layer) of the
    stash. Returns (parameter gradients but the tapped weights', [n, ...] per path; `g_shared`
    plus the embedding's on the first chunk; the input's; the taps', (x, g) [n, ...] per tapped
    path). (I writes its pairs for W into the slot after this loop, `stash.write_now`: written
    inside it, over the rows the loop reads, they made XLA copy every stash buffer per layer,
    measured.)"""
    g, embed_saved = _b_start(plan, st, stash, slot, cot, k)
    dx, outs = scan_layers(plan.setup.chunk_cfg, layer_indices(plan), g, _b_layer(plan, st, k, stash, slot),
                           reverse=True)
    return _b_end(plan, st, k, dx, outs, embed_saved, g_shared)


def _b_start(plan, st, stash, slot, cot, k):
    """B's start: the chunk output's cotangent (the head's, stashed by F, on the last chunk; else
    the one received) and the embedding's residuals, from the slot."""
    _, last = ends(plan, st, k)
    *embed_saved, dy = (get_row(b, slot).reshape(a.shape) for b, a in zip(stash["ends"], plan.end_avals))
    return jnp.where(last, dy, cot), embed_saved


def _b_layer(plan, st, k, stash, slot):
    """B's layer function for `scan_layers`: (kind, _, _, i, cotangent) -> (the input's cotangent,
    (parameter gradients, the taps')) of chunk k's layer i, its residuals read from row (slot, i)."""
    def layer(kind, _, __, i, g):
        full_l, diff_l = layer_params(plan, st, k, kind, i)
        saved = [jax.lax.dynamic_slice(b, (slot, i, 0), (1, 1, b.shape[2])).reshape(a.shape)
                 for b, a in zip(stash["layers"][kind], plan.layer_avals[kind])]
        d_rest, dx, d_tap = pullback(plan, kind, saved, param_leaves(full_l, diff_l))(g)
        return dx, (d_rest, d_tap)
    return layer


def _b_end(plan, st, k, dx, outs, embed_saved, g_shared):
    """B's end: its layers' outputs per path, and the embedding's gradient on the first chunk (a
    cond: the others skip its pullback and fill no vocabulary-sized zeros)."""
    first, _ = ends(plan, st, k)
    d_rest = {p_: g for kind in plan.kinds for p_, g in outs[kind][0].items()}
    d_taps = {p_: xg for kind in plan.kinds for p_, xg in (outs[kind][1] or {}).items()}
    sh = diff_shared(plan, st)
    g_shared = jax.lax.cond(first, lambda g: microbatches.add_f32(
        g, pullback(plan, "embed", embed_saved, param_leaves(st.shared, sh))(dx)[0]), lambda g: g, g_shared)
    return d_rest, g_shared, dx, d_taps


# -- F and B in one loop (DualPipeV's F&B ticks) --------------------------------------------------


def positions(plan) -> list:
    """The chunk's layers in F's order, (kind, index in its stack): `transformer.scan_layers`' order,
    the chunk model's (`transformer.layer_order`: a mixed chunk's dense first layers, then groups of
    N - 1 dense layers and one MoE layer)."""
    order = layer_order(plan.setup.chunk_cfg)
    at = {int(layer): (kind, j) for kind in plan.kinds for j, layer in enumerate(order[kind])}
    return [at[i] for i in range(len(at))]


def pair_runs(kinds: list, prefix: int, period: int) -> list:
    """The F&B loop's steps as runs that each compile to one loop, for a chunk whose layers in F's
    order (`positions`) are of `kinds`: the first `prefix` the dense first layers (`first_dense:K`),
    the rest repeating every `period` (one kind: 1; an MoE layer every N: N). A run is its
    repetitions, each the steps of one period, each step (F's layer, B's layer), a layer as (kind,
    index in its stack) or None; its steps' kinds are the same in every repetition (the loop's
    body fixes them). F's dense first layers run alone first and B's alone last (no all-to-all to
    hide, and inactive layer slots on every chunk but the model's first); between them F's layer
    `prefix + i` runs beside B's layer n-1-i, so each of F's and B's MoE layers runs beside a
    layer of the other's (every:N: F's group of N - 1 dense layers and its MoE layer beside B's
    group in reverse, the two MoE layers at the group's ends). At most three runs, whatever the
    depth."""
    n = len(kinds)
    at = [(kind, kinds[:i].count(kind)) for i, kind in enumerate(kinds)]
    mid = [(at[prefix + i], at[n - 1 - i]) for i in range(n - prefix)]
    runs = [[[(at[j], None)] for j in range(prefix)],
            [mid[r * period:(r + 1) * period] for r in range(len(mid) // period)],
            [[(None, at[prefix - 1 - j])] for j in range(prefix)]]
    runs = [run for run in runs if run]
    for run in runs:
        key = lambda rep: [(f and f[0], b and b[0]) for f, b in rep]  # noqa: E731  (a kind, or None)
        if any(key(rep) != key(run[0]) for rep in run):
            raise AssertionError(f"the layers {kinds} do not repeat every {period} after the first {prefix}")
    return runs


def pair(plan, st, x_in, mb, k_f, own, g_head, stash, slot, cot, k_b, g_shared):
    """DualPipeV's F&B tick as one loop over the layers: step i runs F's layer i (microbatch mb,
    chunk k_f, its residuals into row (0, ·) of `own`, a stash of one slot) beside B's layer
    n-1-i (another microbatch, chunk k_b, from stash slot `slot`); a chunk with dense first
    layers pairs the layers after them (`pair_runs`). The two have no data
    dependency on each other inside a step, so XLA's scheduler may run one's collectives (the
    expert all-to-alls, the tensor-parallel collectives) behind the other's computation: two
    loops, as `forward` then `backward` run them, cannot overlap (a loop is one while, and XLA
    runs whiles one after the other). A mixed chunk's dense first layers run alone, F's before
    the loop and B's after it, and its steps repeat a period of kind pairs (`pair_runs`), the
    loop's body running one period with the kinds fixed and the layers' indices in their stacks
    as its inputs. F's embedding, and B's start, before the loop; F's head and B's embedding
    gradient after it. Returns F's (y, own, g_head, loss, maxima) and B's (d_rest, g_shared, dx,
    d_taps), as `forward` and `backward` do."""
    s = plan.setup
    cfg = s.chunk_cfg
    prefix, period = cfg.moe_pattern if cfg.mixed else (0, 1)
    runs = pair_runs([kind for kind, _ in positions(plan)], prefix, period)
    tokens, targets, depths = microbatch(s, st, mb)
    at = lambda t, j: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False), t)  # noqa: E731
    with sequence_layout(_layout_of(s, tokens)):
        x, embed_f, sh = _embed(plan, st, x_in, tokens, k_f, None)
        g, embed_b = _b_start(plan, st, stash, slot, cot, k_b)
        with _split(plan):
            f_layer, b_layer = _f_layer(plan, st, k_f, 0, None), _b_layer(plan, st, k_b, stash, slot)
            taps = kind_taps(plan) if s.table.split else None
            carry = ((x, own["layers"]), g)
            # kind -> [(what the steps of that kind gave, [R], their layers' indices in the stack [R])]
            tops, outs = {kind: [] for kind in plan.kinds}, {kind: [] for kind in plan.kinds}
            for run in runs:
                steps = [(f[0] if f else None, b[0] if b else None) for f, b in run[0]]  # (the body's kinds)
                # Each step's layer indices, per repetition r: first + r * stride (F's up its stacks,
                # B's down), as functions of the loop counter, which XLA's loop analyses read.
                jf, jb = ([[f[1] if f else 0 for f in side] for side in zip(*[[x[w] for x in rep] for rep in run])]
                          for w in (0, 1))
                lines = [_affine(js) for js in (*jf, *jb)]

                def body(carry, r, steps=steps, lines=lines):
                    f_carry, g = carry
                    got = []
                    for q, (kf, kb) in enumerate(steps):
                        top = out = None
                        if kf is not None:
                            j = lines[q][0] + r * lines[q][1]
                            with jax.named_scope("pair_f"):  # (op names that say which action, in profiles and tests)
                                f_carry, top = f_layer(kf, None, None if taps is None else at(taps[kf], j), j, f_carry)
                        if kb is not None:
                            j = lines[len(steps) + q][0] + r * lines[len(steps) + q][1]
                            with jax.named_scope("pair_b"):
                                g, out = b_layer(kb, None, None, j, g)
                        got.append((top, out))
                    return (f_carry, g), got

                carry, got = jax.lax.scan(body, carry, jnp.arange(len(run)))
                for q, ((kf, kb), (top, out)) in enumerate(zip(steps, got)):
                    if kf is not None:
                        tops[kf].append((top, np.asarray(jf[q])))
                    if kb is not None:
                        outs[kb].append((out, np.asarray(jb[q])))
        ((y, layers), dx) = carry
        f = _head(plan, st, k_f, y, targets, depths, sh, embed_f, layers,
                  {kind: _in_stack_order(t) for kind, t in tops.items()}, own, 0, g_head, None)
    b = _b_end(plan, st, k_b, dx, {kind: _in_stack_order(o) for kind, o in outs.items()}, embed_b, g_shared)
    return f, b


def _affine(js: list) -> tuple[int, int]:
    """(first, stride) of a step's layer indices over a run's repetitions (`pair_runs`' are)."""
    first, stride = js[0], (js[1] - js[0] if len(js) > 1 else 0)
    if list(js) != [first + r * stride for r in range(len(js))]:
        raise AssertionError(f"the layer indices {js} are not evenly spaced")
    return first, stride


def _in_stack_order(parts: list):
    """One stack's per-layer outputs from the F&B loop's runs ((outputs [R, ...], their layers'
    indices in the stack [R]) per run and step of the period), in stack order: concatenated, then
    permuted where they came in another order (B's came last layer first)."""
    if not parts or parts[0][0] is None:
        return None
    where = np.concatenate([j for _, j in parts])
    out = jax.tree.map(lambda *a: jnp.concatenate(a), *[o for o, _ in parts])
    if (where == np.arange(len(where))).all():
        return out
    if (where == np.arange(len(where))[::-1]).all():
        return jax.tree.map(lambda a: jnp.flip(a, 0), out)
    return jax.tree.map(lambda a: a[np.argsort(where)], out)


# -- W ------------------------------------------------------------------------------------------


def stashed_input(plan, stash, slot, path):
    """W's input x of a tapped matmul, [layers, tokens, in], read from the leaf F stashed it in, in `slot`."""
    kind, j = plan.x_source[path]
    buf = stash["layers"][kind][j]
    xs, _, _, _, axes, _ = plan.taps[path]
    x = jax.lax.dynamic_slice(buf, (slot, 0, 0), (1, *buf.shape[1:])).reshape(buf.shape[1], *xs)
    return vary(x, axes)


def weight_grads(plan, d_taps):
    """W: each tapped weight's gradient x^T g, reduce-scattered where ZeRO reduces per microbatch
    (float32, as the reduction at use would)."""
    s = plan.setup
    out = {}
    for k_, (x2, g2) in d_taps.items():
        dw = weight_gradient(x2, g2).reshape(plan.chunk_layers[k_], *plan.taps[k_][5]).astype(jnp.float32)
        # A weight the matmul made varying (e.g. kv heads replicated over `model` under tensor
        # parallelism): summed over those axes, as the cast's transpose would.
        extra = tuple(a for a in varying_axes(dw) if a not in plan.acc_axes[k_])
        if extra:
            dw = jax.lax.psum(dw, extra)
        # A sharded weight's gradient where the reduction rule reduces it at use (per microbatch).
        rule = s.reduction.gradient(plan.dim_of[k_] >= 0 and (s.gather == "use" or plan.block_mask_flat[k_]))
        if rule is not None and rule.when == "use":
            dw = jax.lax.psum_scatter(dw, DATA, scatter_dimension=plan.dim_of[k_], tiled=True)
        out[k_] = dw
    return out


def accumulate(acc, grads, k):
    """`acc[path][k] += grads[path]` in float32, for chunk k's row of each accumulator ([v, layers
    per chunk, ...]; `grads[path]`: [layers per chunk, ...]); an FP8 amax history's
    (`fp8.is_history`) takes the maximum, as `microbatches.add_f32` does.

    A dynamic-update-slice of a part of the accumulator, reading only that part, so that XLA
    updates it in place: the chunk's row where the stage has several chunks, else one per layer's
    row. Not `.at[k].add` (XLA lowers that scatter to a select over the whole row, reading it
    twice), and not the chunk's row with one chunk a stage: that covers the whole accumulator, XLA
    made it a plain add into a new buffer, and W's cond copied that into its output, every
    accumulator W adds to on every W (measured: `1f1b`, `zb_h1`). (With one chunk of one layer a
    stage the row is still the whole buffer.)"""
    def add(k_, a, g):
        return jnp.maximum(a, g.astype(jnp.float32)) if fp8.is_history(k_) else a + g.astype(jnp.float32)

    def rows(a, k_, g):
        if a.shape[0] > 1 or g.shape[0] == 1:
            return set_row(a, add(k_, get_row(a, k), g), k)
        for j in range(g.shape[0]):
            start = (k, j) + (0,) * (a.ndim - 2)
            row = jax.lax.dynamic_slice(a, start, (1, 1, *a.shape[2:]))
            a = jax.lax.dynamic_update_slice(a, add(k_, row, g[j][None, None]), start)
        return a
    with jax.named_scope("accumulate"):  # (op names that say what reads an accumulator's row: profiles, tests)
        return {**acc, **{k_: rows(acc[k_], k_, g) for k_, g in grads.items()}}
