"""`python -m jaxpar.data prepare --input PATH_OR_GLOB... --out DIR`: tokenize text for training.

A user mistake ends in one `error: ...` line on stderr, exit code 2, nothing written.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from jaxpar import data
from jaxpar.cli import Parser
from jaxpar.errors import JaxparError
from jaxpar.data import expand_inputs, prepare


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m jaxpar.data", description=data.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize text files into train.bin, val.bin and meta.json")
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="PATH_OR_GLOB",
                   help=".txt / .jsonl files, directories (searched recursively) or globs (quote them)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist, or be empty)")
    p.add_argument("--tokenizer", default="byte", help="`byte` (default) or a tokenizer.json (or a folder holding one)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of tokens for validation (default 0.01)")
    p.add_argument("--force", action="store_true", help="replace a dataset already prepared in --out")
    p.add_argument("--chat", action="store_true",
                   help=".jsonl conversations ({\"messages\": [...]}) rendered with the tokenizer folder's chat "
                        "template; the loss learns the assistant turns only")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = Console()
    try:
        files = expand_inputs(args.input)
        bar = Progress(TextColumn("[bold]prepare"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal)
        with bar:
            task = bar.add_task("prepare", total=sum(os.path.getsize(f) for f in files))
            meta = prepare(files, args.out, args.tokenizer, args.val_fraction, force=args.force,
                           progress=lambda n: bar.advance(task, n), chat=args.chat)
    except JaxparError as e:
        print(f"error: {e}", file=sys.stderr)  # one line, never wrapped: scripts grep for it
        return 2
    n_train, n_val = meta["train"]["n_tokens"], meta["val"]["n_tokens"]
    console.print(f"wrote {args.out}: {len(files)} files, {meta['n_documents']:,} documents -> train {n_train:,} "
                  f"tokens, val {n_val:,} tokens ({n_val / (n_train + n_val):.2%}); tokenizer {meta['tokenizer']} "
                  f"(vocab {meta['vocab_size']:,}), {meta['dtype']}", highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
