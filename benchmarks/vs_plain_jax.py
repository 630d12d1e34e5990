"""jaxpar's train step against a hand-written plain-JAX step of the same model (the peer).

    python benchmarks/vs_plain_jax.py PEER.py [--pools default 8 64] [--steps 20] [--warmup 3] [--baseline REPO]

PEER.py is a plain-JAX Llama training script in the style of `plain_jax_llama.py`: argparse flags
`--devices --layers --d-model --heads --kv-heads --d-ff --vocab --seq --batch`, then module-level
definitions up to a jitted `step(params, state, tokens)`, then its own timing loop. Its
definitions (every top-level statement up to and including `def step`) are run here with those
flags; its timing loop is not. Both programs run on the same shapes (default: 8 layers, d_model
256, GQA 8/4, d_ff 704, vocab 1024, seq 128, batch 32) on 8 simulated CPU devices, jaxpar with its
own defaults (ZeRO-0 data parallelism over all devices, AdamW with warmup-cosine, weight decay mask,
clipping at 1.0, NaN skip, donated state) and the peer's RMSNorm eps.

Each program runs in its own worker process (a thread-pool size is per process: `PJRT_NPROC` is
read when XLA's CPU client starts), compiled and warmed up before any timing. For each pool
setting the driver then alternates single timed steps between the two workers (ABBA order), so
both see the same machine load; each step is timed from dispatch to `block_until_ready` of all of
its outputs, on batches built before the clock starts (and its process CPU time, all threads, is
recorded beside it). `--baseline REPO` adds the jaxpar of another checkout as a third worker, so a
change is measured before and after in one invocation. Pool settings: `default` (each program as it
starts by itself: jaxpar's `use_cpu_devices`, the peer with XLA's own pool) or a number N (both
with PJRT_NPROC=N).

Before timing, the jaxpar worker checks that both compute the same model: it maps the peer's
initial parameters onto jaxpar's tree (RoPE's interleaved pairs permuted to jaxpar's halves) and
compares the two loss functions on one batch. It also records, for both compiled steps, XLA's cost
analysis and a count of the collectives, copies and fusions in the HLO (the static profile).

Writes benchmarks/results/vs_plain_jax_cpu.json (or --out) and prints one line per pool setting.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, read_message, say  # noqa: E402
SHAPES = {"devices": 8, "layers": 8, "d-model": 256, "heads": 8, "kv-heads": 4, "d-ff": 704, "vocab": 1024,
          "seq": 128, "batch": 32}
PEER_EPS = 1e-6  # plain_jax_llama.py's RMSNorm epsilon (jaxpar's default is 1e-5)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("peer", help="path of the plain-JAX peer script (e.g. ../shared/peers/plain_jax_llama.py)")
    p.add_argument("--pools", nargs="+", default=["default", "8", "64"],
                   help="thread-pool settings to compare: 'default' (each program's own) or N (PJRT_NPROC=N "
                        "for both); default: default 8 64")
    p.add_argument("--steps", type=int, default=20, help="timed steps per program and pool (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling (default 3)")
    p.add_argument("--out", default=None, help="JSON output (default: benchmarks/results/vs_plain_jax_cpu.json)")
    for name, default in SHAPES.items():
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--baseline", default=None, metavar="REPO",
                   help="also time the jaxpar of another checkout (e.g. the commit before a change), alternated "
                        "with the other two")
    p.add_argument("--worker", choices=["jaxpar", "peer"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return args


# --------------------------------------------------------------------------------------------
# Worker side (one program per process)


def peer_namespace(args: argparse.Namespace) -> dict:
    """The peer's module-level definitions, up to and including `def step`, run with our shapes."""
    path = os.path.abspath(args.peer)
    tree = ast.parse(Path(path).read_text(), path)
    body = []
    for stmt in tree.body:
        body.append(stmt)
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "step":
            break
    else:
        raise SystemExit(f"{path}: no top-level `def step` found")
    argv = sys.argv
    sys.argv = [path] + [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in SHAPES]
    ns = {"__name__": "plain_jax_peer", "__file__": path}
    try:
        exec(compile(ast.Module(body, type_ignores=[]), path, "exec"), ns)
    finally:
        sys.argv = argv
    return ns


