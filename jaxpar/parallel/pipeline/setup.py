"""What every stage knows before it traces anything (`Setup`): the config, the mesh's sizes, the
table and the policies derived from them; and the data-axis reduction of a gradient after the tick
loop (`Setup.reduce_data`: the reduction rule's `Reduction.reduce_after`). Built once per step function by
`make_setup`."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.sharding import Mesh

from jaxpar import model
from jaxpar.config import Config
from jaxpar.parallel import microbatches
from jaxpar.parallel.gradients import Reduction, reduction
from jaxpar.parallel.pipeline.placement import stage_of
from jaxpar.parallel.pipeline.table import Table
from jaxpar.parallel.stages import chunk_model, stage_layout
from jaxpar.parallel.zero import Layout

DATA, STAGE, MODEL = "data", "stage", "model"


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every stage knows before it traces anything: the config, the mesh's sizes and the
    policies derived from them."""

    cfg: Config
    layout: Layout
    table: Table
    loss_sum: Callable
    poison_idle: bool
    p: int              # stages
    v: int              # chunks per stage
    t: int              # model (tensor-parallel) shards
    d: int              # data shards
    m: int              # microbatches
    slots: object       # `jaxpar.parallel.stages.StageLayout`: the layer slots of every chunk
    chunk_cfg: object   # the model of one chunk (`stages.chunk_model`)
    n_tokens: int       # tokens of the global batch: the loss's one divisor
    sp: bool            # sequence parallelism on
    data_axes: tuple    # ("data",) where data has more than one shard, else ()
    reduction: Reduction  # where gradients are reduced and ZeRO-3's shards gathered (gradients.reduction)
    eos: int | None     # data.document_mask: the id that ends a document (`train.data.document_eos`), else None
    fwd_pairs: tuple    # ppermute pairs of the forward hop (interleaved: round the ring; V: down, s -> s+1)
    bwd_pairs: tuple    # of the backward hop (V: up, s+1 -> s; both directions carry both kinds, `tick.hop`)
    last_stage: int     # the stage holding the last chunk (the head and the loss): p-1, or 0 under the V

    @property
    def dp(self) -> bool:
        return bool(self.data_axes)

    @property
    def zero(self) -> int:
        """The ZeRO stage in effect (0 on one data shard: nothing is sharded)."""
        return self.reduction.zero

    @property
    def clipping(self) -> bool:
        """train.qk_clip: F reports each layer's per-head largest logit, the step returns their maxima."""
        return self.cfg.train.qk_clip is not None

    @property
    def gather(self) -> str | None:
        return self.reduction.gather

    def reduce_data(self, g: jax.Array, dim: int | None) -> jax.Array:
        """The data-axis reduction after the loop of one gradient whose ZeRO dim is `dim`: the
        reduction rule's own (`Reduction.reduce_after`; one reduced at use comes back as is)."""
        return self.reduction.reduce_after(g, dim)


def make_setup(cfg: Config, mesh: Mesh, layout: Layout, table: Table, loss_sum: Callable,
               poison_idle: bool, eos: int | None = None) -> Setup:
    p, t = mesh.shape[STAGE], mesh.shape[MODEL]
    v = table.chunks
    dp = mesh.shape[DATA] > 1
    # Every chunk runs the same slots per stack; a slot that holds none of its layers is skipped
    # and receives no gradient (`jaxpar.parallel.stages`: uneven stages, dense first layers).
    slots = stage_layout(cfg.model, p, v, cfg.parallel.stage_layers, table.placement)
    chunk_cfg = chunk_model(cfg.model, slots)
    model.param_names(chunk_cfg)  # build (and cache) the chunk model's abstract state outside any mesh context
    return Setup(
        cfg=cfg, layout=layout, table=table, loss_sum=loss_sum, poison_idle=poison_idle, p=p, v=v, t=t,
        d=mesh.shape[DATA], m=cfg.parallel.microbatches, slots=slots, chunk_cfg=chunk_cfg,
        n_tokens=microbatches.loss_tokens(cfg), sp=cfg.parallel.sequence_parallel and t > 1,
        data_axes=(DATA,) if dp else (), eos=eos,
        # ZeRO-2, per microbatch: every B reduce-scatters its sharded gradients where they arise (a
        # seed per leaf, `jaxpar.sharding.Handout`), and the accumulator holds shards only.
        reduction=reduction(cfg, mesh.shape[DATA], p),
        # Interleaved chunks travel round the ring (the last stage's chunk k feeds stage 0's chunk
        # k+1); the V's never do (its turn, chunk p-1 to p, stays on stage p-1).
        fwd_pairs=tuple((i, (i + 1) % p) for i in range(p if v > 1 and table.placement != "v" else p - 1)),
        bwd_pairs=tuple(((i + 1) % p, i) for i in range(p if v > 1 and table.placement != "v" else p - 1)),
        last_stage=stage_of(p * v - 1, p, table.placement))
