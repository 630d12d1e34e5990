"""`python -m jaxpar.schedules`: print a pipeline schedule as a table with its simulated cost
(bubble as idle / all stage-time and as Megatron's idle / ideal, peak stash and wstash, buffered
messages), and optionally draw it."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jaxpar.parallel.pipeline.schedules import SCHEDULES, V_SCHEDULES, ScheduleError, build, validate
from jaxpar.parallel.pipeline.table import deferred_w_slots
from jaxpar.parallel.pipeline.timeline import render_png, render_text


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line on stderr and exit 2, from main, not argparse's usage dump
        raise _UsageError(f"{message}; see `{self.prog} --help`.")


# What the drawing can write (matplotlib picks the format by the extension).
IMAGE_EXTENSIONS = (".png", ".svg", ".svgz", ".pdf", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps",
                    ".gif", ".avif")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="python -m jaxpar.schedules",
                     description="Build a pipeline schedule, check it, and print its table and simulated cost.")
    parser.add_argument("--schedule", required=True, help=f"one of: {', '.join(SCHEDULES)}")
    parser.add_argument("--stages", "-p", type=int, required=True, help="pipeline stages p")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches per step m")
    parser.add_argument("--virtual-stages", "-v", type=int, default=None,
                        help="model chunks per stage v (interleaved_1f1b: any; zb_v, dualpipe_v: 2, their default; "
                             "the others: 1, their default)")
    parser.add_argument("--remat", default="none", choices=("none", "dots", "dots_except_mlp", "full"),
                        help="parallel.remat of the run: the table it runs (zb_v under a remat policy defers at most "
                             "one W: jaxpar.parallel.pipeline.table.deferred_w_slots; default none)")
    parser.add_argument("--f-cost", type=float, default=1.0, help="forward time of one stage's layers (default 1)")
    parser.add_argument("--b-cost", type=float, default=None,
                        help="fused backward (B) time of one stage's layers (default: I + W)")
    parser.add_argument("--i-cost", type=float, default=None,
                        help="input-gradient (I) time of one stage's layers (default 1, or half of --b-cost)")
    parser.add_argument("--w-cost", type=float, default=None,
                        help="weight-gradient (W) time of one stage's layers (default 1, or half of --b-cost)")
    parser.add_argument("--activation-bytes", type=int, default=None,
                        help="bytes of one activation message, to report the bytes sent")
    parser.add_argument("--png", metavar="FILE", help="also draw the schedule to FILE (needs jaxpar[plot])")
    try:
        args = parser.parse_args(argv)
        given = {k: getattr(args, f"{k}_cost") for k in ("f", "b", "i", "w")}
        if any(x is not None and x < 0 for x in given.values()):
            raise ScheduleError(", ".join(f"--{k}-cost {x:g}" for k, x in given.items() if x is not None and x < 0)
                                + ": costs must be >= 0; pass non-negative times.")
        if args.activation_bytes is not None and args.activation_bytes < 0:
            raise ScheduleError(f"--activation-bytes {args.activation_bytes} must be >= 0 (the bytes of one "
                                "activation message); pass a non-negative size, or leave it out.")
        if args.png and not args.png.lower().endswith(IMAGE_EXTENSIONS):
            raise ScheduleError(f"--png {args.png!r} is not an image file name (the drawing's format follows the "
                                "extension: .png, .svg, .pdf, ...); pass e.g. --png schedule.png.")
        v = args.virtual_stages if args.virtual_stages is not None else 2 if args.schedule in V_SCHEDULES else 1
        schedule = validate(build(args.schedule, args.stages, args.microbatches, v,
                                  deferred_w_slots(args.schedule, args.remat)))
        text = render_text(schedule, args.f_cost, args.b_cost, args.activation_bytes, i_cost=args.i_cost,
                           w_cost=args.w_cost)
        if args.png:
            try:
                render_png(schedule, args.png)
            except OSError as e:
                raise ScheduleError(f"cannot write --png {args.png!r} ({e.strerror or e}); pick a writable path.") from None
    except (_UsageError, ScheduleError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    if deferred_w_slots(args.schedule, args.remat) is not None:
        print(f"(under remat {args.remat} {args.schedule} defers at most {deferred_w_slots(args.schedule, args.remat)} "
              f"W at a time: the closed form above is the uncapped table's)")
    if args.png:
        print(f"drawn to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
