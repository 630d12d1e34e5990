"""`python -m jaxpar.train [--config FILE] [--set key=value]...`: train and show progress.

Exit codes: 0 done (or stopped by SIGTERM/SIGINT with a checkpoint saved), 2 a user error
(config, mesh, data, checkpoint: one `error:` line, nothing written), 3 stopped on a non-finite
loss or gradient with train.on_nan = stop (the last good state saved), 75 a hung step or save
ended by the watchdog (runtime.step_timeout_s; rerun to resume from the last checkpoint).

On a terminal a live bar shows the progress; otherwise (a batch job's log) one line per logged
step, flushed as written."""

from __future__ import annotations

import argparse
import logging
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from jaxpar.config import JaxparError, load_config


def parse_args(argv=None) -> argparse.Namespace:
    from jaxpar.cli import Parser  # a flag's mistake is one `error:` line and exit 2, as every other

    parser = Parser(prog="python -m jaxpar.train", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (default: the bundled defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set model.d_model=256 (repeatable)")
    return parser.parse_args(argv)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _experts_layout(cfg, d: int) -> str:
    """Where an MoE model's experts live over `data`, for the summary ('' for a dense model)."""
    from jaxpar.sharding import expert_replicas
    m = cfg.model
    if not m.moe or d == 1:
        return ""
    r = expert_replicas(cfg, d)
    if r == 0:
        return "; experts: all on every data rank, gradients reduced over data"
    if r == 1:
        return f"; experts: {m.n_experts // d} of {m.n_experts} per data rank, tokens sent by all-to-all"
    return (f"; experts: each on {r} data ranks, a 1/{d} slice of every expert stored per rank and the "
            "rank's own assembled by all-to-all")


def summary(cfg, mesh) -> str:
    from jaxpar import model
    from jaxpar.mesh import describe
    from jaxpar.parallel import naive
    from jaxpar.parallel.gradients import describe_reduction
    from jaxpar.parallel.zero import make_layout, state_bytes

    m, tr = cfg.model, cfg.train
    n = model.count_params(m)
    shapes = model.param_shapes(m)
    state = state_bytes(make_layout(cfg, mesh, model.param_names(m), shapes), shapes, mesh)
    per_device = ", ".join(f"{k} {_mib(v['per_device'])} of {_mib(v['replicated'])}" for k, v in state.items())
    experts = (f"; MoE{f' in {m.n_moe_layers} of {m.n_layers} layers ({m.moe_layers})' if m.mixed else ''}: "
               f"{m.n_experts} experts of d_ff {m.expert_width}, top-{m.experts_per_token}"
               f"{f', {m.n_shared_experts} shared' if m.n_shared_experts else ''}, router {m.router}, "
               f"{'dropless' if m.capacity_factor is None else f'capacity factor {m.capacity_factor:g}'}, "
               f"{model.count_params(m, active=True):,} parameters active per token" if m.moe else "")
    return "\n".join([
        f"model   {m.arch}: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads ({m.kv_heads} kv), "
        f"d_ff {m.d_ff}, vocab {m.vocab_size}, seq {m.seq_len}; {n:,} parameters{experts}; compute {m.dtype}, "
        f"params {m.param_dtype}",
        f"train   {tr.steps} steps x {tr.global_batch} sequences ({tr.global_batch * m.seq_len:,} tokens/step), "
        f"lr {tr.lr:g}, data {cfg.data.source!r}, run_dir {tr.run_dir}",
        f"parallel zero {cfg.parallel.zero}, remat {cfg.parallel.remat}, microbatches {cfg.parallel.microbatches}; "
        f"gradients: {naive.describe(cfg) if cfg.parallel.data_mode == 'naive' else describe_reduction(cfg, mesh.shape['data'], mesh.shape['stage'])}"
        + _experts_layout(cfg, mesh.shape["data"]),
        f"state   per device (of the fully replicated total): {per_device}"
        + ("; optimizer state in pinned host memory" if cfg.parallel.offload == "optimizer" else ""),
        *_pipeline_line(cfg, mesh),
        "mesh\n" + describe(mesh, cfg),
    ])


def _pipeline_line(cfg, mesh) -> list[str]:
    p = mesh.shape["stage"]
    if p == 1:
        return []
    from jaxpar.parallel.pipeline.simulate import simulate
    from jaxpar.parallel.pipeline.table import schedule_of

    par = cfg.parallel
    sim = simulate(schedule_of(par, p))
    return [f"pipeline {par.schedule}: {p} stages x {par.microbatches} microbatches, {len(sim.tick_times)} ticks; "
            f"simulated bubble {sim.bubble_fraction:.1%} (idle / all stage-time, B = 2F); "
            f"peak stashed microbatches per stage {list(sim.peak_stash)}"]


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console(stderr=False)
    try:
        cfg = load_config(args.config, args.overrides)
        from jaxpar.logs import quiet_libraries
        from jaxpar.train.loop import TrainingStopped, preflight, train

        quiet_libraries()

        # User errors surface before the summary and before anything is written; what the checks
        # build (XLA flags, processes, data, mesh, program) is built once, here, for the run.
        run = preflight(cfg)
        import jax

        from jaxpar import logs
        from jaxpar.train import progress as lines

        mesh = run.program.mesh
        is_main = jax.process_index() == 0
        if is_main:
            console.print(summary(cfg, mesh), highlight=False, soft_wrap=True)
            console.print(f"xla     {run.xla.describe()}", highlight=False, soft_wrap=True)
        # A terminal gets a live bar and jaxpar's other lines above it; a batch job's log (stdout not
        # a terminal: SLURM, nohup, `| tee`) one full line per logged step instead.
        live = is_main and console.is_terminal
        logs.for_cli(is_main, (lambda text: console.print(text, highlight=False, soft_wrap=True)) if live else None)
        if live:
            logging.getLogger(lines.log.name).setLevel(logging.WARNING)  # the bar shows them
        columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}")]
        if cfg.train.eval_every > 0:
            columns.append(TextColumn("val {task.fields[val]}"))
        if cfg.model.mtp_depth:  # multi-token prediction's loss (`loss` is the main one)
            columns.append(TextColumn("mtp {task.fields[mtp]}"))
        if cfg.model.moe:  # the routers: losses and the extreme expert loads (1 = the mean load)
            columns.append(TextColumn("moe {task.fields[moe]}"))
        progress = Progress(*columns, TextColumn("{task.fields[tps]} tok/s"), TextColumn("{task.fields[eff]}"),
                            TimeRemainingColumn(), console=console, disable=not live)
        with progress:
            task = progress.add_task("train", total=cfg.train.steps, loss="-", tps="-", val="-", eff="", moe="-",
                                     mtp="-")

            def show(rec: dict) -> None:
                f = lines.fields(rec)
                progress.update(task, completed=rec["step"], loss=f["loss"], tps=f["tps"], eff=f["eff"],
                                **{k: f[k] for k in ("val", "moe", "mtp") if k in f})

            try:
                records = train(cfg, callback=show if live else None, prepared=run)
            except TrainingStopped as e:
                progress.stop()
                print(f"error: {e}", file=sys.stderr)
                return 3
        if is_main and records.stopped is None:  # a stop says where its checkpoint is (the loop's line)
            saved = f"; checkpoint in {records.checkpoint}" if records.checkpoint else ""
            if records:
                resumed = f" (resumed from step {records.resumed_from})" if records.resumed_from is not None else ""
                console.print(f"done{resumed}: loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}; "
                              f"metrics in {cfg.train.run_dir}/metrics.jsonl{saved}", highlight=False, soft_wrap=True)
            else:
                console.print(f"nothing to do: the checkpoint in {cfg.train.run_dir} is already at step "
                              f"{records.resumed_from} of {cfg.train.steps}", highlight=False, soft_wrap=True)
        sys.stdout.flush()
        return 0
    except JaxparError as e:
        print(f"error: {e}", file=sys.stderr)  # one line, never wrapped: scripts grep for it
        return 2


if __name__ == "__main__":
    sys.exit(main())