def jaxpar_config(args: argparse.Namespace):
    from jaxpar.config import from_dict

    return from_dict({
        "model": {"arch": "llama", "n_layers": args.layers, "d_model": args.d_model, "n_heads": args.heads,
                  "n_kv_heads": args.kv_heads, "d_ff": args.d_ff, "vocab_size": args.vocab, "seq_len": args.seq,
                  "norm_eps": PEER_EPS},
        "train": {"global_batch": args.batch},
        "mesh": {"data": -1},
        "runtime": {"cpu_devices": args.devices},
    })


def static_profile(compiled) -> dict:
    """XLA's cost analysis of one device's program and what its HLO holds (loop bodies counted once)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    ops = re.findall(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9-]*)\(", text, re.M)
    count = lambda name: sum(1 for o in ops if o == name)  # noqa: E731
    entry = [c for c in re.split(r"\n(?=\S)", text) if c.startswith("ENTRY")][0]
    # Copies of whole entry parameters (f32 state): what a donated in-place update should not need.
    param_copies = len(re.findall(r"= f32\[[0-9,]+\]\S* copy\(%param", entry))
    return {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
            "transcendentals": cost.get("transcendentals"),
            "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes,
            "hlo_ops": {k: count(k) for k in ("fusion", "copy", "all-reduce", "all-gather", "reduce-scatter",
                                              "while", "conditional", "dot", "select")},
            "entry_param_copies": param_copies}


def _rope_perm(head_dim: int):
    """Columns of a q/k projection taking the peer's interleaved RoPE pairs (2i, 2i+1) to jaxpar's
    halves (i, i + H/2): the same rotation of the same values, so the same attention scores."""
    import numpy as np
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def peer_params_as_jaxpar(p: dict, like: dict) -> dict:
    import jax
    import numpy as np

    perm = _rope_perm(p["layers"]["wq"].shape[-1])
    lay = p["layers"]
    mapped = {
        "embed": p["emb"], "lm_head": p["out"], "final_norm": {"scale": p["norm"]},
        "blocks": {"attn_norm": {"scale": lay["ln1"]}, "mlp_norm": {"scale": lay["ln2"]},
                   "attn": {"wq": lay["wq"][..., perm], "wk": lay["wk"][..., perm], "wv": lay["wv"], "wo": lay["wo"]},
                   "mlp": {"w_gate": lay["wg"], "w_up": lay["wu"], "w_down": lay["wd"]}},
    }
    mapped = jax.tree.map(np.asarray, mapped)
    if jax.tree.structure(mapped) != jax.tree.structure(like):
        raise SystemExit(f"parameter trees differ: {jax.tree.structure(mapped)} vs {jax.tree.structure(like)}")
    return mapped


def worker(args: argparse.Namespace) -> int:
    import numpy as np

    if args.worker == "jaxpar":
        from jaxpar.mesh import cpu_threads, use_cpu_devices
        cfg = jaxpar_config(args)
        try:
            use_cpu_devices(cfg.runtime.cpu_devices, cfg)
        except TypeError:  # a jaxpar from before the pool was sized per config (--baseline)
            use_cpu_devices(cfg.runtime.cpu_devices)
    else:
        # On simulated CPU devices the peer's process keeps freed memory as jaxpar's does
        # (`runtime.cpu_malloc: keep`): the comparison is of the two steps' programs, not of
        # glibc's treatment of their buffers.
        try:
            from jaxpar.mesh import keep_freed_memory
        except ImportError:  # a jaxpar from before it (--baseline)
            keep_freed_memory = None
        rt = jaxpar_config(args).runtime
        if keep_freed_memory is not None and rt.cpu_devices is not None and rt.cpu_malloc == "keep":
            keep_freed_memory()
    import jax
    import jax.numpy as jnp

    if args.worker == "peer":
        ns = peer_namespace(args)
        state = (ns["params"], ns["state"])
        sharding = ns["bat"]
        batch_shape = jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32, sharding=sharding)
        compiled = ns["step"].lower(*state, batch_shape).compile()

        def run(state, batch):
            params, opt_state, loss = compiled(*state, batch)
            return (params, opt_state), loss
    else:
        from jaxpar.train.step import build, loss_fn
        from common import machine_info
        program = build(cfg)
        sharding = program.batch_sharding
        compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
        state = program.init(jax.random.key(0))

        def run(state, batch):
            state, metrics = compiled(state, batch)
            return state, metrics["loss"]

    rng = np.random.default_rng(0)
    batches = [jax.device_put(jnp.asarray(rng.integers(0, args.vocab, (args.batch, args.seq + 1)), jnp.int32),
                              sharding) for _ in range(args.warmup + args.steps)]
    info = {"program": args.worker, "PJRT_NPROC": os.environ.get("PJRT_NPROC"),
            "devices": jax.device_count(), "profile": static_profile(compiled)}
    if args.worker == "jaxpar":
        info["pool_threads"] = max(cpu_threads(), jax.local_device_count())
        info["machine"] = machine_info()
        # Same model maths: the peer's initial parameters in jaxpar's tree, both losses on one batch.
        ns = peer_namespace(args)
        mapped = peer_params_as_jaxpar(ns["params"], jax.tree.map(lambda x: x, program.abstract_state().params))
        mine = jax.jit(lambda p, b: loss_fn(cfg, p, b))(mapped, np.asarray(batches[0]))
        theirs = jax.jit(ns["loss_fn"])(ns["params"], np.asarray(batches[0]))
        info["loss_check"] = {"jaxpar_loss_of_peer_params": float(mine), "peer_loss": float(theirs),
                              "abs_diff": abs(float(mine) - float(theirs))}
    else:
        info["pool_threads"] = max(int(os.environ.get("PJRT_NPROC") or os.cpu_count() or 1), jax.local_device_count())
    jax.block_until_ready((state, batches))
    for b in batches[:args.warmup]:
        state, loss = run(state, b)
    jax.block_until_ready(state)
    info["first_loss"] = float(loss) if args.warmup else None
    say("ready", **info)
    k = args.warmup
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t, c = time.perf_counter(), time.process_time()
        state, loss = run(state, batches[k])
        jax.block_until_ready((state, loss))
        say("time", s=time.perf_counter() - t, cpu_s=time.process_time() - c, loss=float(loss))
        k += 1
    return 0


# --------------------------------------------------------------------------------------------
# Driver side


class Worker:
    def __init__(self, program: str, pool: str, args: argparse.Namespace, repo: str | None = None,
                 name: str | None = None):
        env = dict(os.environ)
        for var in ("PJRT_NPROC", "NPROC"):
            env.pop(var, None)
        if pool != "default":
            env["PJRT_NPROC"] = pool
        repo = str(Path(repo or Path(__file__).resolve().parent.parent).resolve())
        env["PYTHONPATH"] = os.pathsep.join([repo, str(Path(__file__).resolve().parent)] +
                                            ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [sys.executable, __file__, args.peer, "--worker", program, "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in SHAPES]
        self.name = name or program
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def read(self, kind: str) -> dict:
        return read_message(self.proc, self.name, kind)

    def step(self) -> dict:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self.read("time")

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=120)


def compare(pool: str, args: argparse.Namespace) -> dict:
    workers = [Worker("jaxpar", pool, args), Worker("peer", pool, args)]
    if args.baseline:
        workers.append(Worker("jaxpar", pool, args, repo=args.baseline, name="baseline"))
    try:
        ready = {w.name: w.read("ready") for w in workers}
        times = {w.name: [] for w in workers}
        cpu = {w.name: [] for w in workers}
        losses = {w.name: [] for w in workers}
        load = [os.getloadavg()]
        for i in range(args.steps):
            for w in (workers if i % 2 == 0 else workers[::-1]):  # ABBA: none always goes first
                msg = w.step()
                times[w.name].append(msg["s"])
                cpu[w.name].append(msg["cpu_s"])
                losses[w.name].append(msg["loss"])
            load.append(os.getloadavg())
    finally:
        for w in workers:
            w.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"pool": pool, "median_step_s": med, "ratio_jaxpar_over_peer": med["jaxpar"] / med["peer"],
            **({"ratio_baseline_over_peer": med["baseline"] / med["peer"]} if "baseline" in med else {}),
            "min_step_s": {k: min(v) for k, v in times.items()},
            "paired_ratio_median": {k: statistics.median(a / b for a, b in zip(v, times["peer"]))
                                    for k, v in times.items() if k != "peer"},
            # CPU time of the whole process (all threads) per step: the work done, which other
            # processes' load changes less than wall time (spinning pool threads count in it too).
            "median_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
            "step_times_s": times, "step_cpu_s": cpu,
            "pool_threads": {k: ready[k]["pool_threads"] for k in ready},
            "PJRT_NPROC": {k: ready[k]["PJRT_NPROC"] for k in ready},
            "loadavg_1_5_15": {"start": load[0], "end": load[-1],
                               "median_1min": statistics.median(x[0] for x in load)},
            "last_loss": {k: v[-1] for k, v in losses.items()},
            "ready": ready}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if not Path(args.peer).is_file():
        print(f"error: no peer script at {args.peer}", file=sys.stderr)
        return 2
    rows = []
    for pool in args.pools:
        row = compare(pool, args)
        rows.append(row)
        m = row["median_step_s"]
        print(f"pool {pool:>7} (threads jaxpar {row['pool_threads']['jaxpar']}, peer {row['pool_threads']['peer']}): "
              f"jaxpar {m['jaxpar'] * 1e3:.0f} ms, peer {m['peer'] * 1e3:.0f} ms, ratio "
              f"{row['ratio_jaxpar_over_peer']:.3f}"
              + (f" (baseline {m['baseline'] * 1e3:.0f} ms, ratio {row['ratio_baseline_over_peer']:.3f})"
                 if args.baseline else "")
              + "; CPU s/step " + ", ".join(f"{k} {v:.2f}" for k, v in row["median_cpu_s"].items()) + f", loadavg {row['loadavg_1_5_15']['median_1min']:.1f}", flush=True)
    first = rows[0]["ready"]
    result = {
        "peer": os.path.abspath(args.peer), "shapes": {k: getattr(args, k.replace("-", "_")) for k in SHAPES},
        "steps": args.steps, "warmup": args.warmup, "rows": [{k: v for k, v in r.items() if k != "ready"} for r in rows],
        "loss_check": first["jaxpar"]["loss_check"],
        "static_profile": {k: first[k]["profile"] for k in first},
        "first_loss_after_warmup": {k: first[k]["first_loss"] for k in first},
        "differences": ("same model maths (the loss check); jaxpar: AdamW b2 0.95, weight decay 0.1 on matrices and "
                        "embeddings only, lr warmup 30 + cosine from 3e-3 (lr 0 at step 0), global-norm clipping at "
                        "1.0, NaN skip (train.on_nan=stop), donated state, init std 0.02; peer: optax.adamw(1e-3) "
                        "(b2 0.999, weight decay 1e-4 on every leaf), no clipping, no NaN check, no donation, "
                        "init 1/sqrt(fan_in)"),
        "timing": ("each program in its own process; single steps alternated ABBA between them; each timed from "
                   "dispatch to block_until_ready of all outputs, batches prebuilt; warm-up excluded"),
        "machine": first["jaxpar"]["machine"], "date": datetime.date.today().isoformat(), "command": sys.argv,
    }
    out = Path(args.out) if args.out else RESULTS / "vs_plain_jax_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    lc = result["loss_check"]
    print(f"loss check (peer's initial parameters): jaxpar {lc['jaxpar_loss_of_peer_params']:.6f}, "
          f"peer {lc['peer_loss']:.6f} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
