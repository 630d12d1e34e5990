"""`python -m jaxpar.plan`: the command line of the planner. Its arguments (a model preset or a
config, the hardware, the search's options), the search (`jaxpar.plan.search`) or `--evaluate`,
and what it prints (`jaxpar.plan.report`); argument mistakes and refusals are one `error:` line
with exit 2."""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxpar.config import Config, ConfigError, JaxparError
from jaxpar.hardware import HARDWARE
from jaxpar.plan.moe import describe_params
from jaxpar.plan.presets import MODELS
from jaxpar.plan.report import _fixes, _human, _too_big, print_evaluation, print_report, print_wall
from jaxpar.plan.search import evaluate, layout_shape, plan, to_json
from jaxpar.plan.steptime import Roofline


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GB' (decimal, as datasheets write it), '80GiB', '141 GB', '1.5TB' -> bytes."""
    import re
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]+)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"--device-memory {text!r} is not a size with a unit; write it like 80GB or 80GiB.")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise ConfigError(f"--device-memory {text!r} must be positive; write it like 80GB.")
    return int(value)


def _write_config(cfg: Config, path: str) -> None:
    """Write `cfg` as YAML to `path` atomically: a temporary name in the same folder, then a rename,
    so that an error leaves nothing behind."""
    import os
    import tempfile

    from jaxpar.config import to_yaml

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"--write-config {path!r}: folder {folder!r} does not exist; create it or pick another path.")
    fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".yaml", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("# Written by python -m jaxpar.plan: the fastest layout it predicts that fits.\n")
            f.write(to_yaml(cfg))
        from jaxpar.files import apply_umask

        apply_umask(tmp)  # mkstemp's file is 0600; the config is the user's, readable as open() would make it
        os.replace(tmp, path)
    except OSError as e:
        os.unlink(tmp)
        raise ConfigError(f"--write-config {path!r} cannot be written ({e.strerror or e}); pick a writable path.") from None


def _parser():
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one sentence on stderr and exit 2, not argparse's usage dump
            raise ConfigError(message + "; see python -m jaxpar.plan --help.")

    ap = Parser(prog="python -m jaxpar.plan", description=(
        "Will it fit, and which layout is fastest? Per-device memory, FLOPs, traffic per mesh axis and a "
        "roofline step time of every valid (data, stage, model) layout, ZeRO stage, schedule, microbatch "
        "count and remat policy of a model on a cluster, ranked."))
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--config", help="a jaxpar YAML config (its model and train.global_batch)")
    src.add_argument("--preset", help="a model preset: " + ", ".join(MODELS))
    ap.add_argument("--devices", type=int, help="number of accelerators (with --evaluate: the config's mesh's, "
                    "needed only where an axis is -1)")
    ap.add_argument("--hardware", default="h100-80gb", help="hardware preset (datasheet figures): "
                    + ", ".join(HARDWARE) + " (default h100-80gb)")
    ap.add_argument("--device-memory", help="memory per device, e.g. 80GB or 80GiB (default: the hardware's)")
    ap.add_argument("--node-size", type=int, help="devices per node (one NVLink domain; default 8)")
    ap.add_argument("--peak-tflops", type=float, help="dense peak TFLOP/s per device at the compute dtype")
    ap.add_argument("--intra-node-bw", type=float, help="GB/s one device sends in one direction inside a node")
    ap.add_argument("--inter-node-bw", type=float, help="GB/s one device sends in one direction across nodes")
    ap.add_argument("--compute-efficiency", type=float,
                    help="charge every FLOP at this fraction of the dense peak, overriding the compute model "
                         "(default: the model calibrated on jaxpar's H200 steps, by matmul sizes and attention kernel)")
    ap.add_argument("--collective-matmul", action="store_true",
                    help="assume XLA's windowed einsum overlaps forward tensor-parallel collectives with their "
                         "matmuls (jaxpar does not set its flags: off by default)")
    ap.add_argument("--global-batch", type=int, help="sequences per step (default: the config's or preset's)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's or preset's)")
    ap.add_argument("--top", type=int, help="rows of the table (default 10); with --json, estimate only the layouts "
                    "that can enter the first TOP (faster; the others counted in not_estimated.slower) instead of all")
    ap.add_argument("--write-config", metavar="FILE", help="write the fastest fitting layout as a jaxpar YAML config")
    ap.add_argument("--json", action="store_true", help="print JSON: every layout estimated, each with `fits` and "
                    "`rank` (those that fit by predicted step time, then those that do not by memory), and how many "
                    "were not estimated or refused; with --evaluate, the one layout's object")
    ap.add_argument("--evaluate", action="store_true",
                    help="cost exactly the layout the config states (mesh, ZeRO, schedule, microbatches, remat, SP, "
                         "master weights, offload) instead of searching: its memory parts, bytes per axis and "
                         "step-time parts")
    ap.add_argument("--memory-wall", action="store_true",
                    help="also print per-device memory as each strategy is added (before the ranking)")
    ap.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                    help="where the step runs: decides the attention kernel (gpu: cuDNN flash attention for "
                         "bf16/fp16). Default gpu")
    return ap


