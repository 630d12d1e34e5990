"""Multi-token prediction (DeepSeek-V3 §2.2, `model.mtp_depth`): D modules after the model, module
k predicting the token k + 1 positions ahead, and the training objective they add to the main loss.

Module k takes, at position i, the previous depth's output h_i (the model's final-normed output for
k = 1) and the embedding of the token k ahead, t_{i+k}:

    h_i <- norm_k(block_k(eh_proj_k [enorm_k(embed(t_{i+k})); hnorm_k(h_i)]))

and its logits are the shared output head's of h (the order of the concatenation and the norms are
DeepSeek-V3's checkpoints', as Megatron-Core and vLLM read them). The embedding and the output head
are the model's own; each module has its norms, its projection [2D, D] and one transformer block
(MoE when the model has experts: DeepSeek-V3's). Every module runs over the whole sequence: at
depth k the last k positions have no target, and under `data.document_mask` neither has a position
whose token k ahead starts another document.

Rows of token windows carry D tokens more than the model reads (`pad`: masked ids), so that the
inputs and targets of every depth are a slice of the same rows (`cut`; context parallelism's chunk
windows carry them too, `jaxpar.parallel.context.loss_rows`). The objective (`objective`, the one
place the loss of a batch is assembled from the model's output, for the unpipelined step and the
pipeline's last stage) is the main loss plus `mtp_loss_weight` times the mean of the D depths'
losses, each a sum over the batch's targets divided by the same count; what each depth's loss was
rides out in the gradient of the `report` leaf (zeros, never trained), as the routers' report does
(`jaxpar.model.moe`): `split_report` takes it out of the gradients, `metrics` logs it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model import qk_clip
from jaxpar.model.blocks import block_class, stacked
from jaxpar.model.layers import linear, param, rms_norm
from jaxpar.sharding import vary, varying_axes


class MTP(nnx.Module):
    """The D modules' parameters, each stacked on a leading `mtp` dim: `enorm`, `hnorm`, `norm`
    (RMSNorm scales [D, d]), `eh_proj` [D, 2d, d] and `blocks` (one block per depth); and `report`
    [D + 1] (the main and each depth's loss of the step, in its gradient)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, d, pd = cfg.mtp_depth, cfg.d_model, cfg.param_dtype
        self.eps, self.dtype = cfg.norm_eps, cfg.dtype
        self.enorm = param(None, (D, d), ("mtp", "embed"), pd, fill=1.0)
        self.hnorm = param(None, (D, d), ("mtp", "embed"), pd, fill=1.0)
        self.eh_proj = param(rngs, (D, 2 * d, d), ("mtp", "mtp_cat", "embed"), pd, cfg.init_std)
        self.blocks = stacked(block_class(cfg), cfg, D, rngs, axis="mtp")
        self.norm = param(None, (D, d), ("mtp", "embed"), pd, fill=1.0)
        self.report = param(None, (D + 1,), ("mtp",), jnp.float32)

    def depth(self, k: int, h_BxTxD: jax.Array, e_BxTxD: jax.Array, remat_policy) -> jax.Array:
        """Module k's (from 0) output from the previous depth's `h` and the embeddings `e` of the
        tokens k + 1 ahead; its block under the step's remat policy."""
        graphdef, state = nnx.split(self.blocks)
        layer_state = jax.tree.map(lambda a: a[k], state)
        x = jnp.concatenate([rms_norm(e_BxTxD, self.enorm[k], self.eps), rms_norm(h_BxTxD, self.hnorm[k], self.eps)],
                            axis=-1)
        x = linear(x, self.eh_proj[k].astype(self.dtype))
        recording = qk_clip.active()

        def block(x, st):
            if not recording:
                return nnx.merge(graphdef, st)(x), None
            with qk_clip.layer() as top:  # (train.qk_clip) the block's per-head largest logit
                y = nnx.merge(graphdef, st)(x)
            return y, top[0]

        y, top = jax.checkpoint(block, policy=remat_policy, prevent_cse=False)(x, layer_state)
        if recording:
            qk_clip.put(top[None])
        return rms_norm(y, self.norm[k], self.eps)


def pad(rows_BxW: jax.Array, depth: int) -> jax.Array:
    """Token windows with `depth` masked ids (-1: read as id 0, never a target) appended."""
    if not depth:
        return rows_BxW
    return jnp.concatenate([rows_BxW, jnp.full((rows_BxW.shape[0], depth), -1, rows_BxW.dtype)], axis=1)


def cut(rows: jax.Array, shift: int, depth: int) -> tuple[jax.Array, jax.Array]:
    """Inputs and targets [B, T] of windows [B, T + 1 + depth], `shift` tokens ahead (0: the model's)."""
    T = rows.shape[1] - 1 - depth
    return rows[:, shift:shift + T], rows[:, shift + 1:shift + 1 + T]


def depth_rows(split: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]], rows: jax.Array, depth: int,
               eos: int | None) -> list[tuple[jax.Array, jax.Array]]:
    """(inputs, targets) of depths 1 .. `depth` from `rows` by `split(rows, shift)`; with `eos`
    (document masking) a target is masked (~id) where a document ends between the position and the
    token the depth embeds."""
    out = []
    for k in range(1, depth + 1):
        inputs, targets = split(rows, k)
        if eos is not None:
            ends = jnp.zeros(targets.shape, bool)
            for j in range(k):
                x = split(rows, j)[0]
                ends = ends | (jnp.maximum(x, ~x) == eos)
            targets = jnp.where(ends & (targets >= 0), ~targets, targets)
        out.append((inputs, targets))
    return out


