"""Mixture of experts on simulated CPU devices: expert parallelism, replicated experts, a 3D mesh and the dense model of the same active parameters, side by side; and the grouped expert matmul (jaxpar's, and plain ragged_dot) against a dense per-expert loop.

Part 1, the train step (8 simulated CPU devices by default). One small MoE (llama, `--layers`
layers, d_model 128, 4 heads, vocab 256, seq 128, global batch 16, E = 8 experts of width 128,
top-2, dropless) on
  - `ep`:        mesh (8, 1, 1), experts split over `data` (`parallel.expert_parallel: true`),
  - `replicated`: mesh (8, 1, 1), every rank holds every expert (`parallel.expert_parallel: false`),
  - `3d`:        mesh (2, 2, 2), 1F1B with `--microbatches` microbatches, experts split over `data`
                 (E/2 per rank) and each expert's width over `model`,
  - `ep_replicas`: mesh (8, 1, 1), 4 experts of width 256, top-1 (the same total and active
                 parameters), each expert on 2 data ranks (a 1/8 slice of every expert stored per
                 rank, the rank's own assembled by all-to-all; its ideal bytes include that),
against `dense`: the same model with a dense SwiGLU MLP of the same active width
(d_ff = k x expert_d_ff) on (8, 1, 1). Every program is AOT-compiled first
(`jaxpar.train.step.lower_step`'s recipe) and read with `jaxpar.inspect`: XLA's argument and temp
bytes per device, and the all-to-all result bytes per step over collectives spanning `data`
(`report.traffic(kind="all-to-all", spans="data")`) next to the ideal dropless bytes
(tokens per device x k x d_model x itemsize x 4 all-to-alls per layer x layers per stage: 2 forward
and 2 backward, each moving exactly the token-expert assignments once). Then every program takes
`--steps` timed steps in turns (one step of each per round, the order reversed every other round,
after `--warmup` untimed steps each), each timed from dispatch to `jax.block_until_ready` of its
state and metrics on prebuilt batches; per step also the process's CPU time (user + sys of all
threads, `resource.getrusage`) over the same interval.

Part 2, on one device: the same function three ways, jitted forward + backward (gradients of x
and the three weight stacks), at a few sizes:
  - `grouped`:    `jaxpar.model.moe.experts_dropless` as jaxpar runs it (sorted assignments, three
                  grouped matmuls through `jaxpar.model.moe.grouped`: blockwise on CPU, a scan over
                  each expert's rows padded to blocks of `GROUP_BLOCK`; `jax.lax.ragged_dot` elsewhere),
  - `ragged_dot`: the same with `grouped` replaced by plain `jax.lax.ragged_dot` while it traces (on
                  CPU jax lowers that to one dense dot of every row with every expert),
  - `dense_loop`: every expert's SwiGLU on every token, weighted by the routing gate where the token
                  chose it, zero elsewhere.
The outputs and gradients of the first two are checked equal to `dense_loop`'s before timing;
median of `--micro-reps` calls each, the three alternated (the order reversed every other round).

`--gpu`: both parts on one GPU instead, at sizes a GPU is measured at (bf16 compute). Part 1 runs
`GPU_CASES` on mesh (1, 1, 1): a Mixtral-style MoE (8 experts, top-2), a fine-grained one (64
experts, top-8, OLMoE / Qwen3-MoE style) and the dense model of the same active parameters
(llama, 8 layers, d_model 1024, 16/8 heads, vocab 32768, seq 2048, global batch 4, remat none;
at batch 8 the fine-grained step's 86 GiB of temporaries beside the three programs' states did
not fit an H200),
with model TFLOP/s and MFU counted on the active parameters (`jaxpar.costs.model_flops_per_token`:
the routed experts a token uses, not all). Part 2 checks the three variants equal in float32 at
`highest` matmul precision (the check's tolerance is float32's, not bf16's) and times them in bf16;
the table gives each variant's TFLOP/s on the ideal grouped FLOPs (the FLOPs a dropless MoE needs).

    python benchmarks/moe.py --gpu --out benchmarks/results/moe_h200.json
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, command, compile_step, guarded, load_avg, machine_info, memory_bytes,  # noqa: E402
                    mesh_dict, mib, simulated_cpu, summary, warmed_up, write_result)

# The model (user --set overrides come after these): llama, 8 experts of width 128, top-2.
MODEL = ("model.arch=llama", "model.d_model=128", "model.n_heads=4", "model.vocab_size=256",
         "model.seq_len=128", "train.global_batch=16")
E, K, EXPERT_D_FF = 8, 2, 128
MOE = (f"model.n_experts={E}", f"model.experts_per_token={K}", f"model.expert_d_ff={EXPERT_D_FF}")
# (name, mesh (data, stage, model), overrides)
CASES = (("ep", (8, 1, 1), MOE + ("parallel.expert_parallel=true",)),
         ("replicated", (8, 1, 1), MOE + ("parallel.expert_parallel=false",)),
         ("3d", (2, 2, 2), MOE + ("parallel.expert_parallel=true", "parallel.schedule=1f1b")),
         # The same total and active parameters as 4 experts of twice the width, top-1: 8 data
         # ranks, so each expert on 2 of them (a 1/8 slice of every expert stored per rank).
         ("ep_replicas", (8, 1, 1), ("model.n_experts=4", "model.experts_per_token=1",
                                     f"model.expert_d_ff={2 * EXPERT_D_FF}", "parallel.expert_parallel=true")),
         ("dense", (8, 1, 1), ("model.n_experts=0", f"model.d_ff={K * EXPERT_D_FF}")))
# Micro-benchmark sizes: (tokens, d_model, experts, k, expert width).
MICRO = ((2048, 256, 8, 2, 256), (2048, 256, 16, 2, 128), (4096, 256, 8, 2, 256))
MICRO_QUICK = ((256, 64, 8, 2, 64),)
# --gpu: one device, bf16, the sizes a GPU is measured at. Every MoE case has the active MLP width
# of the dense case (k x expert_d_ff = 5632).
GPU_MODEL = ("model.arch=llama", "model.n_layers=8", "model.d_model=1024", "model.n_heads=16",
             "model.n_kv_heads=8", "model.vocab_size=32768", "model.seq_len=2048", "model.dtype=bfloat16",
             "train.global_batch=4", "parallel.remat=none")
GPU_CASES = (("mixtral_style", (1, 1, 1), ("model.n_experts=8", "model.experts_per_token=2", "model.expert_d_ff=2816")),
             ("fine_grained", (1, 1, 1), ("model.n_experts=64", "model.experts_per_token=8", "model.expert_d_ff=704")),
             ("mixtral_style_pallas", (1, 1, 1), ("model.n_experts=8", "model.experts_per_token=2",
                                                  "model.expert_d_ff=2816", "model.moe_kernel=pallas")),
             ("fine_grained_pallas", (1, 1, 1), ("model.n_experts=64", "model.experts_per_token=8",
                                                 "model.expert_d_ff=704", "model.moe_kernel=pallas")),
             ("dense", (1, 1, 1), ("model.n_experts=0", "model.d_ff=5632")))
GPU_MICRO = ((16384, 1024, 8, 2, 2816), (16384, 1024, 64, 8, 704), (32768, 2048, 8, 2, 5632))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override a config key for every case, e.g. --set model.d_model=256 (repeatable)")
    p.add_argument("--layers", type=int, default=4, help="model.n_layers (default 4)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches of the (2, 2, 2) 1F1B case (default 4)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per case (default 15)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per case after compiling (default 2)")
    p.add_argument("--gpu", action="store_true",
                   help="one GPU, bf16, GPU_CASES and GPU_MICRO instead of 8 simulated CPU devices")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="--gpu: the device's dense bf16 peak for MFU (default: looked up, H200 989)")
    p.add_argument("--hlo-dir", default=None,
                   help="also write each case's compiled program (HLO text) to DIR/<case>.hlo.txt")
    p.add_argument("--cases", default=None,
                   help=f"comma-separated subset of {', '.join(n for n, _, _ in CASES)} "
                        f"(--gpu: {', '.join(n for n, _, _ in GPU_CASES)}; default: all)")
    p.add_argument("--micro-reps", type=int, default=5, help="timed calls per micro-benchmark variant (default 5)")
    p.add_argument("--no-micro", action="store_true", help="skip the one-device micro-benchmark")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 layers, 2 timed steps after 1 warmup, a tiny micro-benchmark; "
                        "writes nothing unless --out is given")
    p.add_argument("--out", default=None, help="JSON output (default: benchmarks/results/moe_cpu.json); "
                                               "the Markdown table goes next to it with suffix .md")
    args = p.parse_args(argv)
    table = GPU_CASES if args.gpu else CASES
    known = {n for n, _, _ in table}
    args.cases = [c.strip() for c in (args.cases or ",".join(n for n, _, _ in table)).split(",") if c.strip()]
    if args.quick:
        args.layers, args.steps, args.warmup, args.micro_reps = 2, 2, 1, 2
    if args.out is None and not args.quick:
        args.out = str(RESULTS / ("moe_gpu.json" if args.gpu else "moe_cpu.json"))
    if (args.steps < 1 or args.warmup < 0 or args.layers < 1 or args.microbatches < 2 or args.micro_reps < 1
            or not args.cases or set(args.cases) - known):
        p.error(f"--steps, --layers, --micro-reps at least 1, --warmup at least 0, --microbatches at least 2, "
                f"--cases among {sorted(known)}")
    return args


def config(name: str, mesh: tuple[int, int, int], overrides: tuple[str, ...], args):
    from jaxpar.config import load_config

    d, p, t = mesh
    mesh_sets = [f"mesh.data={d}", f"mesh.stage={p}", f"mesh.model={t}",
                 f"parallel.microbatches={args.microbatches if p > 1 else 1}"]
    if args.gpu:
        sets = list(GPU_MODEL) + (["model.n_layers=2", "model.seq_len=256"] if args.quick else []) + mesh_sets
    else:
        sets = list(MODEL) + [f"model.n_layers={args.layers}", "runtime.cpu_devices=8"] + mesh_sets
    return load_config(None, sets + list(overrides) + list(args.overrides))


def param_counts(cfg) -> tuple[int, int]:
    """(total parameters, active parameters per token: the routed experts counted k/E)."""
    import jax
    from jaxpar.model import param_shapes

    shapes = param_shapes(cfg.model)
    total = sum(s.size for s in jax.tree.leaves(shapes))
    if not cfg.model.moe:
        return total, total
    mlp = shapes["blocks"]["mlp"]
    routed = sum(mlp[w].size for w in ("w_gate", "w_up", "w_down"))
    m = cfg.model
    return total, total - routed + routed * m.experts_per_token // m.n_experts


def ideal_all_to_all_bytes(cfg) -> int:
    """Dropless ideal per device per step: each of the step's token-expert assignments of this
    data rank sent once to its expert and once back, forward and backward (4 per MoE layer), for
    the layers this device's stage holds."""
    import jax.numpy as jnp

    m, mesh = cfg.model, cfg.mesh
    if not m.moe or mesh.data == 1 or not cfg.parallel.expert_parallel:
        return 0
    tokens = cfg.train.global_batch * m.seq_len // mesh.data
    size = jnp.dtype(m.dtype).itemsize
    out = tokens * m.experts_per_token * m.d_model * size * 4 * (m.n_layers // mesh.stage)
    if mesh.data > m.n_experts:  # replicas: + each rank's expert assembled, 3 weights each way per layer
        out += 6 * m.d_model * m.expert_width * size * (m.n_layers // mesh.stage)
    return out


def measure(name: str, cfg, hlo_dir: str | None = None) -> tuple[dict, tuple]:
    from jaxpar.inspect import analyze
    from jaxpar.train.step import build

    program = build(cfg)
    mesh = program.mesh
    compiled, compile_s = compile_step(program)
    if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        (Path(hlo_dir) / f"{name}.hlo.txt").write_text(compiled.as_text())
    report = analyze(compiled, mesh)
    mem = report.memory
    a2a = report.select(kind="all-to-all", spans="data")
    total, active = param_counts(cfg)
    ideal = ideal_all_to_all_bytes(cfg)
    measured = report.traffic(kind="all-to-all", spans="data")
    return {
        "case": name, "mesh": mesh_dict(mesh),
        "expert_parallel": bool(cfg.model.moe and cfg.parallel.expert_parallel and cfg.mesh.data > 1),
        "schedule": cfg.parallel.schedule if cfg.mesh.stage > 1 else None,
        "microbatches": cfg.parallel.microbatches,
        "params_total": total, "params_active": active,
        "compile_s": compile_s,
        "memory": memory_bytes(mem),
        "all_to_all_data": {
            "bytes_per_step": measured, "ideal_dropless_bytes_per_step": ideal,
            "ratio_to_ideal": measured / ideal if ideal else None,
            "count": len(a2a), "executions": sum(c.executions for c in a2a),
            "executions_known": all(c.executions_known for c in a2a),
            "collectives": [{"bytes": c.bytes, "executions": c.executions, "in_loop": c.in_loop,
                             "axes": list(c.axes), "op_name": c.op_name} for c in a2a]},
        "other_data_collective_bytes_per_step": {
            kind: report.traffic(kind=kind, spans="data")
            for kind in sorted({c.kind for c in report.select(spans="data")} - {"all-to-all"})},
    }, (cfg, program, compiled)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def time_interleaved(runs: list, warmup: int, steps: int) -> list[dict]:
    """Every program's `steps` steps taken in turns (one step of each per round, the order reversed
    every other round), after `warmup` untimed steps each; batches built before the clock starts;
    each step timed (wall and process CPU) from dispatch to `jax.block_until_ready`."""
    import jax

    live = []
    for cfg, program, compiled in runs:
        state, batches = warmed_up(cfg, program, compiled, warmup, steps)
        live.append({"compiled": compiled, "state": state, "batches": batches, "wall": [], "cpu": [],
                     "metrics": None})
    for k in range(steps):
        for run in (live if k % 2 == 0 else live[::-1]):
            c0, t0 = cpu_seconds(), time.perf_counter()
            state, metrics = run["compiled"](run["state"], run["batches"][k])
            jax.block_until_ready((state, metrics))
            run["wall"].append(time.perf_counter() - t0)
            run["cpu"].append(cpu_seconds() - c0)
            run["state"], run["metrics"] = state, metrics
    out = []
    for run in live:
        m = run["metrics"]
        out.append({"wall": run["wall"], "cpu": run["cpu"], "loss": float(m["loss"]),
                    "moe": {k: float(v) for k, v in m.items() if k.startswith("moe_")}})
    return out


# --------------------------------------------------------------------------------------------
# Part 2: the grouped matmul (jaxpar's, plain ragged_dot) against a dense per-expert loop, one device


def experts_dense_loop(x_NxD, experts_NxK, gates_NxK, w_gate, w_up, w_down):
    """Every expert's SwiGLU on every token, weighted by its gate where the token chose it."""
    import jax
    import jax.numpy as jnp

    y = jnp.zeros_like(x_NxD)
    for e in range(w_gate.shape[0]):
        weight = jnp.sum(jnp.where(experts_NxK == e, gates_NxK, 0), axis=-1)  # [N]
        h = jax.nn.silu(x_NxD @ w_gate[e]) * (x_NxD @ w_up[e])
        y = y + weight[:, None] * (h @ w_down[e])
    return y


def experts_ragged_dot(x_NxD, experts_NxK, gates_NxK, w_gate, w_up, w_down):
    """`experts_dropless` with its grouped matmuls as plain `jax.lax.ragged_dot` on every backend
    (`model.moe_kernel: ragged_dot`; what `auto` runs off CPU)."""
    from jaxpar.model.moe import experts_dropless

    return experts_dropless(x_NxD, experts_NxK, gates_NxK, w_gate, w_up, w_down, kernel="ragged_dot")


def experts_pallas(x_NxD, experts_NxK, gates_NxK, w_gate, w_up, w_down):
    """`experts_dropless` with jaxpar's Pallas grouped GEMMs (`model.moe_kernel: pallas`)."""
    from jaxpar.model.moe import experts_dropless

    return experts_dropless(x_NxD, experts_NxK, gates_NxK, w_gate, w_up, w_down, kernel="pallas")


def rows_one_matrix(x_NxD, experts_NxK, gates_NxK, w_gate, w_up, w_down):
    """Not an MoE: the same N*k rows (each token repeated k times) through expert 0's SwiGLU as
    dense GEMMs, the FLOPs of an ideal grouped GEMM: issue 45's "dense GEMM at the same total
    rows" (the grouped GEMMs' target is 70% of its TFLOP/s). Not checked against the loop."""
    import jax
    import jax.numpy as jnp

    k = experts_NxK.shape[1]
    xs = jnp.repeat(x_NxD, k, axis=0)
    h = jax.nn.silu(xs @ w_gate[0]) * (xs @ w_up[0])
    y = (h @ w_down[0]).reshape(x_NxD.shape[0], k, -1)
    return jnp.einsum("nkd,nk->nd", y, gates_NxK)


def micro(sizes, reps: int, dtype: str = "float32") -> list[dict]:
    """Part 2. Checked in float32 (at `highest` matmul precision off CPU, so that a GPU's TF32
    default does not enter the check), timed in `dtype`."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxpar.model.moe import GROUP_BLOCK, experts_dropless

    dev = jax.devices()[0]
    on_cpu = jax.default_backend() == "cpu"
    rows = []
    for n, d, e, k, f in sizes:
        keys = jax.random.split(jax.random.key(0), 6)
        x = jax.random.normal(keys[0], (n, d), jnp.float32)
        logits = jax.random.normal(keys[1], (n, e), jnp.float32)
        gates, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        wg = jax.random.normal(keys[2], (e, d, f), jnp.float32) * d ** -0.5
        wu = jax.random.normal(keys[3], (e, d, f), jnp.float32) * d ** -0.5
        wd = jax.random.normal(keys[4], (e, f, d), jnp.float32) * f ** -0.5
        ct = jax.random.normal(keys[5], (n, d), jnp.float32)
        args32 = jax.device_put((x, experts.astype(jnp.int32), gates, wg, wu, wd, ct), dev)
        cast = (lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a)
        args = args32 if dtype == "float32" else jax.tree.map(cast, args32)

        def fwd_bwd(fn):
            def loss(x, wg, wu, wd, experts, gates, ct):
                y = fn(x, experts, gates, wg, wu, wd)
                return jnp.sum(y * ct), y

            g = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)

            @jax.jit
            def step(x, experts, gates, wg, wu, wd, ct):
                grads, y = g(x, wg, wu, wd, experts, gates, ct)
                return y, grads
            return step

        fns = {"grouped": fwd_bwd(experts_dropless), "ragged_dot": fwd_bwd(experts_ragged_dot),
               "dense_loop": fwd_bwd(experts_dense_loop)}
        if not on_cpu:  # (on CPU the Pallas kernel runs interpreted: Python, not a kernel, timed)
            fns.update(pallas=fwd_bwd(experts_pallas), rows_one_matrix=fwd_bwd(rows_one_matrix))
        checked = [name for name in fns if name not in ("dense_loop", "rows_one_matrix")]
        # jax lowers ragged_dot to XLA's ragged-dot instruction on GPU and TPU only; elsewhere (CPU) to
        # a dense dot of the rows masked per group: every row against every group's weights. jaxpar's
        # `grouped` runs blockwise on CPU (`_blocked`: each expert's rows padded to blocks of
        # GROUP_BLOCK, a scan over the blocks) and ragged_dot elsewhere.
        text = {name: fns[name].lower(*args).as_text() for name in ("grouped", "ragged_dot")}
        native = "ragged_dot" in text["ragged_dot"]
        blockwise = "ragged_dot" not in text["grouped"] and on_cpu
        outs, failed = {}, {}
        with contextlib.nullcontext() if on_cpu else jax.default_matmul_precision("highest"):
            for name, fn in fns.items():  # the check
                try:
                    outs[name] = jax.block_until_ready(fn(*args32))
                except jax.errors.JaxRuntimeError as err:  # e.g. out of device memory: recorded, not timed
                    if on_cpu or "RESOURCE_EXHAUSTED" not in str(err):
                        raise
                    failed[name] = str(err).splitlines()[0][:300]
                    print(f"{name} at N={n} D={d} E={e} k={k} F={f}: {failed[name]}", flush=True)
        if failed:  # the size is recorded with what failed, and not timed
            rows.append({"tokens": n, "d_model": d, "experts": e, "k": k, "expert_d_ff": f, "failed": failed})
            continue
        ref = jax.tree.leaves(outs["dense_loop"])
        max_err, check_failed = {}, {}
        for name in checked:
            got = jax.tree.leaves(outs[name])
            for a, b in zip(got, ref):
                try:
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4, err_msg=name)
                except AssertionError as err:
                    if on_cpu:
                        raise
                    # Off CPU the time on the device is scarce: the mismatch is recorded and shown.
                    check_failed[name] = str(err)[:2000]
                    print(f"CHECK FAILED: {name} differs from dense_loop: {str(err)[:500]}", flush=True)
            max_err[name] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, ref))
        del outs
        for fn in fns.values():  # compile the timed dtype
            jax.block_until_ready(fn(*args))
        times = {name: [] for name in fns}
        for r in range(reps):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                t = time.perf_counter()
                jax.block_until_ready(fns[name](*args))
                times[name].append(time.perf_counter() - t)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        # FLOPs of the forward matmuls (backward: 2x more), per row 3 matmuls x 2*D*F: grouped ideal
        # N*k rows; blockwise (ceil(N*k/b) + E) blocks of b rows; ragged_dot as lowered on CPU N*k*E
        # row-expert products; dense loop N*E.
        m = n * k
        b = min(GROUP_BLOCK, m)
        grouped_rows = (-(-m // b) + e) * b if blockwise else m
        row = {"tokens": n, "d_model": d, "experts": e, "k": k, "expert_d_ff": f, "reps": reps, "dtype": dtype,
               "check_failed": check_failed,
               "ideal_tflops_per_s": {name: 3 * m * 6 * d * f / med[name] / 1e12 for name in fns},
               "median_s": med, "times_s": times, "max_abs_diff_vs_dense_loop": max_err,
               "over_dense_loop": {name: med[name] / med["dense_loop"] for name in checked},
               # issue 45: each grouped form's TFLOP/s over one dense GEMM's at the same rows (GPU only)
               "over_rows_one_matrix": ({name: med["rows_one_matrix"] / med[name] for name in checked}
                                        if "rows_one_matrix" in med else None),
               "ragged_dot_over_grouped": med["ragged_dot"] / med["grouped"],
               "grouped_lowering": (f"blockwise scan over blocks of {b} rows" if blockwise
                                    else "ragged-dot instruction" if "ragged_dot" in text["grouped"] else "other"),
               "ragged_dot_lowering": "ragged-dot instruction" if native else "dense masked dot (E x the grouped FLOPs)",
               "fwd_bwd_matmul_flops": {"ideal_grouped": 3 * m * 6 * d * f,
                                        "grouped_as_run": 3 * grouped_rows * 6 * d * f,
                                        "ragged_dot_as_lowered": 3 * m * 6 * d * f * (1 if native else e),
                                        "dense_loop": 3 * n * e * 6 * d * f}}
        rows.append(row)
        print(f"micro N={n} D={d} E={e} k={k} F={f}: grouped {med['grouped'] * 1e3:.1f} ms, ragged_dot "
              f"{med['ragged_dot'] * 1e3:.1f} ms, dense loop {med['dense_loop'] * 1e3:.1f} ms (vs dense loop: grouped "
              f"{row['over_dense_loop']['grouped']:.2f}x, ragged_dot {row['over_dense_loop']['ragged_dot']:.2f}x), "
              f"max |diff| {max(max_err.values()):.1e}", flush=True)
    return rows


# --------------------------------------------------------------------------------------------


def markdown(rows: list[dict], micro_rows: list[dict], machine: dict, cfg, command: str, args) -> str:
    head = ["case", "mesh (d,p,t)", "params total / active", "median step (ms)", "tokens/s",
            "CPU s/step", "argument MiB/device", "temp MiB/device", "all-to-all over data MiB/step",
            "ideal dropless MiB/step", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        a = r["all_to_all_data"]
        m = r["mesh"]
        lines.append("| " + " | ".join([
            r["case"], f"({m['data']},{m['stage']},{m['model']})",
            f"{r['params_total'] / 1e6:.2f}M / {r['params_active'] / 1e6:.2f}M",
            f"{r['step_time_s']['median'] * 1e3:.0f}", f"{r['tokens_per_s']:,.0f}",
            f"{r['cpu_s_per_step']['median']:.2f}",
            mib(r["memory"]["argument_bytes"]), mib(r["memory"]["temp_bytes"]),
            mib(a["bytes_per_step"]), mib(a["ideal_dropless_bytes_per_step"]),
            f"{a['ratio_to_ideal']:.2f}×" if a["ratio_to_ideal"] else "-"]) + " |")
    mdl = cfg.model
    text = "\n".join(lines) + (
        f"\n\nModel: llama, {mdl.n_layers} layers, d_model {mdl.d_model}, {mdl.n_heads} heads, vocab "
        f"{mdl.vocab_size}, seq_len {mdl.seq_len}, global batch {cfg.train.global_batch}; MoE: {E} experts of "
        f"width {EXPERT_D_FF}, top-{K}, dropless, softmax router; dense: d_ff {K * EXPERT_D_FF} (same active "
        f"parameters). `ep`: experts split over data; `replicated`: `parallel.expert_parallel: false`; `3d`: 1F1B, "
        f"{args.microbatches} microbatches. Median of {rows[0]['steps']} steps after {rows[0]['warmup']} warmup, "
        "the cases timed in turns; CPU s/step is the process's user + sys time over the same interval. Memory is "
        "XLA's plan per device; all-to-all bytes are result bytes × executions of the all-to-alls spanning "
        "`data` (`jaxpar.inspect`; in a pipeline tick's `lax.cond` counted as if every tick ran them); ideal: "
        "tokens per data rank × k × d_model × 4 B × 4 per layer × layers per stage.\n")
    if micro_rows:
        text += ("\n| tokens | d_model | E | k | F | grouped fwd+bwd (ms) | ragged_dot fwd+bwd (ms) | "
                 "dense loop fwd+bwd (ms) | grouped / dense loop | ragged_dot / dense loop | max abs diff |\n"
                 "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in micro_rows:
            med, ratio = r["median_s"], r["over_dense_loop"]
            text += (f"| {r['tokens']} | {r['d_model']} | {r['experts']} | {r['k']} | {r['expert_d_ff']} | "
                     f"{med['grouped'] * 1e3:.1f} | {med['ragged_dot'] * 1e3:.1f} | {med['dense_loop'] * 1e3:.1f} | "
                     f"{ratio['grouped']:.2f}× | {ratio['ragged_dot']:.2f}× | "
                     f"{max(r['max_abs_diff_vs_dense_loop'].values()):.1e} |\n")
        text += (f"\nOne device, jitted forward + backward (gradients of x and the three weight stacks), median of "
                 f"{micro_rows[0]['reps']} calls each, the three alternated; all against `dense_loop` (every expert "
                 f"on every token masked by the routing). `grouped`: `experts_dropless` as jaxpar runs it, its "
                 f"grouped matmul lowered as: {micro_rows[0]['grouped_lowering']}; `ragged_dot`: the same with "
                 f"`jax.lax.ragged_dot` in place of `jaxpar.model.moe.grouped`, lowered as: "
                 f"{micro_rows[0]['ragged_dot_lowering']}. Max abs diff: the larger of the two against dense_loop.\n")
    text += (f"\nMeasured {machine['date']} on {machine['device_count']} simulated {machine['platform']} devices on "
             f"{machine['cpu_count']} shared CPU cores ({machine['cpu_model']}), jax {machine['jax_version']}, "
             f"CPU client pool PJRT_NPROC={machine['pjrt_nproc']}; 1-minute load average "
             f"{machine['load_avg_1m_at_start']} at the start, {machine['load_avg_1m_before_timing']} before timing, "
             f"{machine['load_avg_1m_after_timing']} after. Step times on simulated devices sharing two cores "
             "measure compute and memory copies, not interconnect bandwidth.\n\n"
             f"Command: `{command}`\n")
    return text


def markdown_gpu(rows: list[dict], micro_rows: list[dict], machine: dict, cfg, command: str) -> str:
    head = ["case", "params total / active", "median step (ms)", "tokens/s", "model TFLOP/s (active)",
            "MFU (active)", "argument GiB", "temp GiB"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        lines.append("| " + " | ".join([
            f"{r['case']} ({r['moe_shape']})", f"{r['params_total'] / 1e6:.0f}M / {r['params_active'] / 1e6:.0f}M",
            f"{r['step_time_s']['median'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
            f"{r['model_tflops_per_s']:.0f}", f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a",
            f"{r['memory']['argument_bytes'] / 2**30:.2f}", f"{r['memory']['temp_bytes'] / 2**30:.2f}"]) + " |")
    mdl = cfg.model
    text = "\n".join(lines) + (
        f"\n\nOne {machine['device_kind']}, mesh (1, 1, 1). Model: llama, {mdl.n_layers} layers, d_model "
        f"{mdl.d_model}, {mdl.n_heads}/{mdl.n_kv_heads} heads, vocab {mdl.vocab_size}, seq_len {mdl.seq_len}, global "
        f"batch {cfg.train.global_batch}, {mdl.dtype} compute, float32 parameters and AdamW, remat "
        f"{cfg.parallel.remat}, attention {mdl.attention}; MoE dropless, softmax router. Model FLOPs per token "
        "6·N_active + 12·L·d·S (`jaxpar.costs.model_flops_per_token`), MFU against the dense bf16 peak "
        f"{rows[0]['peak_tflops']} TFLOP/s. Median of {rows[0]['steps']} steps after {rows[0]['warmup']} warmup, the "
        "cases timed in turns. Memory: XLA's plan for the compiled step.\n")
    if micro_rows:
        text += ("\n| tokens | d_model | E | k | F | grouped fwd+bwd (ms) | ragged_dot (ms) | dense loop (ms) | "
                 "grouped TFLOP/s (ideal FLOPs) | dense loop TFLOP/s (ideal FLOPs) | grouped / dense loop | "
                 "float32 max abs diff |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in micro_rows:
            if "failed" in r:
                text += (f"| {r['tokens']} | {r['d_model']} | {r['experts']} | {r['k']} | {r['expert_d_ff']} | "
                         f"failed: {'; '.join(f'{k}: {v}' for k, v in r['failed'].items())} |||||||\n")
                continue
            med, tf = r["median_s"], r["ideal_tflops_per_s"]
            text += (f"| {r['tokens']} | {r['d_model']} | {r['experts']} | {r['k']} | {r['expert_d_ff']} | "
                     f"{med['grouped'] * 1e3:.2f} | {med['ragged_dot'] * 1e3:.2f} | {med['dense_loop'] * 1e3:.2f} | "
                     f"{tf['grouped']:.0f} | {tf['dense_loop']:.0f} | {r['over_dense_loop']['grouped']:.2f}× | "
                     f"{max(r['max_abs_diff_vs_dense_loop'].values()):.1e}"
                     f"{' (CHECK FAILED)' if r['check_failed'] else ''} |\n")
        if any(r.get("over_rows_one_matrix") for r in micro_rows):  # issue 45: against one dense GEMM
            text += ("\n| tokens | E | k | F | pallas (ms) | one dense GEMM's rows (ms) | grouped / dense GEMM "
                     "TFLOP/s | ragged_dot / dense | pallas / dense (target ≥ 0.70) |\n|---:|---:|---:|---:|---:|---:|"
                     "---:|---:|---:|\n")
            for r in micro_rows:
                o = r.get("over_rows_one_matrix")
                if o:
                    text += (f"| {r['tokens']} | {r['experts']} | {r['k']} | {r['expert_d_ff']} | "
                             f"{r['median_s']['pallas'] * 1e3:.2f} | {r['median_s']['rows_one_matrix'] * 1e3:.2f} | "
                             f"{o['grouped']:.2f} | {o['ragged_dot']:.2f} | {o['pallas']:.2f} |\n")
        text += (f"\nJitted forward + backward (gradients of x and the three weight stacks) in "
                 f"{micro_rows[0].get('dtype', '?')}, median of {micro_rows[0].get('reps', '?')} calls each, the three "
                 f"alternated. `grouped` (jaxpar's) lowered as: {micro_rows[0].get('grouped_lowering', '?')}. TFLOP/s count the FLOPs a "
                 "dropless MoE needs (tokens x k rows through three matmuls, forward and backward), for every "
                 "variant: the dense loop runs E/k times more. The check against the dense loop ran in float32 at "
                 "`highest` matmul precision.\n")
    text += (f"\nMeasured {machine['date']}: {machine['device_kind']}, jax {machine['jax_version']}, "
             f"{machine['cpu_count']} CPU cores ({machine['cpu_model']}).\n\nCommand: `{command}`\n")
    return text


def main(argv: list[str]) -> int:
    return guarded(run, parse_args(argv))


def run(args: argparse.Namespace) -> int:
    import jax

    if not args.gpu:
        jax.config.update("jax_platforms", "cpu")
    cases = {n: (mesh, o) for n, mesh, o in (GPU_CASES if args.gpu else CASES)}
    cfgs = [(name, config(name, *cases[name], args)) for name in args.cases]  # every config checked first
    if args.gpu:
        if jax.default_backend() == "cpu":
            print("error: --gpu found no GPU (JAX's backend is cpu); run without --gpu for simulated CPU devices",
                  file=sys.stderr)
            return 2
    else:
        simulated_cpu(8)  # the pool for any program (the pipeline's collectives need it): the same for every case
    load = load_avg()
    t_start = time.perf_counter()

    rows, runs = [], []
    for name, cfg in cfgs:
        r, run_ = measure(name, cfg, args.hlo_dir)
        rows.append(r)
        runs.append(run_)
        a = r["all_to_all_data"]
        print(f"{name}: compiled in {r['compile_s']:.1f} s, args {mib(r['memory']['argument_bytes'])} MiB, temp "
              f"{mib(r['memory']['temp_bytes'])} MiB, all-to-all {mib(a['bytes_per_step'])} MiB/step "
              f"(ideal {mib(a['ideal_dropless_bytes_per_step'])})", flush=True)
    load_timing = load_avg()
    for r, (cfg_name, cfg), res in zip(rows, cfgs, time_interleaved(runs, args.warmup, args.steps)):
        tokens = cfg.train.global_batch * cfg.model.seq_len
        med = statistics.median(res["wall"])
        r.update(steps=args.steps, warmup=args.warmup, final_loss=res["loss"], moe_metrics=res["moe"],
                 step_times_s=res["wall"], cpu_s_per_step_all=res["cpu"],
                 step_time_s=summary(res["wall"]),
                 cpu_s_per_step={"median": statistics.median(res["cpu"]), "mean": statistics.fmean(res["cpu"])},
                 tokens_per_step=tokens, tokens_per_s=tokens / med)
        if args.gpu:
            from jaxpar.costs import model_flops_per_token
            from jaxpar.train.efficiency import known_peak_tflops

            m = cfg.model
            peak = args.peak_tflops or known_peak_tflops(jax.devices()[0].device_kind, m.dtype)
            tflops = model_flops_per_token(cfg) * tokens / med / 1e12
            r.update(moe_shape=(f"{m.n_experts} x {m.expert_d_ff}, top-{m.experts_per_token}" if m.moe
                                else f"dense d_ff {m.d_ff}"),
                     model_flops_per_token=model_flops_per_token(cfg), model_tflops_per_s=tflops,
                     peak_tflops=peak, mfu=tflops / peak if peak else None)
        print(f"{cfg_name}: median {med * 1e3:.1f} ms, {tokens / med:,.0f} tokens/s, CPU "
              f"{r['cpu_s_per_step']['median']:.2f} s/step, loss {res['loss']:.4f}"
              + (f", {r['model_tflops_per_s']:.0f} model TFLOP/s, MFU {r['mfu']:.1%}" if r.get("mfu") else ""),
              flush=True)
    load_after = load_avg()

    def write(micro_rows: list[dict]) -> None:
        """The JSON and Markdown of what is measured so far (after each part: a device's time is scarce)."""
        machine = {**machine_info(), "pjrt_nproc": os.environ.get("PJRT_NPROC", "XLA default"),
                   "load_avg_1m_at_start": load, "load_avg_1m_before_timing": load_timing,
                   "load_avg_1m_after_timing": load_after, "load_avg_1m_at_end": load_avg()}
        cmd = command("moe.py")
        result = {
            "benchmark": "moe", "date": machine["date"], "command": cmd, "machine": machine,
            "wall_s": time.perf_counter() - t_start,
            "config": {name: cfg.to_dict() for name, cfg in cfgs},
            "timing": ("cases timed in turns, one step of each per round, order reversed every other round; each "
                       "step timed alone, dispatch to jax.block_until_ready on the new state and metrics; batches "
                       "prebuilt; CPU seconds: resource.getrusage(RUSAGE_SELF) user + sys over the same interval; "
                       "compile_s is AOT lower+compile of the step; load averages: other work on the cores "
                       "(2 cores: 2.0 = busy)"),
            "rows": rows, "micro": micro_rows,
        }
        table = (markdown_gpu(rows, micro_rows, machine, cfgs[0][1], cmd) if args.gpu
                 else markdown(rows, micro_rows, machine, cfgs[0][1], cmd, args))
        if args.out:
            write_result(args.out, result, table, f"Mixture of experts ({machine['platform']})")
        else:
            print(table)

    if args.no_micro:
        write([])
        return 0
    if args.gpu:
        write([])
    sizes = MICRO_QUICK if args.quick else GPU_MICRO if args.gpu else MICRO
    write(micro(sizes, args.micro_reps, "bfloat16" if args.gpu else "float32"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
