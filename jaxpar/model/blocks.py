"""Transformer blocks and their registry (`model.block`): the pre-norm block of the built-in
architectures, and `register_block` for research code's own. A block builds on the layers
(`jaxpar.model.layers`) and the MoE MLP (`jaxpar.model.moe`), so it lives above both."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ConfigError, ModelConfig
from jaxpar.model import fp8
from jaxpar.model.layers import MLP, attention, norm, param
from jaxpar.model.moe import MoE
from jaxpar.sharding import enter_tp


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = norm(cfg)
        self.attn = attention(cfg, rngs=rngs)
        self.mlp_norm = norm(cfg)
        if cfg.moe:
            self.mlp = MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg, rngs=rngs)
        self.fp8 = cfg.fp8
        self.fp8_sites, self.fp8_length = fp8_sites(cfg), cfg.fp8_history
        if cfg.fp8 and cfg.fp8_scaling == "delayed":  # each FP8 matmul's amaxes (x, g), never trained
            self.fp8_history = param(None, (self.fp8_sites * fp8.TENSORS * cfg.fp8_history,), ("fp8",), jnp.float32)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        # model.fp8: the block's weight matmuls in FP8, scaled from its history under delayed scaling
        history = self.fp8_history[...] if hasattr(self, fp8.HISTORY) else None
        with fp8.matmuls(self.fp8, history, self.fp8_sites, self.fp8_length):
            return self._call(x_BxTxD)

    def _call(self, x_BxTxD: jax.Array) -> jax.Array:
        # The residual stream and the norms live on `sp_seq` (split over `model` by sequence
        # parallelism); each sub-layer takes the whole sequence at its input (`enter_tp`) and
        # reduces its row-parallel output back onto the residual (`exit_tp`): per sub-layer one
        # all-reduce each way, or a reduce-scatter + all-gather pair under SP.
        x_BxTxD = x_BxTxD + self.attn(enter_tp(self.attn_norm(x_BxTxD)))
        if getattr(self.mlp, "routes_sequence_shard", lambda: False)():  # MoE, experts whole on each model rank
            return x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD), sequence_shard=True)
        return x_BxTxD + self.mlp(enter_tp(self.mlp_norm(x_BxTxD)))


def fp8_sites(cfg: ModelConfig) -> int:
    """The FP8 weight matmuls one `Block` runs, in call order the rows of its `fp8_history`:
    attention's (q, k, v, o; MLA's q or q_a and q_b, kv_a, kv_b, o), then the MLP's (llama: up,
    gate, down; gpt2: up, down) or the MoE layer's (routed gate, up, down, then the shared
    experts' gate, up, down). `fp8.matmuls` checks the count against the calls as the block runs."""
    attention = (4 if cfg.q_lora_rank is None else 5) if cfg.mla else 4
    if cfg.moe:
        return attention + 3 + (3 if cfg.n_shared_experts else 0)
    return attention + (3 if cfg.arch == "llama" else 2)


# Blocks by name (`model.block`): research code registers its own and every strategy (pipeline
# stages, tensor parallelism through the TP marks, ZeRO through the logical names) runs it.
BLOCKS: dict[str, type] = {"pre_norm": Block}


def register_block(name: str):
    """Class decorator: make an `nnx.Module` block selectable as `model.block: <name>`.

    The class is built as `cls(cfg: ModelConfig, *, rngs=nnx.Rngs)` and called on the residual
    stream `x [B, T, D] -> [B, T, D]`. Create parameters with `param(...)` and logical dim names,
    and wrap tensor-parallel regions in `enter_tp` / `exit_tp` as `Block` does (`Attention` and
    `MLP` already contain theirs), so that sharding, ZeRO and the pipeline apply unchanged."""
    def add(cls):
        BLOCKS[name] = cls
        return cls

    return add


def stacked(block: type, cfg: ModelConfig, n: int, rngs: nnx.Rngs, axis: str = "layers") -> nnx.Module:
    """`n` blocks with their parameters stacked on a leading dim named `axis` (`layers`; `mtp` for
    the multi-token prediction modules' blocks)."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def stacked_blocks(rngs: nnx.Rngs) -> nnx.Module:
        return block(cfg, rngs=rngs)

    return stacked_blocks(rngs)


def block_class(cfg: ModelConfig) -> type:
    if cfg.block not in BLOCKS:
        raise ConfigError(f"model.block = {cfg.block!r} is not a registered block (registered: "
                          f"{', '.join(sorted(BLOCKS))}); register it with jaxpar.model.register_block before "
                          "building the model, or set model.block=pre_norm.")
    return BLOCKS[cfg.block]
