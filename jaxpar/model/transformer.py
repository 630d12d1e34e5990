"""The decoder-only transformer (llama / gpt2) with stacked, scanned blocks, and its functional API.

Block parameters carry a leading `layers` dim and the forward pass is one `lax.scan` over it,
so compile time does not grow with depth. Training code sees parameters as a plain nested
dict of arrays (`init_params`, `apply`), with a matching tree of logical names (`param_names`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.blocks import block_class, stacked
from jaxpar.model import fp8, qk_clip
from jaxpar.model.mtp import MTP
from jaxpar.model.layers import Sequence, active_split, linear, norm, param, sequence, sequence_layout
from jaxpar.sharding import ATTN_TAG, DOT_TAG, constrain, embed_lookup, enter_tp, local_seq, params_never_saved, use_params

Params = dict[str, Any]

REMAT_POLICIES = {
    # Save everything but the parameters handed out by `use_params` (under ZeRO-3, gathered
    # copies): no recomputation, and no layer's gathered weights held from forward to backward.
    "none": params_never_saved(jax.checkpoint_policies.everything_saveable),
    "full": params_never_saved(None),  # save nothing inside a block; recompute it in the backward pass
    # Save the outputs of weight matmuls (no batch dims); recompute the cheap elementwise work
    # and the attention scores.
    # (`linear`'s matmuls are named DOT_TAG: on CPU a custom_vjp hides their dot from the policy.)
    "dots": params_never_saved(jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, jax.checkpoint_policies.save_only_these_names(DOT_TAG))),
    # Save the attention projections (q, k, v as projected; the output projection after its
    # reduction over `model`), recompute the MLP and the attention core: MaxText's
    # `save_dot_except_mlp`. The MLP's [seq, d_ff] matmul outputs are most of what `dots` holds.
    "dots_except_mlp": params_never_saved(jax.checkpoint_policies.save_only_these_names(ATTN_TAG)),
    # What `dots` saves, offloaded to host memory (`pinned_host`) in the forward pass and copied
    # back for the backward; nothing else saved. (On XLA:CPU, where device memory is host memory,
    # JAX lowers the copies to nothing: it runs as `dots` through the names.)
    "offload": params_never_saved(jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[DOT_TAG],
        offload_src="device", offload_dst="pinned_host")),
}


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # Rows padded to a multiple of vocab_multiple: the padding is part of the config, not of
        # the mesh, so every mesh holds the same parameters; the loss never predicts padded ids.
        D, V, pd, std = cfg.d_model, cfg.padded_vocab, cfg.param_dtype, cfg.init_std
        self.embed = param(rngs, (V, D), ("vocab", "embed"), pd, std)
        if cfg.arch == "gpt2":
            self.pos_embed = param(rngs, (cfg.seq_len, D), ("pos", "embed"), pd, std / 2)

        # One stack of blocks; an MoE model with dense layers too (`model.moe_layers`) has two,
        # each in layer order: {"dense", "moe"} (`MixedBlocks`).
        self.blocks = MixedBlocks(cfg, rngs=rngs) if cfg.mixed else stacked(block_class(cfg), cfg, cfg.n_layers, rngs)
        self.final_norm = norm(cfg)
        if not cfg.tied:  # else the output projection is the embedding (gpt2; tied llamas)
            self.lm_head = param(rngs, (D, V), ("embed", "vocab"), pd, std)
        if cfg.mtp_depth:  # multi-token prediction's modules (training only: `jaxpar.model.mtp`)
            self.mtp = MTP(cfg, rngs=rngs)

    def __call__(self, tokens_BxT: jax.Array, *, remat: str = "none", layout: Sequence | None = None) -> jax.Array:
        """Next-token logits [B, T, V] in float32 for int tokens [B, T] (V: the padded vocabulary),
        laid out as `layout` says (`layers.Sequence`: packed documents, a context-parallel shard)."""
        with sequence_layout(layout):
            return self.head(self.backbone(self.embed_tokens(tokens_BxT), remat=remat))

    def embed_tokens(self, tokens_BxT: jax.Array) -> jax.Array:
        """Token (and, for gpt2, position) embeddings [B, T, D] in the compute dtype."""
        cfg = self.cfg
        x_BxTxD = embed_lookup(self.embed[...].astype(cfg.dtype), token_ids(tokens_BxT))
        if cfg.arch == "gpt2" and (layout := sequence()) is not None:  # positions of their own
            x_BxTxD = x_BxTxD + local_seq(self.pos_embed[...].astype(cfg.dtype)[layout.positions], axis=1)
        elif cfg.arch == "gpt2":
            x_BxTxD = x_BxTxD + local_seq(self.pos_embed[:tokens_BxT.shape[1]].astype(cfg.dtype))[None]
        return constrain(x_BxTxD, ("batch", "sp_seq", "embed"))

    def backbone(self, x_BxTxD: jax.Array, *, remat: str = "none", active: dict[str, jax.Array] | None = None
                 ) -> jax.Array:
        """All blocks, scanned over `layers` (with `active`, only the active ones: the rest pass x
        through, e.g. the padding slots of a pipeline chunk, `jaxpar.parallel.stages`)."""
        return run_blocks(self.cfg, self.blocks, x_BxTxD, remat, active)

    def head(self, x_BxTxD: jax.Array) -> jax.Array:
        """Final norm and output projection: logits [B, T, V] in float32 (this rank's slice of the
        vocabulary under tensor parallelism)."""
        return self.project(self.final_norm(x_BxTxD))

    def project(self, x_BxTxD: jax.Array) -> jax.Array:
        """The output projection of normed states: logits [B, T, V] in float32 (the main head's and
        every MTP depth's)."""
        cfg = self.cfg
        x_BxTxD = enter_tp(x_BxTxD)
        w_DxV = self.embed[...].T if cfg.tied else self.lm_head[...]
        # Logits accumulate and come out in float32: the softmax of the loss needs the precision.
        # (In float32, `linear`: on XLA:CPU its weight gradient is one [D, B·T] x [B·T, V] matmul,
        # where the einsum's, contracting two dims, ran as an Eigen dot after a transposed copy of
        # the logits' cotangent: 42 against 10 ms a step on the torch benchmark's one-device step.)
        if cfg.dtype == "float32":
            logits_BxTxV = linear(x_BxTxD, w_DxV.astype(cfg.dtype))
        else:
            logits_BxTxV = jnp.einsum("btd,dv->btv", x_BxTxD, w_DxV.astype(cfg.dtype),
                                      preferred_element_type=jnp.float32)
        return constrain(logits_BxTxV, ("batch", "seq", "vocab"))


def token_ids(tokens_BxT: jax.Array) -> jax.Array:
    """The ids of a batch's tokens: a token the loss does not learn arrives as ~id (chat data's
    context, `jaxpar.train.data.with_mask`) and is read as id."""
    return jnp.maximum(tokens_BxT, ~tokens_BxT)


def dense_config(cfg: ModelConfig) -> ModelConfig:
    """The config of a mixed model's dense layers (a dense MLP of width d_ff)."""
    return dataclasses.replace(cfg, n_experts=0, moe_layers="all")


class MixedBlocks(nnx.Module):
    """The blocks of an MoE model with dense layers (`model.moe_layers`): the dense layers' blocks
    stacked in layer order (`dense`), the MoE layers' likewise (`moe`). Each stack is uniform, so
    each is scanned, stored over `stage` and ZeRO-sharded like a whole model's stack; the layer
    order interleaves them (`scan_layers`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        block = block_class(cfg)
        self.dense = stacked(block, dense_config(cfg), cfg.n_layers - cfg.n_moe_layers, rngs)
        self.moe = stacked(block, cfg, cfg.n_moe_layers, rngs)


def block_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The stacks of `blocks`: ("dense", "moe") for a mixed model, else one ("": `blocks` itself)."""
    return ("dense", "moe") if cfg.mixed else ("",)


def stack(tree: Any, kind: str) -> Any:
    """A stack's subtree of a `blocks` tree (params, names, gradients, ...) or module."""
    if not kind:
        return tree
    return getattr(tree, kind) if isinstance(tree, nnx.Module) else tree[kind]


def scan_layers(cfg: ModelConfig, stacks: dict[str, Any], x: Any, layer_fn: Callable, extras: dict[str, Any] | None = None,
                reverse: bool = False) -> tuple[Any, dict[str, Any]]:
    """Run `x` through every layer in order: `layer_fn(kind, layer_params, layer_extra, i, x) ->
    (x, out)` with each stack's layers (`stacks`: kind -> tree stacked [n, ...], kinds as
    `block_kinds`; i: the index in its stack) and a per-layer extra stacked alike (or None).
    Returns x and kind -> the outs stacked alike. One scan per stack; a mixed model scans its
    dense first layers, then groups of N - 1 dense layers and one MoE layer (a scan over groups
    of a scan over the group's dense layers), so compile time does not grow with depth. With
    `reverse`, the layers run last to first (a backward pass over them, e.g. the pipeline's B);
    the outs stay in layer order."""
    extras = extras if extras is not None else {k: None for k in stacks}

    def run(kind, params, extra, idx, x):
        return jax.lax.scan(lambda x, a: layer_fn(kind, a[0], a[1], a[2], x), x, (params, extra, idx), reverse=reverse)

    if not cfg.mixed:
        n = jax.tree.leaves(stacks[""])[0].shape[0]
        x, out = run("", stacks[""], extras[""], jnp.arange(n), x)
        return x, {"": out}
    K, N = cfg.moe_pattern
    U = cfg.n_moe_layers
    first = lambda t: jax.tree.map(lambda a: a[:K], t)  # noqa: E731
    groups = lambda t: jax.tree.map(lambda a: a[K:].reshape(U, N - 1, *a.shape[1:]), t)  # noqa: E731
    outs_first = None

    def dense_first(x):
        return run("dense", first(stacks["dense"]), first(extras["dense"]), jnp.arange(K), x)

    if K and not reverse:
        x, outs_first = dense_first(x)
    if N == 1:
        x, outs_moe = run("moe", stacks["moe"], extras["moe"], jnp.arange(U), x)
        if K and reverse:
            x, outs_first = dense_first(x)
        return x, {"dense": outs_first, "moe": outs_moe}

    def group(x, a):
        dense, dense_extra, moe, moe_extra, u = a
        idx = K + u * (N - 1) + jnp.arange(N - 1)
        if reverse:
            x, out_moe = layer_fn("moe", moe, moe_extra, u, x)
            x, outs_dense = run("dense", dense, dense_extra, idx, x)
        else:
            x, outs_dense = run("dense", dense, dense_extra, idx, x)
            x, out_moe = layer_fn("moe", moe, moe_extra, u, x)
        return x, (outs_dense, out_moe)

    x, (outs_dense, outs_moe) = jax.lax.scan(group, x, (groups(stacks["dense"]), groups(extras["dense"]), stacks["moe"],
                                                       extras["moe"], jnp.arange(U)), reverse=reverse)
    if K and reverse:
        x, outs_first = dense_first(x)
    outs_dense = jax.tree.map(lambda a: a.reshape(U * (N - 1), *a.shape[2:]), outs_dense)
    if K:
        outs_dense = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outs_first, outs_dense)
    return x, {"dense": outs_dense, "moe": outs_moe}


