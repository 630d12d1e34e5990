"""What `python -m jaxpar.plan` prints: the header (model, step, the hardware planned for), the
ranked table, the memory wall, `--evaluate`'s account of one layout, and the sentences that say
why a layout does not fit. The figures are `jaxpar.plan.search`'s (`estimate`, `plan`,
`memory_wall`); nothing is costed here."""

from __future__ import annotations

from jaxpar import model
from jaxpar.hardware import HARDWARE
from jaxpar.model.flops import model_flops_per_token
from jaxpar.plan.memory import _BYTES
from jaxpar.plan.moe import describe_params, param_counts
from jaxpar.plan.search import Estimate, memory_wall


def _human(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _describe(e: Estimate) -> str:
    par = e.cfg.parallel
    d, p, t = e.shape
    parts = [f"(data, stage, model) = ({d}, {p}, {t})", f"ZeRO-{par.zero}"]
    if p > 1:
        parts.append(f"{par.schedule}" + (f" v={par.virtual_stages}" if par.virtual_stages > 1 else ""))
    if par.context > 1:
        parts.append(f"context {par.context} ({par.context_attention})")
    parts.append(f"{par.microbatches} microbatch{'es' if par.microbatches > 1 else ''}")
    parts.append(f"remat {par.remat}")
    if e.cfg.train.master_weights != "none":
        parts.append(f"{e.cfg.train.master_weights} master weights")
    if t > 1:
        parts.append("SP" if par.sequence_parallel else "no SP")
    if par.offload != "none":
        parts.append(f"{par.offload} offloaded")
    return ", ".join(parts)


def _activ(mem: dict[str, int]) -> int:
    """The table's `activ` column: activations, pipeline buffers, ZeRO-3's gathered copies, batch."""
    return mem["activations"] + mem["pipeline_buffers"] + mem["gathered_params"] + mem["batch"]


def _too_big(e: Estimate, hw) -> str:
    """'needs 95.7 GB per device (its layout), 15.7 GB over the 80.0 GB of a device: parameters ...
    + gradients ... + optimizer state ... + activations ...'."""
    mem = e.memory
    return (f"needs {_human(mem['total'])} per device ({_describe(e)}), "
            f"{_human(mem['total'] - hw.memory_bytes)} over the {_human(hw.memory_bytes)} of a device: "
            f"parameters {_human(mem['params'])} + gradients {_human(mem['gradients'])} + optimizer state "
            f"{_human(mem['optimizer'])} + activations {_human(_activ(mem))}")


def _fixes(e: Estimate, hw, knobs: tuple[str, ...] = ()) -> str:
    """'a, b, c or d': what would make `e` fit, `knobs` (the config's own settings) first, then more
    devices, a device with more memory, and shorter sequences where activations are its largest part."""
    bigger = [k for k, h in HARDWARE.items() if h.memory_bytes > hw.memory_bytes]
    fixes = [*knobs, "more devices", "a device with more memory ("
             + (f"--hardware {max(bigger, key=lambda k: HARDWARE[k].memory_bytes)} or " if bigger else "")
             + "--device-memory)"]
    mem = e.memory
    if _activ(mem) > max(mem["params"], mem["gradients"], mem["optimizer"]):
        fixes.append("shorter sequences (--seq-len)")
    return ", ".join(fixes[:-1]) + " or " + fixes[-1]


def _console():
    from rich.console import Console

    console = Console(soft_wrap=True)
    return console if console.is_terminal else Console(soft_wrap=True, width=200)


def header(cfg, roof, args, devices: int) -> str:
    """The model, the step and the hardware planned for: on `--platform cpu`, simulated CPU devices
    costed with the `--hardware` preset's memory, peak and links (the only figures the planner has)."""
    m, hw = cfg.model, roof.hardware
    n = model.count_params(m)
    tokens = cfg.train.global_batch * m.seq_len
    mlp = (f"d_ff {m.d_ff}" if not m.moe else
           f"MoE {m.n_experts} experts of {m.expert_width}, top-{m.experts_per_token}"
           + (f" + {m.n_shared_experts} shared" if m.n_shared_experts else "")
           + (" (expert parallel over data)" if cfg.parallel.expert_parallel else " (experts replicated over data)"))
    if args.platform == "cpu":
        cluster = (f"{devices} simulated CPU devices (--platform cpu: the step's memory as XLA:CPU holds it, XLA "
                   f"attention) costed with the figures of {hw.name} (--hardware {args.hardware}"
                   + (", --device-memory to set a device's share of the host" if args.device_memory is None else "")
                   + f"): {_human(hw.memory_bytes)} each")
    else:
        cluster = f"{devices} x {hw.name}, {_human(hw.memory_bytes)} each"
    return (
        f"model   {m.arch}: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads ({m.kv_heads} kv), "
        f"{mlp}, vocab {m.vocab_size}, seq {m.seq_len}; Ψ = {describe_params(m)}; compute {m.dtype}, params "
        f"{m.param_dtype}\n"
        f"        {m.param_dtype} weights {_human(n * _BYTES[m.param_dtype])}; with gradients and Adam "
        f"{_human(4 * n * _BYTES[m.param_dtype])} (16 bytes per parameter in float32)\n"
        f"step    {cfg.train.global_batch} x {m.seq_len} = {tokens:,} tokens; model FLOPs "
        f"{model_flops_per_token(cfg) * tokens:.3g} (6N + 12·L·d·S per token"
        + (", N the active parameters)" if m.moe else ")") + "\n"
        f"cluster {cluster}, {hw.node_size} per node; peak "
        f"{(hw.peak_flops if m.dtype != 'float32' else hw.peak_flops_fp32) / 1e12:g} TFLOP/s at {m.dtype}, "
        + (f"compute at {roof.compute_efficiency:.0%} of it" if roof.compute_efficiency is not None else
           f"compute by matmul sizes and attention kernel (H200-calibrated), HBM {hw.hbm_bw / 1e12:g} TB/s")
        + f"; links {hw.intra_node_bw / 1e9:g} GB/s in a node, "
        f"{hw.inter_node_bw / 1e9:g} GB/s across (per device, per direction)\n"
        f"overlap per layer: forward tensor-parallel collectives exposed"
        + (" past their matmuls (collective matmul)" if roof.collective_matmul else "")
        + ", backward ones past the weight-gradient matmul; data-axis traffic in the layer scan beside the "
        f"next layer's compute, after the loops exposed; pipeline sends exposed; bubble from the schedule simulator")


def print_report(cfg, roof, args, result) -> None:
    """The search's answer: the header, the first --top rows of the ranking, the refusals, the best."""
    console = _console()
    console.print(header(cfg, roof, args, args.devices), highlight=False)
    top = args.top or 10
    shown = result.ranked[:top]
    console.print(_table(shown, f"{len(result.ranked)} layouts fit, fastest first "
                                f"({len(result.too_big)} do not fit; {sum(result.refused.values())} refused by "
                                f"jaxpar's validation; not estimated: {result.pruned.get('slower', 0)} slower "
                                f"than #{top} in compute alone, {result.pruned.get('bigger', 0)} bigger "
                                f"than one that does not fit)"))
    if result.refused:
        console.print("refused, by reason: " + "; ".join(
            f"{k} ({v})" for k, v in sorted(result.refused.items(), key=lambda kv: -kv[1])[:5]), highlight=False)
    best = result.ranked[0]
    console.print(f"best: {_describe(best)}: {_human(best.memory['total'])} per device, "
                  f"{best.time['total']:.3g} s per step, MFU {best.mfu:.1%}", highlight=False)
    if args.write_config:
        console.print(f"written to {args.write_config}", highlight=False)


def _table(estimates: list[Estimate], title: str):
    """The ranked rows, numbered as `--json`'s `rank`."""
    from rich.table import Table

    table = Table(title=title, caption="CP: context parallelism's c (ag: K/V all-gather, ring); memory per device: params + grads + optimizer + activations (incl. "
                                       "pipeline buffers, ZeRO-3 gathers); time: compute incl. bubble, then "
                                       "exposed traffic on data / stage / model")
    for col in ("#", "data", "stage", "model", "CP", "ZeRO", "schedule", "m", "remat", "SP", "master", "memory", "params",
                "grads", "optim", "activ", "step s", "bubble", "exposed d/s/m s", "MFU"):
        table.add_column(col, justify="right" if col not in ("schedule", "remat") else "left", no_wrap=True)
    for i, e in enumerate(estimates, 1):
        par, mem, tm = e.cfg.parallel, e.memory, e.time
        d, p, t = e.shape
        act = _activ(mem)
        sched = "-" if p == 1 else par.schedule + (f" v{par.virtual_stages}" if par.virtual_stages > 1 else "")
        cp = "-" if par.context == 1 else f"{par.context} {'ag' if par.context_attention == 'all_gather' else 'ring'}"
        table.add_row(str(i), str(d), str(p), str(t), cp, str(par.zero), sched, str(par.microbatches), par.remat,
                      ("on" if par.sequence_parallel else "off") if t > 1 else "-",
                      "-" if e.cfg.train.master_weights == "none" else "fp32", _human(mem["total"]),
                      _human(mem["params"]), _human(mem["gradients"]), _human(mem["optimizer"]), _human(act),
                      f"{tm['total']:.3g}", f"{tm['bubble_fraction']:.1%}" if p > 1 else "-",
                      f"{tm['data_comm']:.2g}/{tm['stage_comm']:.2g}/{tm['model_comm']:.2g}", f"{e.mfu:.1%}")
    return table


def print_wall(cfg, args, roof) -> None:
    """--memory-wall: `search.memory_wall` as a table."""
    from rich.table import Table

    n, active = param_counts(cfg.model)
    moe = f" ({active / 1e9:.1f} B active)" if cfg.model.moe else ""
    table = Table(title=f"the memory wall: Ψ = {n / 1e9:.1f} B parameters{moe} on {args.devices} devices "
                        f"of {_human(roof.hardware.memory_bytes)}", caption="GB per device")
    for col in ("strategy", "(data, stage, model)", "params", "grads", "optimizer", "activations", "total", "fits"):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    notes = []
    for label, shape, mem in memory_wall(cfg, args.devices, roof.hardware.node_size, args.platform):
        if isinstance(mem, str):
            notes.append(f"[{len(notes) + 1}] {label}: refused by jaxpar's validation: {mem}")
            table.add_row(label, shape, *["-"] * 5, f"[{len(notes)}]")
            continue
        act = _activ(mem)
        table.add_row(label, shape, *(f"{mem[k] / 1e9:,.1f}" for k in ("params", "gradients", "optimizer")),
                      f"{act / 1e9:,.1f}", f"{mem['total'] / 1e9:,.1f}",
                      "yes" if mem["total"] <= roof.hardware.memory_bytes else "no")
    console = _console()
    console.print(table)
    for note in notes:
        console.print(note, highlight=False)


def print_evaluation(cfg, roof, args, e: Estimate) -> None:
    """--evaluate: the header, then the one layout `search.evaluate` costed, part by part: its memory
    against the device's, the result bytes of its collectives per axis, its step time."""
    mem, tm, hw = e.memory, e.time, roof.hardware
    source = args.config or f"preset {args.preset}"
    lines = [header(cfg, roof, args, e.shape[0] * e.shape[1] * e.shape[2]),
             f"layout  {_describe(e)}, as {source} states it (costed alone: not searched, not pruned)",
             f"memory  {_human(mem['total'])} per device of {_human(hw.memory_bytes)}: "
             + (f"fits, {_human(hw.memory_bytes - mem['total'])} to spare" if e.fits else "does not fit"),
             f"        parameters {_human(mem['params'])}, gradients {_human(mem['gradients'])}, optimizer state "
             f"{_human(mem['optimizer'])}, activations {_human(_activ(mem))} (saved and working "
             f"{_human(mem['activations'])}, pipeline buffers {_human(mem['pipeline_buffers'])}, gathered "
             f"parameters {_human(mem['gathered_params'])}, batch {_human(mem['batch'])})"]
    host = {k: mem.get(f"host_{k}", 0) for k in ("optimizer", "activations")}
    if any(host.values()):
        lines.append("        in pinned host memory, not in the total: "
                     + ", ".join(f"{k} {_human(v)}" for k, v in host.items() if v))
    lines += [
        "traffic " + ", ".join(f"{axis} {_human(b)}" for axis, b in e.bytes_per_step.items())
        + " per step per device (result bytes of the collectives on each mesh axis)",
        f"time    {tm['total']:.3g} s per step: compute {tm['compute']:.3g} s"
        + (f" (bubble {tm['bubble_fraction']:.1%})" if e.shape[1] > 1 else "")
        + f", exposed traffic data {tm['data_comm']:.2g} s, stage {tm['stage_comm']:.2g} s, model "
        f"{tm['model_comm']:.2g} s; model FLOPs {e.flops_per_step:.3g} per step, MFU {e.mfu:.1%}"]
    if not e.fits:
        lines.append(f"does not fit: this layout {_too_big(e, hw)}; {_evaluate_fix(e, hw)}.")
    _console().print("\n".join(lines), highlight=False)


def _evaluate_fix(e: Estimate, hw) -> str:
    """What would shrink this layout: the config's own memory settings first, those for its larger
    part first (state: ZeRO-3 over a data axis; activations: remat full, SP over a model axis, more
    microbatches), then hardware (`_fixes`), then the search."""
    par, (d, p, t), mem = e.cfg.parallel, e.shape, e.memory
    state = ["parallel.zero: 3"] if d > 1 and par.zero < 3 else []
    act = (["parallel.remat: full"] if par.remat != "full" else []) + (
        ["parallel.sequence_parallel: true"] if t > 1 and not par.sequence_parallel else []) + (
        ["more parallel.microbatches"] if par.microbatches < e.cfg.train.global_batch // d else [])
    knobs = act + state if _activ(mem) > mem["params"] + mem["gradients"] + mem["optimizer"] else state + act
    return f"it would shrink with {_fixes(e, hw, tuple(knobs))}; or drop --evaluate to search every layout"