def objective(m, y_BxTxD: jax.Array, targets_BxT: jax.Array, rows_by_depth: list, loss_sum: Callable,
              n_tokens: int, remat_policy=None) -> jax.Array:
    """The training objective of model `m` (a bound `Transformer`) from its blocks' output `y`:
    the main loss `loss_sum(logits, targets) / n_tokens`, plus `mtp_loss_weight` times the mean of
    the MTP depths' losses (each `loss_sum / n_tokens` on `rows_by_depth`: `depth_rows`)."""
    cfg = m.cfg
    h = m.final_norm(y_BxTxD)
    main = loss_sum(m.project(h), targets_BxT) / n_tokens
    if not cfg.mtp_depth:
        return main
    losses = [main]
    for k, (inputs, targets) in enumerate(rows_by_depth):
        h = m.mtp.depth(k, h, m.embed_tokens(inputs), remat_policy)
        losses.append(loss_sum(m.project(h), targets) / n_tokens)
    losses = jnp.stack(losses)
    losses = _report(losses, vary(m.mtp.report[...], varying_axes(losses)))
    return losses[0] + (cfg.mtp_loss_weight / cfg.mtp_depth) * jnp.sum(losses[1:])


@jax.custom_vjp
def _report(losses: jax.Array, report: jax.Array) -> jax.Array:
    return losses


def _report_fwd(losses, report):
    return losses, losses


def _report_bwd(losses, g):
    # The report leaf's "gradient" is the losses themselves: summed over microbatches, data ranks
    # and stages like every gradient, it is the step's losses (each a share of one global count).
    return g, jax.lax.stop_gradient(losses).astype(jnp.float32)


_report.defvjp(_report_fwd, _report_bwd)


def is_report(path) -> bool:
    """Is this tree path (`jax.tree_util` keys) the MTP report leaf?"""
    return len(path) >= 2 and getattr(path[-1], "key", None) == "report" and getattr(path[-2], "key", None) == "mtp"


def split_report(cfg: ModelConfig, grads: Any) -> tuple[Any, jax.Array | None]:
    """(the gradients with zeros for the report leaf, the losses [D + 1]: main, then each depth)."""
    if not cfg.mtp_depth:
        return grads, None
    report = grads["mtp"]["report"]
    return {**grads, "mtp": {**grads["mtp"], "report": jnp.zeros_like(report)}}, report.astype(jnp.float32)


def metrics(cfg: ModelConfig, report: jax.Array) -> dict[str, jax.Array]:
    """The logged losses: `loss` the main (next-token) loss, `mtp_loss` the mean over depths, and
    `mtp_loss_k` each depth's when there are several."""
    out = {"loss": report[0], "mtp_loss": jnp.mean(report[1:])}
    if cfg.mtp_depth > 1:
        out.update({f"mtp_loss_{k}": report[k] for k in range(1, cfg.mtp_depth + 1)})
    return out

