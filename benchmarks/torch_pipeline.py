"""jaxpar's pipeline against PyTorch's `torch.distributed.pipelining`, same model, same cores.

    python benchmarks/torch_pipeline.py [--microbatches 4 8 16] [--schedules 1f1b gpipe] [--rounds 20]
        [--warmup 2] [--mem-steps 2] [--torch-threads 4] [--jaxpar-pool N] [--quick] [--out FILE.json]
    python benchmarks/torch_pipeline.py --render FILE.json     # rewrite FILE.md from FILE.json

The model, in both frameworks: llama, 8 layers, d_model 256, 8 heads (8 kv heads: plain multi-head
attention), d_ff 704, vocab 1024, seq_len 128, float32, AdamW (b1 0.9, b2 0.95, eps 1e-8, weight
decay 0.1 on matrices and embeddings only), global-norm gradient clipping at 1.0, no
rematerialisation. A microbatch is 2 sequences; a step of m microbatches is 2·m sequences.

Four programs, each in its own process(es), all alive at once and each compiled / warmed up
before any timing (the torch model and workers are in `torch_llama.py`):

- torch pipe: `torch.distributed.pipelining`, 4 gloo processes on this machine (MASTER_ADDR
  127.0.0.1), `torch.set_num_threads(1)` each; rank s holds layers [2s, 2s+2) in a manual
  `PipelineStage` (rank 0 also the embedding, rank 3 the final norm and the head), run by
  `Schedule1F1B` or `ScheduleGPipe` (`scale_grads=True` with a mean cross-entropy per microbatch:
  the mean over the step's tokens); then the gradient's global norm (one all-reduce of the 4
  stages' sums of squares), clipping and `torch.optim.AdamW` on each rank.
- jaxpar pipe: `jaxpar.train.step.build` on mesh (data 1, stage 4, model 1) over 4 simulated CPU
  devices (`jaxpar.mesh.use_cpu_devices(4, cfg)`), `parallel.schedule` from `--schedules`,
  `parallel.microbatches` = m, `parallel.remat: none`; jaxpar's own step (clipping, NaN check,
  warmup-cosine AdamW), AOT-compiled. A schedule that jaxpar's config validation refuses (e.g.
  `zb_h1` before it exists) is skipped with the reason printed and recorded.
- torch unpipelined: the same model as one module in one process, `torch.set_num_threads(N)`
  (`--torch-threads`, default 4: the 4 devices' worth of threads the other programs use; every
  step on the 2·m sequences at once, loss.backward, `clip_grad_norm_`, AdamW). A single process
  rather than DDP over 4 gloo processes: DDP would add a 28 MB gradient all-reduce through
  loopback TCP that no pipeline pays, while jaxpar's data-parallel all-reduce stays in one
  process; the plain step is the work each framework's pipeline is measured against.
- jaxpar unpipelined: the same jaxpar config on mesh (data 4, stage 1, model 1), ZeRO-0, one
  microbatch of 2·m sequences (m/2 per device), remat none.

torch pipe and its unpipelined step get the same tokens per step as jaxpar's (uniform random ids
for torch, jaxpar's synthetic source for jaxpar: the cost does not depend on the values). A check
before timing loads jaxpar's initial parameters into the torch model and compares the two losses on
one batch (same maths: NeoX-style RoPE halves, RMSNorm eps 1e-5, causal softmax attention).

Timing: every configuration (torch pipe and jaxpar pipe for each schedule and m, and the two
unpipelined steps for each m) takes one step per round, in a fixed order reversed every other
round (ABBA), for `--rounds` rounds, so that all see the same mix of load from other work; a
schedule's torch and jaxpar steps are adjacent in every round. Medians are reported, and the
median of the per-round jaxpar / torch ratios ("paired"). A torch pipe step is timed on rank 0 from
a barrier of the 4 ranks before the step to a barrier after the optimizer step on every rank; a
jaxpar step from dispatch to `jax.block_until_ready` of the new state and metrics, on prebuilt
batches. Process CPU time (user + sys, all threads; summed over the 4 torch ranks) is recorded
beside each and tabled too: when other work shares the cores, the share this run gets changes
from second to second and moves wall time far more than CPU time (both are medians over the same
steps; the CPU figures also count pool threads that spin while they wait). Under such load a
program with more runnable threads also gets more of the cores (jaxpar's pool has 32 threads, the
torch pipeline at most 4 runnable ranks, fewer while stages wait), so the table's note gives the
cores each program kept busy (CPU s / wall s): wall-time ratios taken under load are not those of
an idle machine.

Memory, after the timed rounds, on `--mem-steps` extra steps per configuration (not timed): glibc's
free memory is returned with `malloc_trim(0)`, the peak-RSS mark is reset (`echo 5 >
/proc/self/clear_refs`, so VmHWM = VmRSS), VmRSS is read, one step runs, and the growth is VmHWM
minus that VmRSS (the max over the steps). For torch this is each rank's own process, i.e. one
stage ("torch peak RSS growth per stage"; the table shows the largest rank and the sum of the 4).
For jaxpar the process holds all 4 simulated devices, so its growth is the whole pipeline's
("jaxpar process RSS growth"); per device the table gives XLA's plan,
`compiled.memory_analysis().temp_size_in_bytes` ("jaxpar temp per device"), which is what one
stage's device would hold beyond its arguments. Without the trim a step after warm-up grows RSS by
little, since glibc keeps freed pages (those figures are recorded too, as `rss_growth_untrimmed`).

Writes benchmarks/results/torch_pipeline_cpu.json (and .md beside it) with every step time, the
load average through the run, the machine and the command, and prints the Markdown table.
`--quick` is a smoke run (m = 4, 4 layers, d_model 128, 2 rounds) that writes nothing unless
`--out` is given.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, read_message, say  # noqa: E402,F401  (say: also the workers' of torch_llama, pipeline_work)
P = 4        # pipeline stages = torch ranks = simulated devices
MICRO = 2    # sequences per microbatch
SHAPES = {"layers": 8, "d-model": 256, "heads": 8, "kv-heads": 8, "d-ff": 704, "vocab": 1024, "seq": 128}
QUICK = {"layers": 4, "d-model": 128, "heads": 4, "kv-heads": 4, "d-ff": 352, "vocab": 256, "seq": 64}
EPS = 1e-5        # RMSNorm epsilon (jaxpar's default)
INIT_STD = 0.02   # jaxpar's model.init_std
ADAM = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "lr": 3e-3}
CLIP = 1.0
TORCH_OF = {"gpipe": "GPipe"}  # the torch schedule each jaxpar schedule is compared with; others: 1F1B


def torch_schedule_of(schedule: str) -> str:
    return TORCH_OF.get(schedule, "1F1B")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, nargs="+", default=None, metavar="M",
                   help="numbers of microbatches m (default 4 8 16; each >= 4 = p, as Schedule1F1B requires)")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"],
                   help="jaxpar schedules (parallel.schedule), each against torch's Schedule1F1B, or ScheduleGPipe "
                        "for gpipe; one that jaxpar's config refuses is skipped (default: 1f1b gpipe)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds, one step per configuration each (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per configuration after compiling (default 2)")
    p.add_argument("--mem-steps", type=int, default=None, help="untimed memory steps per configuration (default 2)")
    p.add_argument("--torch-threads", type=int, default=4, help="threads of the torch unpipelined step (default 4)")
    p.add_argument("--jaxpar-pool", type=int, default=None,
                   help="PJRT_NPROC for both jaxpar programs (default: as jaxpar.mesh.use_cpu_devices sizes each: 32 "
                        "threads for the pipeline, 4 for ZeRO-0 data parallelism; fewer than jaxpar asks for can "
                        "hang a pipeline)")
    p.add_argument("--attention", default="auto", choices=["auto", "xla_lse", "xla"],
                   help="jaxpar's model.attention (default auto: xla_lse on a CPU)")
    p.add_argument("--no-check", action="store_true", help="skip the torch-vs-jaxpar loss check")
    p.add_argument("--quick", action="store_true", help="smoke run: m = 4, a small model, 2 rounds, nothing written")
    p.add_argument("--render", default=None, metavar="FILE.json",
                   help="only rewrite the .md table of an earlier run's JSON, running nothing")
    p.add_argument("--out", default=None, help="JSON output (default: benchmarks/results/torch_pipeline_cpu.json; "
                                               "the Markdown table goes beside it as .md)")
    for name in SHAPES:
        p.add_argument("--" + name, type=int, default=None, help=f"model shape (default {SHAPES[name]})")
    # worker-side flags (the driver starts the workers)
    p.add_argument("--worker", choices=["jaxpar-pipe", "jaxpar-dp", "torch-pipe", "torch-plain"], default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    for name in SHAPES:
        key = name.replace("-", "_")
        if getattr(args, key) is None:
            setattr(args, key, (QUICK if quick else SHAPES)[name])
    args.microbatches = args.microbatches or ([4] if quick else [4, 8, 16])
    args.rounds = args.rounds if args.rounds is not None else (2 if quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    args.mem_steps = args.mem_steps if args.mem_steps is not None else (1 if quick else 2)
    if args.rounds < 1 or args.warmup < 0 or args.mem_steps < 0 or min(args.microbatches) < P:
        p.error(f"--rounds must be at least 1, --warmup and --mem-steps at least 0, every m at least {P}")
    if args.layers % P:
        p.error(f"--layers must be a multiple of {P}")
    return args


def shape_flags(args) -> list[str]:
    return [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in SHAPES]


# --------------------------------------------------------------------------------------------
# Memory and output helpers (both frameworks)


def proc_status_kib(*fields: str) -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in fields:
                out[k] = int(v.split()[0])
    return out


def reset_peak_rss() -> int:
    """Reset VmHWM to the current VmRSS; return that VmRSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status_kib("VmRSS")["VmRSS"] * 1024


