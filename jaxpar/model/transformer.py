"""The decoder-only transformer (llama / gpt2) with stacked, scanned blocks, and its functional API.

Block parameters carry a leading `layers` dim and the forward pass is one `lax.scan` over it,
so compile time does not grow with depth. Training code sees parameters as a plain nested
dict of arrays (`init_params`, `apply`), with a matching tree of logical names (`param_names`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.layers import Block, active_split, block_class, norm, param
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

        block = block_class(cfg)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs: nnx.Rngs) -> nnx.Module:
            return block(cfg, rngs=rngs)

        self.blocks = stacked_blocks(rngs)
        self.final_norm = norm(cfg)
        if not cfg.tied:  # else the output projection is the embedding (gpt2; tied llamas)
            self.lm_head = param(rngs, (D, V), ("embed", "vocab"), pd, std)

    def __call__(self, tokens_BxT: jax.Array, *, remat: str = "none") -> jax.Array:
        """Next-token logits [B, T, V] in float32 for int tokens [B, T] (V: the padded vocabulary)."""
        return self.head(self.backbone(self.embed_tokens(tokens_BxT), remat=remat))

    def embed_tokens(self, tokens_BxT: jax.Array) -> jax.Array:
        """Token (and, for gpt2, position) embeddings [B, T, D] in the compute dtype."""
        cfg = self.cfg
        x_BxTxD = embed_lookup(self.embed[...].astype(cfg.dtype), token_ids(tokens_BxT))
        if cfg.arch == "gpt2":
            x_BxTxD = x_BxTxD + local_seq(self.pos_embed[:tokens_BxT.shape[1]].astype(cfg.dtype))[None]
        return constrain(x_BxTxD, ("batch", "sp_seq", "embed"))

    def backbone(self, x_BxTxD: jax.Array, *, remat: str = "none", n_active: jax.Array | None = None) -> jax.Array:
        """All blocks, scanned over `layers` (only the first `n_active` of them, when given: the
        rest pass x through, e.g. padding layers of a pipeline stage that holds fewer layers)."""
        cfg = self.cfg
        return run_blocks(self.blocks, x_BxTxD, remat, _block_names(cfg), n_active)

    def head(self, x_BxTxD: jax.Array) -> jax.Array:
        """Final norm and output projection: logits [B, T, V] in float32 (this rank's slice of the
        vocabulary under tensor parallelism)."""
        cfg = self.cfg
        x_BxTxD = enter_tp(self.final_norm(x_BxTxD))
        w_DxV = self.embed[...].T if cfg.tied else self.lm_head[...]
        # Logits accumulate and come out in float32: the softmax of the loss needs the precision.
        logits_BxTxV = jnp.einsum("btd,dv->btv", x_BxTxD, w_DxV.astype(cfg.dtype),
                                  preferred_element_type=jnp.float32)
        return constrain(logits_BxTxV, ("batch", "seq", "vocab"))


def token_ids(tokens_BxT: jax.Array) -> jax.Array:
    """The ids of a batch's tokens: a token the loss does not learn arrives as ~id (chat data's
    context, `jaxpar.train.data.with_mask`) and is read as id."""
    return jnp.maximum(tokens_BxT, ~tokens_BxT)


def run_blocks(blocks: Block, x_BxTxD: jax.Array, remat: str, names: Any, n_active: jax.Array | None = None
               ) -> jax.Array:
    """Scan `x` through stacked `blocks` (params with a leading `layers` dim, one layer's dims named
    by `names`); layers at index >= `n_active` (if given) leave x unchanged."""
    graphdef, state = nnx.split(blocks)
    template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state)
    n_layers = jax.tree.leaves(state)[0].shape[0]

    split = active_split()  # the pipeline's split backward: each layer's matmul taps are scanned too
    taps = split.taps if split is not None else None

    def body(x, inputs):
        layer_params, i, layer_taps = inputs
        # This layer's parameters enter here: under data parallelism their gradients are reduced
        # at this point of the backward pass, one layer at a time, overlapping the next layer.
        layer_state = jax.tree.map(lambda v: v, template)
        handed = use_params(layer_params, names)
        nnx.replace_by_pure_dict(layer_state, handed)
        if split is not None:  # `linear` finds its tap by the identity of the parameter it is handed
            split.paths = {id(v): jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(handed)}
            split.layer_taps = layer_taps
        y = nnx.merge(graphdef, layer_state)(x)
        return (y if n_active is None else jnp.where(i < n_active, y, x)), None

    body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    x_BxTxD, _ = jax.lax.scan(body, x_BxTxD, (nnx.to_pure_dict(state), jnp.arange(n_layers), taps))
    return x_BxTxD


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
    params = {k: v if k == "blocks" else use_params(v, names[k]) for k, v in params.items()}
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def apply(cfg: ModelConfig, params: Params, tokens_BxT: jax.Array, *, remat: str = "none") -> jax.Array:
    """Logits [B, T, V] (float32) of the model with `params` on `tokens_BxT`."""
    return bind(cfg, params)(tokens_BxT, remat=remat)


def count_params(cfg: ModelConfig, *, embeddings: bool = True, active: bool = False) -> int:
    """Parameter count Ψ (optionally without the token / position embeddings, for FLOP counts;
    with `active`, an MoE model's parameters that one token uses: its k routed experts of each
    layer, not all of them, and not the routers' bias and report, which no token multiplies)."""
    shapes = param_shapes(cfg)
    total = sum(x.size for x in jax.tree.leaves(shapes))
    if not embeddings:
        total -= shapes["embed"].size + (shapes["pos_embed"].size if "pos_embed" in shapes else 0)
    if active and cfg.moe:
        mlp = shapes["blocks"]["mlp"]
        idle = (cfg.n_experts - cfg.experts_per_token) / cfg.n_experts
        total -= round(sum(mlp[k].size for k in ("w_gate", "w_up", "w_down")) * idle)
        total -= sum(mlp[k].size for k in ("router_stats", "router_bias") if k in mlp)
    return total