def _inputs(args):
    """The model config, the roofline and the device count from the arguments (with --evaluate the
    count is the config's mesh's: `_evaluated_devices`); one ConfigError for the first bad one."""
    from jaxpar.config import from_dict, load_config

    if args.config is None and args.preset is None:
        raise ConfigError("give the model with --preset NAME or --config FILE; e.g. --preset llama-7b.")
    if args.preset is not None and args.preset not in MODELS:
        raise ConfigError(f"unknown model preset {args.preset!r}; the presets are {', '.join(MODELS)}.")
    if args.hardware not in HARDWARE:
        raise ConfigError(f"unknown hardware preset {args.hardware!r}; the presets are {', '.join(HARDWARE)}.")
    if args.devices is None and not args.evaluate:
        raise ConfigError("the following arguments are required: --devices (the number of accelerators; only "
                          "--evaluate reads it from the config's mesh); see python -m jaxpar.plan --help.")
    if args.devices is not None and args.devices < 1:
        raise ConfigError(f"--devices {args.devices} must be at least 1; give the number of accelerators.")
    if args.evaluate and (args.write_config or args.memory_wall):
        flag = "--write-config" if args.write_config else "--memory-wall"
        raise ConfigError(f"{flag} goes with the search, which --evaluate does not run; drop one of the two.")
    hw = HARDWARE[args.hardware]
    for flag, value in (("--node-size", args.node_size), ("--peak-tflops", args.peak_tflops),
                        ("--intra-node-bw", args.intra_node_bw), ("--inter-node-bw", args.inter_node_bw),
                        ("--global-batch", args.global_batch), ("--seq-len", args.seq_len), ("--top", args.top)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} {value:g} must be positive; give a number above zero.")
    if args.compute_efficiency is not None and not 0 < args.compute_efficiency <= 1:
        raise ConfigError(f"--compute-efficiency {args.compute_efficiency:g} must lie in (0, 1]; e.g. 0.5.")
    cfg = load_config(args.config) if args.config else from_dict(MODELS[args.preset][1])
    devices = _evaluated_devices(cfg, args) if args.evaluate else args.devices
    node = args.node_size or hw.node_size
    if devices > node and devices % node:
        what = f"--devices {devices}" if args.devices else f"the mesh's {devices} devices"
        raise ConfigError(f"{what} is more than one node of {node} but not a whole number of "
                          f"nodes; give a multiple of {node} (or set --node-size).")
    scale = 1.0 if args.peak_tflops is None else args.peak_tflops * 1e12 / hw.peak_flops
    hw = dataclasses.replace(
        hw, node_size=node,
        memory_bytes=hw.memory_bytes if args.device_memory is None else parse_bytes(args.device_memory),
        peak_flops=hw.peak_flops * scale, peak_flops_fp32=hw.peak_flops_fp32 * scale,
        intra_node_bw=hw.intra_node_bw if args.intra_node_bw is None else args.intra_node_bw * 1e9,
        inter_node_bw=hw.inter_node_bw if args.inter_node_bw is None else args.inter_node_bw * 1e9)
    over = {}
    if args.global_batch:
        over["train"] = {"global_batch": args.global_batch}
    if args.seq_len:
        over["model"] = {"seq_len": args.seq_len}
    if over:
        cfg = cfg.replace(**over)
    # The planner chooses the layout (--evaluate: costs the file's): where it runs is --platform.
    cfg = cfg.replace(runtime={"cpu_devices": cfg.runtime.cpu_devices if args.platform == "cpu" else None})
    return cfg, Roofline(hw, args.compute_efficiency, devices, args.collective_matmul), devices


def _evaluated_devices(cfg: Config, args) -> int:
    """The device count of the layout --evaluate costs: the product of the config's mesh, an axis of
    -1 filled from --devices or, on --platform cpu without it, from the config's
    `runtime.cpu_devices` (as the run itself fills it)."""
    n = args.devices
    if n is None and -1 in (cfg.mesh.data, cfg.mesh.stage, cfg.mesh.model) and args.platform == "cpu":
        n = cfg.runtime.cpu_devices
    return math.prod(layout_shape(cfg, n))


def main(argv=None) -> int:
    import json
    import sys

    jax.config.update("jax_platforms", "cpu")  # the planner only traces: never take an accelerator
    try:
        args = _parser().parse_args(argv)
        cfg, roof, devices = _inputs(args)
        if args.evaluate:
            est = evaluate(cfg, roof, args.platform, devices)
        else:
            if args.memory_wall and not args.json:
                print_wall(cfg, args, roof)
            # --json estimates every layout that might fit unless given --top (the step-time floor's
            # skip keeps only the first --top rows exact): those rows are the same either way.
            result = plan(cfg, devices, roof, args.platform, keep=args.top if args.json else args.top or 10)
            if not result.ranked:
                if result.too_big:
                    raise JaxparError(
                        f"{cfg.model.arch} with {describe_params(cfg.model)} fits in no layout of {devices} x "
                        f"{_human(roof.hardware.memory_bytes)}: the smallest "
                        + _too_big(result.too_big[0], roof.hardware)
                        + "; the search tried every ZeRO stage, remat policy and microbatch count these devices "
                        "allow, so what is left is " + _fixes(result.too_big[0], roof.hardware) + ".")
                raise JaxparError(f"no layout of {devices} devices passes jaxpar's validation ("
                                  + "; ".join(f"{k} x{n}" for k, n in list(result.refused.items())[:3])
                                  + "); change --devices or --global-batch.")
            if args.write_config:
                _write_config(result.ranked[0].cfg, args.write_config)
    except JaxparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(est.to_dict() if args.evaluate else to_json(result)))
    elif args.evaluate:
        print_evaluation(cfg, roof, args, est)
    else:
        print_report(cfg, roof, args, result)
    return 0
