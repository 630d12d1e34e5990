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
    """6·N + 6·L·(d_qk + d_v)·S (DESIGN.md §6.1): N the non-embedding parameters a token uses (MoE:
    the active ones), d_qk and d_v the widths of all heads' queries (and keys) and values: n_heads
    x head_dim each (d_model unless head_dim is set; under MLA n_heads x (qk_nope + qk_rope) and
    n_heads x v_head_dim), causal attention not halved. With multi-token prediction (D =
    `mtp_depth`), N holds the D modules (each a block and a projection), their D blocks' attention
    counts as layers', and the output head runs D more times: + 6·D·d·V."""
    m = cfg.model
    d_v = m.n_heads * (m.v_head_dim if m.mla else m.head_size)
    layers = m.n_layers + m.mtp_depth
    return (6 * count_active_params(m, False) + 6 * layers * (m.n_heads * m.head_size + d_v) * m.seq_len
            + 6 * m.mtp_depth * m.d_model * m.padded_vocab)