def layer_order(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """kind -> the model's layer index of each entry of that stack."""
    if not cfg.mixed:
        return {"": np.arange(cfg.n_layers)}
    moe = np.array([cfg.is_moe_layer(i) for i in range(cfg.n_layers)])
    return {"dense": np.flatnonzero(~moe), "moe": np.flatnonzero(moe)}


def run_blocks(cfg: ModelConfig, blocks: nnx.Module, x_BxTxD: jax.Array, remat: str,
               active: dict[str, jax.Array] | None = None) -> jax.Array:
    """Scan `x` through the stacked `blocks` (params with a leading `layers` dim; two stacks for a
    mixed model). With `active` (kind -> bool per layer of that stack: a pipeline chunk's slots,
    `jaxpar.parallel.stages`), an inactive layer is skipped (a `lax.cond`: no compute) and leaves
    x unchanged."""
    split = active_split()  # the pipeline's split backward: each layer's matmul taps are scanned too
    taps = split.taps if split is not None else None
    params, bodies = block_bodies(cfg, blocks, remat, active)
    layer_taps = {kind: None if taps is None else {k: v for k, v in taps.items() if k.startswith(stack_prefix(kind))}
                  for kind in params}
    x_BxTxD, outs = scan_layers(cfg, params, x_BxTxD, lambda kind, p, tap, i, x: bodies[kind](x, (p, tap, i)),
                                layer_taps)
    if qk_clip.active():  # (train.qk_clip: each body returns its layer's per-head maximum logit too)
        qk_clip.put(qk_clip.stacked_maxima({kind: out[qk_clip.KEY] for kind, out in outs.items()}, layer_order(cfg)))
    return x_BxTxD


def stack_prefix(kind: str) -> str:
    """A stack's prefix of its leaves' paths in `blocks` (the split backward's taps are keyed so)."""
    return f"['{kind}']" if kind else ""


def block_bodies(cfg: ModelConfig, blocks: nnx.Module, remat: str, active: dict[str, jax.Array] | None = None
                 ) -> tuple[dict[str, Any], dict[str, Callable]]:
    """kind -> the stack's parameters (a pure dict, stacked [n, ...]) and kind -> its layer,
    `body(x, (layer_params, tap, i)) -> (x, aux)` under the remat policy: one layer's parameters
    (a pure dict, as `use_params` hands them out), its split-backward taps (or None) and its index
    in the stack. `aux` holds what the layer reports beside its output: with the split backward's
    `stash_inputs`, "inputs" (each tapped matmul's input, by path); under `qk_clip.recording()`,
    `qk_clip.KEY` (the layer's per-head largest attention logit [N]; an inactive slot's -inf).
    `run_blocks` scans them; the pipeline differentiates them one layer at a time."""
    split = active_split()
    names = _block_names(cfg)
    bodies, params = {}, {}
    recording = qk_clip.active()
    for kind in block_kinds(cfg):
        graphdef, state = nnx.split(stack(blocks, kind))
        template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state)
        params[kind] = nnx.to_pure_dict(state)

        def body(x, inputs, graphdef=graphdef, template=template, kind_names=stack(names, kind), prefix=stack_prefix(kind),
                 kind=kind):
            layer_params, tap, i = inputs
            # This layer's parameters enter here: under data parallelism their gradients are
            # reduced at this point of the backward pass, one layer at a time, overlapping the next.
            layer_state = jax.tree.map(lambda v: v, template)
            handed = use_params(layer_params, kind_names)
            nnx.replace_by_pure_dict(layer_state, handed)
            if split is not None:  # `linear` finds its tap by the identity of the parameter it is handed
                split.paths = {id(v): prefix + jax.tree_util.keystr(k)
                               for k, v in jax.tree_util.tree_leaves_with_path(handed)}
                split.layer_taps = tap
            layer = nnx.merge(graphdef, layer_state)
            stash_inputs = split is not None and split.stash_inputs
            if stash_inputs:  # each tapped matmul's input, from inside the remat
                if active is not None:
                    raise AssertionError("split backward: stash_inputs needs every layer slot active")
                split.inputs = {}

            def run(x):
                if not recording:
                    return layer(x), {}
                with qk_clip.layer() as maxima:  # (train.qk_clip) the layer's per-head maximum logit
                    y = layer(x)
                return y, {qk_clip.KEY: maxima[0]}

            if active is None:
                y, aux = run(x)
            else:  # an inactive slot: x unchanged, no logit (-inf)
                skip = {qk_clip.KEY: qk_clip.none(handed, x)} if recording else {}
                y, aux = jax.lax.cond(active[kind][i], run, lambda x: (x, skip), x)
            return y, {**aux, "inputs": dict(split.inputs)} if stash_inputs else aux

        bodies[kind] = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return params, bodies