def peak_rss() -> int:
    return proc_status_kib("VmHWM")["VmHWM"] * 1024


def malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# jaxpar workers


def jaxpar_config(args, m: int, schedule: str | None):
    """The jaxpar config of one configuration: pipelined (schedule given; the V schedules with their
    two chunks per stage) on (1, 4, 1), else
    data-parallel ZeRO-0 on (4, 1, 1); global batch 2·m sequences either way."""
    from jaxpar.config import from_dict, validate

    pipe = schedule is not None
    cfg = from_dict({
        "model": {"arch": "llama", "n_layers": args.layers, "d_model": args.d_model, "n_heads": args.heads,
                  "n_kv_heads": args.kv_heads, "d_ff": args.d_ff, "vocab_size": args.vocab, "seq_len": args.seq,
                  "norm_eps": EPS, "init_std": INIT_STD, "attention": args.attention},
        "mesh": {"data": 1, "stage": P, "model": 1} if pipe else {"data": P, "stage": 1, "model": 1},
        "parallel": ({"schedule": schedule, "microbatches": m, "remat": "none",
                      "virtual_stages": 2 if schedule in ("zb_v", "dualpipe_v") else 1} if pipe
                     else {"zero": 0, "microbatches": 1, "remat": "none"}),
        "train": {"global_batch": MICRO * m, "grad_clip": CLIP, "b1": ADAM["betas"][0], "b2": ADAM["betas"][1],
                  "weight_decay": ADAM["weight_decay"]},
        "runtime": {"cpu_devices": P},
    })
    validate(cfg)
    return cfg


