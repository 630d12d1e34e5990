"""Incremental decoding with a KV cache: the training forward's maths, one chunk of positions at
a time (the prompt, then one token per step). Same parameters and layers as `Transformer`; the
training path is untouched. Shape suffixes as in `layers.py`; S: the cache length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.layers import Attention, LatentAttention, apply_rope, rope_tables
from jaxpar.model.transformer import Params, _block_names, bind, block_kinds, layer_order, scan_layers, stack
from jaxpar.sharding import constrain, embed_lookup, enter_tp, exit_tp, use_params

# Per layer, in the compute dtype: {"k", "v"} [layers, B, S, K, H] (grouped-query attention), or
# {"latent" [layers, B, S, kv_lora_rank], "rope" [layers, B, S, qk_rope_head_dim]} (multi-head
# latent attention: the normalised latent and the rotary key, RoPE applied, from which every
# head's keys and values are expanded at each step).
Cache = dict[str, jax.Array]

CACHE_NAMES = ("layers", "batch", "seq", "kv_heads", "head_dim")


def cache_names(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The logical dim names of each cache array of `cfg`."""
    if cfg.mla:
        return {"latent": ("layers", "batch", "seq", "latent"), "rope": ("layers", "batch", "seq", "head_dim")}
    return {"k": CACHE_NAMES, "v": CACHE_NAMES}


def cache_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes the cache holds per position, over all layers: 2·K·H per layer for grouped-query
    attention, kv_lora_rank + qk_rope_head_dim for MLA, in the compute dtype."""
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.mla else 2 * cfg.kv_heads * cfg.head_size
    return cfg.n_layers * width * jnp.dtype(cfg.dtype).itemsize


def init_cache(cfg: ModelConfig, batch: int, length: int) -> Cache:
    """An empty cache for `length` positions (prompt plus new tokens)."""
    if cfg.mla:
        lead = (cfg.n_layers, batch, length)
        return {"latent": jnp.zeros((*lead, cfg.kv_lora_rank), cfg.dtype),
                "rope": jnp.zeros((*lead, cfg.qk_rope_head_dim), cfg.dtype)}
    shape = (cfg.n_layers, batch, length, cfg.kv_heads, cfg.head_size)
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


def _rope_at(attn, S: int, pos: jax.Array, T: int):
    """The rows pos .. pos+T-1 of the training RoPE tables of S positions."""
    cos_SxH2, sin_SxH2 = rope_tables(S, attn.rope)
    return jax.lax.dynamic_slice_in_dim(cos_SxH2, pos, T), jax.lax.dynamic_slice_in_dim(sin_SxH2, pos, T)


def _attend_cached(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, pos, dt):
    """Attention of queries at positions pos .. pos+T-1 over the cache's S positions."""
    T, S = q_BxTxNxH.shape[1], k_BxSxNxH.shape[1]
    # Query at position pos+t sees cache positions <= pos+t (later slots are empty or stale).
    mask_TxS = (pos + jnp.arange(T))[:, None] >= jnp.arange(S)[None, :]
    o_BxTxNxH = jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxNxH.astype(dt), v_BxSxNxH.astype(dt),
                                             mask=mask_TxS[None, None], implementation="xla")
    return constrain(o_BxTxNxH, ("batch", "seq", "heads", "head_dim"))


def _attend_latent(attn: LatentAttention, x_BxTxD: jax.Array, cache: Cache, pos: jax.Array
                   ) -> tuple[jax.Array, Cache]:
    """`LatentAttention.__call__` for positions pos .. pos+T-1 over the latent cache: this chunk's
    latent and rotary key written in, every head's keys and values expanded from the cache."""
    T = x_BxTxD.shape[1]
    c_BxTxR, k_rot = attn.latent(x_BxTxD)
    q_BxTxNxH, k_rot = attn.rotate(attn.queries(x_BxTxD), k_rot, _rope_at(attn, cache["latent"].shape[1], pos, T))
    write = lambda c, x: jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), pos, axis=1)  # noqa: E731
    new = {"latent": write(cache["latent"], c_BxTxR), "rope": write(cache["rope"], k_rot[:, :, 0])}
    k_BxSxNxH, v_BxSxNxH = attn.keys_values(new["latent"].astype(attn.dtype), new["rope"][:, :, None].astype(attn.dtype))
    names = ("batch", "seq", "heads", "head_dim")
    o = _attend_cached(constrain(q_BxTxNxH, names), constrain(k_BxSxNxH, names), constrain(v_BxSxNxH, names), pos,
                       attn.dtype)
    return attn.output(o), new


def _attend(attn: Attention, x_BxTxD: jax.Array, cache: Cache, pos: jax.Array) -> tuple[jax.Array, Cache]:
    """`Attention.__call__` for positions pos .. pos+T-1, attending to the cache and themselves;
    returns the output and the cache with this chunk's keys and values written in."""
    if isinstance(attn, LatentAttention):
        return _attend_latent(attn, x_BxTxD, cache, pos)
    k_BxSxKxH, v_BxSxKxH = cache["k"], cache["v"]
    dt = attn.dtype
    T, S = x_BxTxD.shape[1], k_BxSxKxH.shape[1]
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = attn.project_qkv(x_BxTxD)
    if attn.arch == "llama":  # the rows of the training tables at these positions
        rope = _rope_at(attn, S, pos, T)
        q_BxTxNxH = apply_rope(q_BxTxNxH, *rope)
        k_BxTxKxH = apply_rope(k_BxTxKxH, *rope)
    k_BxSxKxH = jax.lax.dynamic_update_slice_in_dim(k_BxSxKxH, k_BxTxKxH.astype(k_BxSxKxH.dtype), pos, axis=1)
    v_BxSxKxH = jax.lax.dynamic_update_slice_in_dim(v_BxSxKxH, v_BxTxKxH.astype(v_BxSxKxH.dtype), pos, axis=1)
    q_BxTxNxH = constrain(q_BxTxNxH, ("batch", "seq", "heads", "head_dim"))
    k_BxSxKxH = constrain(k_BxSxKxH, CACHE_NAMES[1:])
    v_BxSxKxH = constrain(v_BxSxKxH, CACHE_NAMES[1:])
    o_BxTxNxH = _attend_cached(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, pos, dt)
    out_BxTxD = exit_tp(jnp.einsum("btnh,nhd->btd", o_BxTxNxH, attn.wo[...].astype(dt)))
    if attn.arch == "gpt2":
        out_BxTxD += attn.bo[...].astype(dt)
    return out_BxTxD, {"k": k_BxSxKxH, "v": v_BxSxKxH}


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
        a_BxTxD, layer_cache = _attend(block.attn, enter_tp(block.attn_norm(x_BxTxD)), layer_cache, pos)
        x_BxTxD = x_BxTxD + a_BxTxD
        x_BxTxD = x_BxTxD + block.mlp(enter_tp(block.mlp_norm(x_BxTxD)))
        return x_BxTxD, layer_cache

    x_BxTxD, new = scan_layers(cfg, params_, x_BxTxD, layer, caches)
    if cfg.mixed:
        back = np.argsort(np.concatenate([order["dense"], order["moe"]]))
        new = {n: jnp.concatenate([new["dense"][n], new["moe"][n]])[back] for n in cache}
    else:
        new = new[""]
    return m.head(x_BxTxD), new
