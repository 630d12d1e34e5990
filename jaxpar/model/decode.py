"""Incremental decoding with a KV cache: the training forward's maths, one chunk of positions at
a time (the prompt, then one token per step). Same parameters and layers as `Transformer`; the
training path is untouched. Shape suffixes as in `layers.py`; S: the cache length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.layers import Attention, apply_rope, rope_tables
from jaxpar.model.transformer import Params, _block_names, bind, block_kinds, layer_order, scan_layers, stack
from jaxpar.sharding import constrain, embed_lookup, enter_tp, exit_tp, use_params

Cache = dict[str, jax.Array]  # {"k", "v"}: [layers, B, S, K, H] in the compute dtype

CACHE_NAMES = ("layers", "batch", "seq", "kv_heads", "head_dim")


def init_cache(cfg: ModelConfig, batch: int, length: int) -> Cache:
    """An empty cache for `length` positions (prompt plus new tokens)."""
    shape = (cfg.n_layers, batch, length, cfg.kv_heads, cfg.head_size)
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


def _attend(attn: Attention, x_BxTxD: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, pos: jax.Array
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`Attention.__call__` for positions pos .. pos+T-1, attending to the cache and themselves;
    returns the output and the cache with this chunk's keys and values written in."""
    dt = attn.dtype
    T, S = x_BxTxD.shape[1], k_BxSxKxH.shape[1]
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = attn.project_qkv(x_BxTxD)
    if attn.arch == "llama":  # the rows of the training tables at these positions
        cos_SxH2, sin_SxH2 = rope_tables(S, attn.rope)
        rope = (jax.lax.dynamic_slice_in_dim(cos_SxH2, pos, T), jax.lax.dynamic_slice_in_dim(sin_SxH2, pos, T))
        q_BxTxNxH = apply_rope(q_BxTxNxH, *rope)
        k_BxTxKxH = apply_rope(k_BxTxKxH, *rope)
    k_BxSxKxH = jax.lax.dynamic_update_slice_in_dim(k_BxSxKxH, k_BxTxKxH.astype(k_BxSxKxH.dtype), pos, axis=1)
    v_BxSxKxH = jax.lax.dynamic_update_slice_in_dim(v_BxSxKxH, v_BxTxKxH.astype(v_BxSxKxH.dtype), pos, axis=1)
    q_BxTxNxH = constrain(q_BxTxNxH, ("batch", "seq", "heads", "head_dim"))
    k_BxSxKxH = constrain(k_BxSxKxH, CACHE_NAMES[1:])
    v_BxSxKxH = constrain(v_BxSxKxH, CACHE_NAMES[1:])
    # Query at position pos+t sees cache positions <= pos+t (later slots are empty or stale).
    mask_TxS = (pos + jnp.arange(T))[:, None] >= jnp.arange(S)[None, :]
    o_BxTxNxH = jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxKxH.astype(dt), v_BxSxKxH.astype(dt),
                                             mask=mask_TxS[None, None], implementation="xla")
    o_BxTxNxH = constrain(o_BxTxNxH, ("batch", "seq", "heads", "head_dim"))
    out_BxTxD = exit_tp(jnp.einsum("btnh,nhd->btd", o_BxTxNxH, attn.wo[...].astype(dt)))
    if attn.arch == "gpt2":
        out_BxTxD += attn.bo[...].astype(dt)
    return out_BxTxD, k_BxSxKxH, v_BxSxKxH


def extend(cfg: ModelConfig, params: Params, tokens_BxT: jax.Array, cache: Cache, pos: jax.Array
           ) -> tuple[jax.Array, Cache]:
    """Logits [B, T, V] (float32, padded vocabulary) of `tokens_BxT` placed at positions
    pos .. pos+T-1 after the `pos` positions already in `cache`, and the updated cache."""
    m = bind(cfg, params)
    T = tokens_BxT.shape[1]
    x_BxTxD = embed_lookup(m.embed[...].astype(cfg.dtype), tokens_BxT)
    if cfg.arch == "gpt2":
        x_BxTxD = x_BxTxD + jax.lax.dynamic_slice_in_dim(m.pos_embed[...], pos, T).astype(cfg.dtype)[None]
    x_BxTxD = constrain(x_BxTxD, ("batch", "sp_seq", "embed"))
    names = _block_names(cfg)
    order = layer_order(cfg)
    merged, params_, caches = {}, {}, {}
    for kind in block_kinds(cfg):
        graphdef, state = nnx.split(stack(m.blocks, kind))
        template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state)
        merged[kind] = (graphdef, template, stack(names, kind))
        params_[kind] = nnx.to_pure_dict(state)
        # A mixed model's cache rows in each stack's layer order (a static gather, and back below).
        caches[kind] = cache if not kind else {n: c[order[kind]] for n, c in cache.items()}

    def layer(kind, layer_params, layer_cache, i, x_BxTxD):
        graphdef, template, kind_names = merged[kind]
        layer_state = jax.tree.map(lambda v: v, template)
        nnx.replace_by_pure_dict(layer_state, use_params(layer_params, kind_names))
        block = nnx.merge(graphdef, layer_state)
        a_BxTxD, k_BxSxKxH, v_BxSxKxH = _attend(block.attn, enter_tp(block.attn_norm(x_BxTxD)), layer_cache["k"],
                                                layer_cache["v"], pos)
        x_BxTxD = x_BxTxD + a_BxTxD
        x_BxTxD = x_BxTxD + block.mlp(enter_tp(block.mlp_norm(x_BxTxD)))
        return x_BxTxD, {"k": k_BxSxKxH, "v": v_BxSxKxH}

    x_BxTxD, new = scan_layers(cfg, params_, x_BxTxD, layer, caches)
    if cfg.mixed:
        back = np.argsort(np.concatenate([order["dense"], order["moe"]]))
        new = {n: jnp.concatenate([new["dense"][n], new["moe"][n]])[back] for n in cache}
    else:
        new = new[""]
    return m.head(x_BxTxD), new