def jaxpar_keys(args, kind: str) -> tuple[dict, dict]:
    """{key: cfg} of the configurations a jaxpar worker runs, and {key: reason} of those refused."""
    from jaxpar.config import ConfigError

    cfgs, refused = {}, {}
    for m in args.microbatches:
        for s in (args.schedules if kind == "jaxpar-pipe" else [None]):
            key = f"{s}/m{m}" if s else f"m{m}"
            try:
                cfgs[key] = jaxpar_config(args, m, s)
            except ConfigError as e:
                refused[key] = str(e)
    return cfgs, refused


def jaxpar_worker(args) -> int:
    kind = args.worker
    cfgs, refused = jaxpar_keys(args, kind)
    if not cfgs:
        say("ready", configs={}, refused=refused)
        return 0
    from jaxpar.mesh import cpu_threads, use_cpu_devices

    use_cpu_devices(P, next(iter(cfgs.values())))  # the pool this kind of step needs, before JAX starts
    import jax
    import numpy as np
    from jaxpar.train.data import batch_at, make_source
    from jaxpar.train.step import build, loss_fn
    from common import machine_info

    progs, info = {}, {}
    n_batches = args.warmup + args.rounds + args.mem_steps + 1
    for key, cfg in cfgs.items():
        program = build(cfg)
        t = time.perf_counter()
        compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
        compile_s = time.perf_counter() - t
        mem = compiled.memory_analysis()
        source = make_source(cfg)
        batches = [batch_at(source, k, cfg.train.global_batch, program.batch_sharding) for k in range(n_batches)]
        state = program.init(jax.random.key(cfg.train.seed))
        jax.block_until_ready((state, batches))
        for k in range(args.warmup):
            state, metrics = compiled(state, batches[k])
        jax.block_until_ready(state)
        progs[key] = {"cfg": cfg, "program": program, "compiled": compiled, "state": state, "batches": batches,
                      "next": args.warmup}
        info[key] = {"compile_s": compile_s, "temp_bytes": int(mem.temp_size_in_bytes),
                     "argument_bytes": int(mem.argument_size_in_bytes),
                     "output_bytes": int(mem.output_size_in_bytes)}
        print(f"[{kind}] {key}: compiled in {compile_s:.1f} s, temp {mem.temp_size_in_bytes / 2**20:.1f} MiB",
              file=sys.stderr, flush=True)
    say("ready", configs=info, refused=refused, machine=machine_info(),
        pool_threads=max(cpu_threads(), jax.local_device_count()), PJRT_NPROC=os.environ.get("PJRT_NPROC"))

    def one_step(pr):
        b = pr["batches"][pr["next"] % len(pr["batches"])]
        pr["next"] += 1
        pr["state"], metrics = pr["compiled"](pr["state"], b)
        jax.block_until_ready((pr["state"], metrics))
        return metrics

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        pr = progs[cmd["key"]]
        if cmd["cmd"] == "step":
            rss0 = reset_peak_rss()
            t, c = time.perf_counter(), time.process_time()
            metrics = one_step(pr)
            s, cpu = time.perf_counter() - t, time.process_time() - c
            say("step", s=s, cpu_s=cpu, rss_growth_untrimmed=peak_rss() - rss0, loss=float(metrics["loss"]))
        elif cmd["cmd"] == "mem":
            malloc_trim()
            rss0 = reset_peak_rss()
            one_step(pr)
            say("mem", rss_growth=peak_rss() - rss0, rss_before=rss0)
        elif cmd["cmd"] == "dump":  # initial parameters and one batch, for the torch loss check
            cfg, program = pr["cfg"], pr["program"]
            params = jax.tree.map(np.asarray, program.init(jax.random.key(cfg.train.seed)).params)
            batch = np.asarray(pr["batches"][0])
            loss = float(jax.jit(lambda p, b: loss_fn(cfg, p, b))(params, batch))
            flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
                    for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
            np.savez(cmd["path"], batch=batch, **flat)
            say("dump", loss=loss, path=cmd["path"])
    return 0


