"""Transformer blocks and their registry (`model.block`): the pre-norm block of the built-in
architectures, and `register_block` for research code's own. A block builds on the layers
(`jaxpar.model.layers`) and the MoE MLP (`jaxpar.model.moe`), so it lives above both."""

from __future__ import annotations

import jax
from flax import nnx

from jaxpar.config import ConfigError, ModelConfig
from jaxpar.model import fp8
from jaxpar.model.layers import MLP, attention, norm
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

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        with fp8.matmuls(self.fp8):  # model.fp8: the block's weight matmuls in FP8 (`jaxpar.model.fp8`)
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
