"""The unpipelined train step on one CPU thread: jaxpar on one device against torch, same model.

    python benchmarks/one_thread.py [--sequences 16] [--steps 10] [--rounds 2] [--attention auto|xla_lse|xla]
        [--out FILE.json]

`torch_pipeline.py`'s model (llama, 8 layers, d_model 256, 8 heads, d_ff 704, vocab 1024, seq 128,
float32, AdamW, clipping at 1.0, `remat: none`), one step on `--sequences` sequences (16: the
pipeline benchmark's m = 8). jaxpar: `jaxpar.train.step.build` on mesh (1, 1, 1), one device of an
XLA:CPU client with one thread (PJRT_NPROC=1); torch: one process, `torch.set_num_threads(1)`.
Each in its own process, `--rounds` times alternated; per step the process CPU time (user + sys),
the median of `--steps` steps after two warm-up steps, and the median over rounds. One thread on
each side takes the thread pools out of the comparison: what is left is each framework's code for
the same step. Writes benchmarks/results/one_thread_cpu.json and prints the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def worker(which: str, sequences: int, steps: int, attention: str) -> list[float]:
    """CPU seconds of each of `steps` steps after two warm-up steps, in this process."""
    from torch_pipeline import MICRO, parse_args

    args = parse_args(["--attention", attention])
    m = sequences // MICRO
    if which == "jaxpar":
        os.environ["PJRT_NPROC"] = "1"
        from torch_pipeline import jaxpar_config

        from jaxpar.config import from_dict, validate
        d = dataclasses.asdict(jaxpar_config(args, m, None))
        d["mesh"] = {"data": 1, "stage": 1, "model": 1}
        d["runtime"]["cpu_devices"] = 1
        cfg = from_dict(d)
        validate(cfg)
        from jaxpar.mesh import use_cpu_devices
        use_cpu_devices(1, cfg)
        import jax

        from jaxpar.train.data import batch_at, make_source
        from jaxpar.train.step import build
        program = build(cfg)
        compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
        source = make_source(cfg)
        batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(steps + 2)]
        state = [program.init(jax.random.key(0))]

        def step(k):
            state[0], metrics = compiled(state[0], batches[k])
            jax.block_until_ready((state[0], metrics))
    else:
        import torch
        torch.set_num_threads(1)
        from torch_llama import CLIP, torch_adamw, torch_batches, torch_loss, torch_model_classes
        model = torch_model_classes()(args)
        opt = torch_adamw(model)
        batches = torch_batches(args, m, steps + 2)

        def step(k):
            tok = batches[k]
            opt.zero_grad(set_to_none=True)
            torch_loss(model(tok[:, :-1]), tok[:, 1:]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
    step(0)
    step(1)
    out = []
    for k in range(2, steps + 2):
        c = time.process_time()
        step(k)
        out.append(time.process_time() - c)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--attention", default="auto", choices=["auto", "xla_lse", "xla"])
    p.add_argument("--out", default=str(HERE / "results" / "one_thread_cpu.json"))
    p.add_argument("--worker", choices=["jaxpar", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.sequences, args.steps, args.attention)))
        return 0
    runs = {"jaxpar": [], "torch": []}
    for r in range(args.rounds):
        for which in (["jaxpar", "torch"] if r % 2 == 0 else ["torch", "jaxpar"]):
            out = subprocess.run([sys.executable, __file__, "--worker", which, "--sequences", str(args.sequences),
                                  "--steps", str(args.steps), "--attention", args.attention],
                                 check=True, capture_output=True, text=True).stdout
            runs[which].append(statistics.median(json.loads(out.strip().splitlines()[-1])))
            print(f"round {r + 1}: {which} {runs[which][-1]:.3f} CPU s per step", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    from common import machine_info
    import torch
    result = {"benchmark": "one_thread", "command": "python benchmarks/one_thread.py " + " ".join(argv),
              "machine": machine_info(), "torch_version": torch.__version__, "sequences": args.sequences,
              "steps": args.steps, "rounds": args.rounds, "attention": args.attention,
              "cpu_s_per_step": med, "runs": runs, "ratio_jaxpar_over_torch": med["jaxpar"] / med["torch"]}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"jaxpar {med['jaxpar']:.3f}, torch {med['torch']:.3f} CPU s per step on one thread: "
          f"{result['ratio_jaxpar_over_torch']:.2f}x ({args.sequences} sequences, attention {args.attention}; "
          f"{result['machine']['cpu_model']}, jax {result['machine']['jax_version']}, torch {torch.__version__})")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