# --------------------------------------------------------------------------------------------
# Driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """A worker process (for torch pipe: rank 0 of 4, the other ranks started beside it)."""

    def __init__(self, kind: str, args):
        base = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--microbatches",
                *map(str, args.microbatches), "--schedules", *args.schedules, "--rounds", str(args.rounds),
                "--warmup", str(args.warmup), "--mem-steps", str(args.mem_steps),
                "--torch-threads", str(args.torch_threads), "--attention", args.attention, *shape_flags(args)]
        env = dict(os.environ)
        repo = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([repo] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        for var in ("PJRT_NPROC", "NPROC", "XLA_FLAGS"):
            env.pop(var, None)
        if kind.startswith("jaxpar") and args.jaxpar_pool:
            env["PJRT_NPROC"] = str(args.jaxpar_pool)  # use_cpu_devices keeps a PJRT_NPROC already set
        self.kind, self.others = kind, []
        if kind.startswith("torch"):
            n = "1" if kind == "torch-pipe" else str(args.torch_threads)
            env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n)
        if kind == "torch-pipe":
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(P))
            for r in range(1, P):
                self.others.append(subprocess.Popen(base + ["--rank", str(r)], stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.DEVNULL, env=dict(env, RANK=str(r))))
            env["RANK"] = "0"
        self.proc = subprocess.Popen(base + ["--rank", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def read(self, kind: str) -> dict:
        return read_message(self.proc, self.kind, kind)

    def ask(self, reply: str, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read(reply)

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        for p in [self.proc] + self.others:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def mib(x: float | None) -> str:
    return "—" if x is None else f"{x / 2**20:.1f}"


def cores(rows: list[dict], plain: dict) -> str:
    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs)
    us = list(plain.values())
    return ", ".join([
        f"torch pipe {mean(r['torch_cpu_s'] / r['torch_median_s'] for r in rows):.2f}",
        f"jaxpar pipe {mean(r['jaxpar_cpu_s'] / r['jaxpar_median_s'] for r in rows):.2f}",
        f"torch unpipelined {mean(u['torch_cpu_s'] / u['torch_median_s'] for u in us):.2f}",
        f"jaxpar unpipelined {mean(u['jaxpar_cpu_s'] / u['jaxpar_median_s'] for u in us):.2f}"])


def render(path: str) -> int:
    """Rewrite the Markdown table of a results JSON (after a change to the table's layout)."""
    r = json.loads(Path(path).read_text())
    a = argparse.Namespace(**{k: r["model"][k] for k in (x.replace("-", "_") for x in SHAPES)}, rounds=r["rounds"],
                           warmup=r["warmup"], mem_steps=r["mem_steps"], torch_threads=r["torch_threads_unpipelined"])
    table = markdown(r["rows"], r["unpipelined"], a, r["machine"], dict(r["loadavg"], torch_version=r["torch_version"]),
                     r["command"], r.get("jaxpar_pool_threads"))
    Path(path).with_suffix(".md").write_text("# jaxpar's pipeline against torch.distributed.pipelining (CPU)\n\n"
                                             + table)
    print(table)
    return 0


def markdown(rows: list[dict], plain: dict, args, machine: dict, load: dict, command: str,
             pools: dict | None = None) -> str:
    head = ["jaxpar schedule (torch)", "m", "torch pipe s", "jaxpar pipe s", "jaxpar / torch (paired)", "torch unpipelined s",
            "jaxpar unpipelined s", "torch pipe / unpipelined", "jaxpar pipe / unpipelined",
            "torch peak RSS growth MiB, max stage (sum of 4)", "jaxpar temp MiB per device (XLA)",
            "jaxpar process RSS growth MiB (4 devices)"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        u = plain[f"m{r['m']}"]
        tp, jp = r["torch_median_s"], r["jaxpar_median_s"]
        tu, ju = u["torch_median_s"], u["jaxpar_median_s"]
        tm = r["torch_rss_growth_per_stage"]
        lines.append("| " + " | ".join([
            f"{r['schedule']} ({r['torch_schedule']})", str(r["m"]), f"{tp:.3f}", f"{jp:.3f}",
            f"{jp / tp:.2f} ({r['jaxpar_over_torch_paired']:.2f})",
            f"{tu:.3f}", f"{ju:.3f}", f"{tp / tu:.2f}", f"{jp / ju:.2f}",
            f"{mib(max(tm))} ({mib(sum(tm))})", mib(r["jaxpar_temp_bytes"]), mib(r["jaxpar_rss_growth"])]) + " |")
    head = ["jaxpar schedule (torch)", "m", "torch pipe CPU s", "jaxpar pipe CPU s", "jaxpar / torch",
            "torch unpipelined CPU s", "jaxpar unpipelined CPU s", "torch pipe / unpipelined",
            "jaxpar pipe / unpipelined"]
    lines += ["", "CPU seconds per step (process user + sys, all threads; the 4 torch ranks summed), medians of the "
              "same steps:", "", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        u = plain[f"m{r['m']}"]
        tp, jp, tu, ju = r["torch_cpu_s"], r["jaxpar_cpu_s"], u["torch_cpu_s"], u["jaxpar_cpu_s"]
        lines.append("| " + " | ".join([
            f"{r['schedule']} ({r['torch_schedule']})", str(r["m"]), f"{tp:.3f}", f"{jp:.3f}", f"{jp / tp:.2f}",
            f"{tu:.3f}", f"{ju:.3f}", f"{tp / tu:.2f}", f"{jp / ju:.2f}"]) + " |")
    sh = {k: getattr(args, k.replace("-", "_")) for k in SHAPES}
    note = (f"\nModel: llama, {sh['layers']} layers, d_model {sh['d-model']}, {sh['heads']} heads ({sh['kv-heads']} kv), "
            f"d_ff {sh['d-ff']}, vocab {sh['vocab']}, seq {sh['seq']}, float32, AdamW, clip 1.0, remat none; "
            f"microbatches of {MICRO} sequences, p = {P}. torch pipe: 4 gloo processes x 1 thread; torch "
            f"unpipelined: 1 process x {args.torch_threads} threads; jaxpar: 4 simulated CPU devices in one "
            f"process, (1, 4, 1) pipelined, (4, 1, 1) ZeRO-0 unpipelined"
            + (f" (CPU client pools of {pools.get('jaxpar-pipe')} and {pools.get('jaxpar-dp')} threads)" if pools else "")
            + f". Medians of {args.rounds} steps per "
            f"configuration, taken in turns (ABBA rounds) after {args.warmup} warm-up steps; (paired): the median of "
            f"the per-round ratios of the two adjacent pipeline steps. Memory: VmHWM "
            f"growth over one untimed step after malloc_trim (max of {args.mem_steps}); torch per rank = per "
            f"stage, jaxpar per process = all 4 stages; XLA temp = compiled.memory_analysis().temp_size_in_bytes.\n\n"
            f"Measured {machine.get('date')} on {machine.get('cpu_count')} shared CPU cores "
            f"({machine.get('cpu_model')}), jax {machine.get('jax_version')}, torch {load.get('torch_version')}; "
            f"1-minute load average {load['start'][0]:.1f} at the start, median {load['median_1min']:.1f} while "
            f"timing, {load['end'][0]:.1f} at the end. Cores each program kept busy (median CPU s / median wall "
            f"s, mean over the rows): {cores(rows, plain)}; under load a program with more runnable threads "
            f"gets more of the cores, so wall-time ratios taken under load are not those of an idle machine.\n\n"
            f"Command: `{command}`\n")
    return "\n".join(lines) + "\n" + note


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args.render)
    if args.worker in ("jaxpar-pipe", "jaxpar-dp"):
        return jaxpar_worker(args)
    if args.worker in ("torch-plain", "torch-pipe"):
        from torch_llama import torch_pipe_worker, torch_plain_worker
        return (torch_plain_worker if args.worker == "torch-plain" else torch_pipe_worker)(args)
    return drive(args)


def drive(args) -> int:
    import tempfile

    command = " ".join(["python", "benchmarks/torch_pipeline.py"] + sys.argv[1:])
    workers: dict[str, Worker] = {}
    ready: dict[str, dict] = {}
    load = {"start": os.getloadavg()}
    try:
        # One at a time: compiling and warming up on 2 shared cores is slow enough alone.
        for kind in ("jaxpar-pipe", "jaxpar-dp", "torch-plain", "torch-pipe"):
            t = time.perf_counter()
            workers[kind] = Worker(kind, args)
            ready[kind] = workers[kind].read("ready")
            print(f"{kind}: ready in {time.perf_counter() - t:.0f} s", flush=True)
        refused = ready["jaxpar-pipe"]["refused"]
        for key, why in refused.items():
            print(f"skipped jaxpar {key}: {why}", flush=True)
        if ready["jaxpar-dp"]["refused"]:
            raise SystemExit(f"jaxpar's data-parallel config was refused: {ready['jaxpar-dp']['refused']}")

        check = None
        if not args.no_check:
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "params.npz")
                mine = workers["jaxpar-dp"].ask("dump", cmd="dump", key=f"m{args.microbatches[0]}", path=path)
                theirs = workers["torch-plain"].ask("check", cmd="check", path=path)
            check = {"jaxpar_loss": mine["loss"], "torch_loss_of_jaxpar_params": theirs["loss"],
                     "abs_diff": abs(mine["loss"] - theirs["loss"])}
            print(f"loss check on jaxpar's initial parameters: jaxpar {mine['loss']:.6f}, torch {theirs['loss']:.6f}",
                  flush=True)

        pipe_keys = [k for k in ready["jaxpar-pipe"]["configs"]]
        times: dict[tuple, list] = {}
        loads = []
        # Every round takes one step of every configuration (all m), so that each sees the same mix
        # of load from other work; a schedule's torch and jaxpar steps are adjacent in every round.
        entries = []
        for m in args.microbatches:
            for s in args.schedules:
                if f"{s}/m{m}" in pipe_keys:
                    t_entry = ("torch-pipe", f"{torch_schedule_of(s)}/m{m}")
                    if t_entry not in entries:
                        entries.append(t_entry)
                    entries.append(("jaxpar-pipe", f"{s}/m{m}"))
            entries += [("torch-plain", f"m{m}"), ("jaxpar-dp", f"m{m}")]
        for i in range(args.rounds):
            for kind, key in (entries if i % 2 == 0 else entries[::-1]):
                times.setdefault((kind, key), []).append(workers[kind].ask("step", cmd="step", key=key))
            loads.append(os.getloadavg())
            print(f"round {i + 1}/{args.rounds}: load {loads[-1][0]:.1f}", flush=True)
        for m in args.microbatches:
            summary = ", ".join(f"{kind} {key} {statistics.median(x['s'] for x in times[(kind, key)]):.3f} s"
                                for kind, key in entries if key.endswith(f"m{m}"))
            print(f"m={m}: {summary}", flush=True)
        mem: dict[tuple, list] = {}
        for (kind, key) in times:
            mem[(kind, key)] = [workers[kind].ask("mem", cmd="mem", key=key) for _ in range(args.mem_steps)]
        load["end"] = os.getloadavg()
    finally:
        for w in workers.values():
            w.close()
    load["during"] = loads
    load["median_1min"] = statistics.median(x[0] for x in loads)
    load["torch_version"] = ready["torch-pipe"]["torch_version"]

    def med(kind, key):
        return statistics.median(x["s"] for x in times[(kind, key)])

    def cpu(kind, key):
        return statistics.median(x["cpu_s"] for x in times[(kind, key)])

    def growth(kind, key):
        g = [x["rss_growth"] for x in mem.get((kind, key), [])]
        if not g:
            return None
        return [max(col) for col in zip(*g)] if isinstance(g[0], list) else max(g)

    def paired(a, b, field):  # the median of the per-round ratios (the two steps of a round are adjacent)
        return statistics.median(x[field] / y[field] for x, y in zip(times[a], times[b]))

    rows, plain = [], {}
    for m in args.microbatches:
        tk = ("torch-plain", f"m{m}")
        jk = ("jaxpar-dp", f"m{m}")
        plain[f"m{m}"] = {"m": m, "global_batch": MICRO * m, "torch_median_s": med(*tk), "jaxpar_median_s": med(*jk),
                          "torch_cpu_s": cpu(*tk), "jaxpar_cpu_s": cpu(*jk),
                          "torch_rss_growth": growth(*tk), "jaxpar_rss_growth": growth(*jk),
                          "jaxpar_temp_bytes": ready["jaxpar-dp"]["configs"][f"m{m}"]["temp_bytes"],
                          "torch_step_times_s": [x["s"] for x in times[tk]],
                          "jaxpar_step_times_s": [x["s"] for x in times[jk]],
                          "jaxpar_compile_s": ready["jaxpar-dp"]["configs"][f"m{m}"]["compile_s"]}
        for s in args.schedules:
            key = f"{s}/m{m}"
            if key not in pipe_keys:
                continue
            ts = f"{torch_schedule_of(s)}/m{m}"
            tk, jk = ("torch-pipe", ts), ("jaxpar-pipe", key)
            jc = ready["jaxpar-pipe"]["configs"][key]
            rows.append({
                "schedule": s, "torch_schedule": ready["torch-pipe"]["schedules"][ts], "m": m,
                "global_batch": MICRO * m, "torch_median_s": med(*tk), "jaxpar_median_s": med(*jk),
                "jaxpar_over_torch": med(*jk) / med(*tk),
                "jaxpar_over_torch_paired": paired(jk, tk, "s"), "jaxpar_over_torch_cpu_paired": paired(jk, tk, "cpu_s"),
                "torch_pipe_over_unpipelined": med(*tk) / plain[f"m{m}"]["torch_median_s"],
                "jaxpar_pipe_over_unpipelined": med(*jk) / plain[f"m{m}"]["jaxpar_median_s"],
                "torch_cpu_s": cpu(*tk), "jaxpar_cpu_s": cpu(*jk),
                "torch_rss_growth_per_stage": growth(*tk), "jaxpar_rss_growth": growth(*jk),
                "jaxpar_temp_bytes": jc["temp_bytes"], "jaxpar_argument_bytes": jc["argument_bytes"],
                "jaxpar_compile_s": jc["compile_s"],
                "torch_rss_growth_untrimmed_median": [statistics.median(c) for c in
                                                      zip(*(x["rss_growth_untrimmed"] for x in times[tk]))],
                "jaxpar_rss_growth_untrimmed_median": statistics.median(x["rss_growth_untrimmed"] for x in times[jk]),
                "torch_step_times_s": [x["s"] for x in times[tk]], "jaxpar_step_times_s": [x["s"] for x in times[jk]],
                "torch_last_loss": times[tk][-1]["loss"], "jaxpar_last_loss": times[jk][-1]["loss"]})

    machine = ready["jaxpar-pipe"].get("machine") or ready["jaxpar-dp"]["machine"]
    table = markdown(rows, plain, args, machine, load, command,
                     {k: ready[k].get("pool_threads") for k in ("jaxpar-pipe", "jaxpar-dp")})
    print(table)
    result = {
        "benchmark": "torch_pipeline", "date": machine["date"], "command": command, "machine": machine,
        "torch_version": load["torch_version"],
        "model": {"arch": "llama", **{k.replace("-", "_"): getattr(args, k.replace("-", "_")) for k in SHAPES},
                  "norm_eps": EPS, "dtype": "float32"},
        "microbatch_sequences": MICRO, "stages": P, "rounds": args.rounds, "warmup": args.warmup,
        "mem_steps": args.mem_steps, "torch_threads_unpipelined": args.torch_threads,
        "jaxpar_pool_threads": {k: ready[k].get("pool_threads") for k in ("jaxpar-pipe", "jaxpar-dp")},
        "jaxpar_pool_flag": args.jaxpar_pool,
        "refused": refused, "loss_check": check,
        "timing": ("configurations taken in turns, one step each per round, order reversed every other round; "
                   "torch pipe: rank 0, barrier to barrier around the pipeline step + clipping + AdamW on every rank; "
                   "torch unpipelined: forward to optimizer step; jaxpar: dispatch to block_until_ready, prebuilt "
                   "batches"),
        "memory": ("untimed steps after the timed rounds: malloc_trim(0), VmHWM reset through /proc/self/clear_refs, "
                   "growth = VmHWM after the step - VmRSS before it (max over mem_steps); torch pipe per rank "
                   "(= per stage), jaxpar per process (all 4 simulated devices); jaxpar temp bytes per device from "
                   "compiled.memory_analysis(); *_untrimmed: the same growth during the timed steps, no trim"),
        "loadavg": load, "rows": rows, "unpipelined": plain,
    }
    if args.out or not args.quick:
        out = Path(args.out) if args.out else RESULTS / "torch_pipeline_cpu.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text("# jaxpar's pipeline against torch.distributed.pipelining (CPU)\n\n" + table)
        print(f"-> {out}, {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
