"""The model's FLOPs per token (DESIGN.md §6.1): MFU's numerator, a fact of the model's shape that
the planner (`jaxpar.plan`) and a training run's efficiency (`jaxpar.train.efficiency`) both read."""

from __future__ import annotations

import functools

from jaxpar.config import Config
from jaxpar.model.transformer import count_params


@functools.lru_cache(maxsize=256)
def count_active_params(mcfg, embeddings: bool) -> int:
    """Non-embedding (or all) parameters a token uses: an MoE layer's k routed experts, not all."""
    return count_params(mcfg, embeddings=embeddings, active=True)  # (builds the shapes: cached)


def model_flops_per_token(cfg: Config) -> float:
    """6·N + 12·L·d_attn·S (DESIGN.md §6.1): N the non-embedding parameters a token uses (MoE:
    the active ones), d_attn = n_heads x head_dim (d_model unless head_dim is set), causal
    attention not halved."""
    m = cfg.model
    return 6 * count_active_params(m, False) + 12 * m.n_layers * m.n_heads * m.head_size * m.seq_len