def _block_names(cfg: ModelConfig) -> Any:
    """Logical names of one layer's parameters (the stacked names without `layers`)."""
    return jax.tree.map(lambda n: n[1:], param_names(cfg)["blocks"], is_leaf=lambda x: isinstance(x, tuple))


# --------------------------------------------------------------------------------------------
# Functional API over plain parameter dicts


# Unbounded: the pipeline builds its chunk model's abstract state before tracing (inside a
# shard_map's abstract mesh nnx.eval_shape cannot place the `layers` spec); an evicted entry
# would be rebuilt there and fail (seen once a suite had compiled more than 32 model configs).
# Each entry is a few ShapeDtypeStructs.
@functools.lru_cache(maxsize=None)
def _abstract(cfg: ModelConfig):
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Fresh parameters as a nested dict of arrays; depends only on (cfg, key), never on the mesh."""
    return nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=key))))


def param_shapes(cfg: ModelConfig) -> Params:
    """The parameter tree as ShapeDtypeStructs (no allocation)."""
    return nnx.to_pure_dict(_abstract(cfg)[1])


@functools.lru_cache(maxsize=None)
def param_names(cfg: ModelConfig) -> Params:
    """The parameter tree with a tuple of logical dim names at each leaf, e.g. ("layers", "embed", "mlp")."""
    specs = nnx.get_partition_spec(_abstract(cfg)[1])
    return nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_value()), specs,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


def bind(cfg: ModelConfig, params: Params) -> Transformer:
    """The Transformer module holding `params` (arrays or tracers), for calling its parts."""
    graphdef, state = _abstract(cfg)
    state = jax.tree.map(lambda x: x, state)  # a fresh copy: the cached abstract state stays untouched
    # Block parameters are marked layer by layer inside the scan (`run_blocks`), the rest here.
    names = param_names(cfg)
    # (One call, so that on simulated devices their ZeRO-3 gathers run one after another.)
    rest = use_params({k: v for k, v in params.items() if k != "blocks"}, {k: names[k] for k in params if k != "blocks"})
    params = {k: params[k] if k == "blocks" else rest[k] for k in params}
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def apply(cfg: ModelConfig, params: Params, tokens_BxT: jax.Array, *, remat: str = "none",
          layout: Sequence | None = None) -> jax.Array:
    """Logits [B, T, V] (float32) of the model with `params` on `tokens_BxT`, laid out as `layout`
    says (packed documents: `layers.packed(layers.document_segments(tokens, eos))`)."""
    return bind(cfg, params)(tokens_BxT, remat=remat, layout=layout)


def count_params(cfg: ModelConfig, *, embeddings: bool = True, active: bool = False) -> int:
    """Parameter count Ψ (optionally without the token / position embeddings, for FLOP counts;
    with `active`, an MoE model's parameters that one token uses: its k routed experts of each
    layer, not all of them, and not the routers' bias and report, which no token multiplies; the
    multi-token prediction modules are counted, as the work of a training step). The FP8 amax
    histories are not counted."""
    shapes = param_shapes(cfg)
    # (The blocks' FP8 amax histories, `model.fp8_scaling: delayed`, are state, not weights.)
    total = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(shapes) if not fp8.is_history(p))
    if not embeddings:
        total -= shapes["embed"].size + (shapes["pos_embed"].size if "pos_embed" in shapes else 0)
    if active and cfg.mtp_depth:  # the MTP report leaf, which no token multiplies
        total -= shapes["mtp"]["report"].size
    if active and cfg.moe:
        idle = (cfg.n_experts - cfg.experts_per_token) / cfg.n_experts
        stacks = [stack(shapes["blocks"], "moe" if cfg.mixed else "")] + ([shapes["mtp"]["blocks"]] if cfg.mtp_depth else [])
        for mlp in (b["mlp"] for b in stacks):
            total -= round(sum(mlp[k].size for k in ("w_gate", "w_up", "w_down")) * idle)
            total -= sum(mlp[k].size for k in ("router_stats", "router_bias") if k in mlp)
    return total
