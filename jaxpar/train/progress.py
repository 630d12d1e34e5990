"""What a run says while it trains: one plain line per logged step, through Python's `logging`.

The training loop logs each metrics record as one line on the logger `jaxpar.progress`
(`line`), flushed as it is written: a batch job's log (SLURM, nohup, `| tee`) and a notebook see
every logged step in full. The CLI shows a live bar instead when its stdout is a terminal, built
from the same pieces (`fields`). A script or notebook that configured no logging gets a handler
on stderr (`default_handler`); silence it with `logging.getLogger("jaxpar").setLevel(logging.WARNING)`.
"""

from __future__ import annotations

import datetime
import logging
import sys

from jaxpar.train import efficiency

log = logging.getLogger("jaxpar.progress")


def fields(rec: dict) -> dict[str, str]:
    """The formatted pieces of a record: loss, grad norm, lr, tokens/s, efficiency, and where
    present the validation loss, the routers' figures, the MTP loss and QK-clip's max logit."""
    out = {"loss": f"{rec['loss']:.4f}", "grad_norm": f"{rec['grad_norm']:.3g}", "lr": f"{rec['lr']:.3g}",
           "tps": f"{rec['tokens_per_s']:,.0f}", "eff": efficiency.describe(rec)}
    if "val_loss" in rec:
        out["val"] = f"{rec['val_loss']:.4f} (ppl {rec['val_ppl']:.2f})"
    if "moe_aux_loss" in rec:  # the routers: losses and the extreme expert loads (1 = the mean load)
        dropped = f" dropped {rec['moe_dropped']:.1%}" if "moe_dropped" in rec else ""
        out["moe"] = (f"aux {rec['moe_aux_loss']:.3f} z {rec['moe_z_loss']:.3f} load "
                      f"{rec['moe_min_load']:.2f}-{rec['moe_max_load']:.2f}{dropped}")
    if "mtp_loss" in rec:  # multi-token prediction: the mean over depths (and each, with several)
        depths = sorted(k for k in rec if k.startswith("mtp_loss_"))
        out["mtp"] = f"{rec['mtp_loss']:.4f}" + (
            f" ({' '.join(f'{rec[k]:.4f}' for k in sorted(depths, key=lambda k: int(k.rsplit('_', 1)[1])))})"
            if depths else "")
    if "max_logit" in rec:  # train.qk_clip: the largest attention logit of the step (before the clip)
        out["max_logit"] = f"{rec['max_logit']:.4g}"
    if rec.get("skipped_steps"):
        out["skipped"] = str(rec["skipped_steps"])
    return out


def line(rec: dict, total: int, eta_s: float | None) -> str:
    """`step 200/2000 loss 1.0513 grad_norm 0.412 lr 0.003 tok/s 10,222 0.0051 TFLOP/s/dev, MFU n/a
    ETA 0:03:12 val 1.4943 (ppl 4.46)`: one logged step, in full."""
    f = fields(rec)
    eta = "-" if eta_s is None else str(datetime.timedelta(seconds=round(eta_s)))
    text = (f"step {rec['step']}/{total} loss {f['loss']} grad_norm {f['grad_norm']} lr {f['lr']} "
            f"tok/s {f['tps']} {f['eff']} ETA {eta}")
    for key in ("val", "mtp", "moe", "max_logit", "skipped"):
        if key in f:
            text += f" {key} {f[key]}"
    return text


def default_handler() -> None:
    """Where nothing is configured to show the `jaxpar` logger's records (no handler on it or
    above it), show its INFO lines on stderr: the Python API then reports progress as the CLI
    does. A program that configured logging keeps its own choice."""
    logger = logging.getLogger("jaxpar")
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
