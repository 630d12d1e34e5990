"""`python -m jaxpar.convert`: Hugging Face folders to and from jaxpar run directories.

  --from-hf DIR --to RUN_DIR      a run directory: config.yaml, a step-0 checkpoint of the weights
                                  (train it with `python -m jaxpar.train --config RUN_DIR/config.yaml`)
                                  and the folder's tokenizer files
  --from-hf DIR --to-hf OUT       a round trip through jaxpar's layout
  --run-dir RUN --to-hf OUT       a run directory's newest checkpoint as a Hugging Face folder
                                  (refused when the run logged later steps than it holds, unless
                                  --allow-stale)

Outputs are written under a temporary name and renamed: they appear whole or not at all, and an
existing output is never overwritten. Conversion holds the whole model in host memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from jaxpar.config import Config, JaxparError, TrainConfig, to_yaml
from jaxpar.hf import HFError, config_from_hf, load_params, publish, save_params, tokenizer_files

def _on_host(cfg) -> dict:
    import jax

    from jaxpar import model

    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    return jax.tree.map(lambda _: cpu, model.param_shapes(getattr(cfg, "model", cfg)))


def hf_to_run(src: str, run_dir: str, seq_len: int | None = None) -> Config:
    """Write `run_dir` (config.yaml, a step-0 checkpoint, tokenizer files) from the Hugging Face
    folder `src`; returns its config."""
    from jaxpar.train.checkpoint import save_initial

    run_dir = os.path.abspath(run_dir)
    if os.path.exists(run_dir):
        raise HFError(f"{run_dir!r} already exists; choose a new run directory (nothing is overwritten).")
    parent = os.path.dirname(run_dir)
    cfg = Config(model=config_from_hf(src, seq_len=seq_len), train=TrainConfig(run_dir=run_dir))
    params = load_params(src, cfg, _on_host(cfg))
    os.makedirs(parent, exist_ok=True)  # only now: every check and read has passed
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(run_dir)}.tmp-", dir=parent)
    try:
        with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(to_yaml(cfg))
        save_initial(cfg, params, tmp)
        for name, path in tokenizer_files(src).items():
            shutil.copyfile(path, os.path.join(tmp, name))
        publish(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cfg


def to_hf(out: str, *, src: str | None = None, run_dir: str | None = None, allow_stale: bool = False) -> int | None:
    """Write the Hugging Face folder `out` from a Hugging Face folder `src` or a run directory's
    newest checkpoint (`checkpoint.newest_trained`: refused when it misses logged steps, unless
    `allow_stale`); returns the step exported from a run directory."""
    from jaxpar.train.checkpoint import newest_trained, restore_params

    step = None
    if run_dir is not None:
        if not os.path.isdir(run_dir):
            raise HFError(f"run directory {run_dir!r} does not exist; pass a directory written by jaxpar.train "
                          "(with checkpoints) or jaxpar.convert.")
        step = newest_trained(run_dir, allow_stale)
        cfg, params = restore_params(run_dir, _on_host, step)
        folder = run_dir
    else:
        cfg, folder = Config(model=config_from_hf(src)), src
        params = load_params(folder, cfg, _on_host(cfg))
    save_params(params, cfg, out, extra_files=tokenizer_files(folder))
    return step


def parse_args(argv=None) -> argparse.Namespace:
    from jaxpar.cli import Parser, check_at_least, check_model_folder, check_new_output, check_run_dir

    parser = Parser(prog="python -m jaxpar.convert", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="a Hugging Face model folder (config.json + *.safetensors)")
    src.add_argument("--run-dir", metavar="RUN", help="a jaxpar run directory")
    dst = parser.add_mutually_exclusive_group(required=True)
    dst.add_argument("--to", metavar="RUN_DIR", help="write a run directory (from --from-hf)")
    dst.add_argument("--to-hf", metavar="DIR", help="write a Hugging Face model folder")
    parser.add_argument("--allow-stale", action="store_true",
                        help="with --run-dir: export the newest checkpoint even if the run logged later steps")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="context length of the run's config (with --to; default: the model's, at most 4096 "
                             "for llama)")
    args = parser.parse_args(argv)
    # A path of the wrong kind, or an impossible value, is one `error:` line before anything is read.
    check_model_folder(parser, "--from-hf", args.from_hf, "--run-dir")
    check_run_dir(parser, "--run-dir", args.run_dir, "--from-hf")
    check_new_output(parser, "--to", args.to)
    check_new_output(parser, "--to-hf", args.to_hf)
    check_at_least(parser, "--seq-len", args.seq_len, 1, "pass the run's context length, e.g. --seq-len 2048, "
                   "or leave it out for the folder's")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxpar.logs import quiet_libraries

    quiet_libraries()
    try:
        if args.to is not None:
            if args.from_hf is None:
                raise HFError("--to RUN_DIR converts a Hugging Face folder; give it --from-hf DIR "
                              "(use --to-hf to export a run directory).")
            cfg = hf_to_run(args.from_hf, args.to, args.seq_len)
            print(f"wrote {args.to}: config.yaml ({cfg.model.arch}, {cfg.model.n_layers} layers, d_model "
                  f"{cfg.model.d_model}, vocab {cfg.model.vocab_size}) and a step-0 checkpoint")
        else:
            if args.seq_len is not None:
                raise HFError("--seq-len applies to --to RUN_DIR only; drop it with --to-hf.")
            if args.allow_stale and args.run_dir is None:
                raise HFError("--allow-stale applies to --run-dir only; drop it with --from-hf.")
            step = to_hf(args.to_hf, src=args.from_hf, run_dir=args.run_dir, allow_stale=args.allow_stale)
            print(f"wrote {args.to_hf}" + ("" if step is None else f" from step {step} of {args.run_dir}"))
        return 0
    except JaxparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
