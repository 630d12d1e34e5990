"""The requirements of the mesh's axis sizes and of the batch that need the pipeline's schedule
tables or stage layouts: checked once the sizes are resolved against the devices
(`jaxpar.mesh.check_sizes`), after `jaxpar.config.validate`. Each broken rule is one `ConfigError`
sentence, as the config's own.
"""

from __future__ import annotations

import functools

from jaxpar.config.schema import Config
from jaxpar.config.rules import nearest_divisor, require
from jaxpar.errors import ConfigError
from jaxpar.parallel.pipeline.schedules import ScheduleError, build
from jaxpar.parallel.pipeline.placement import placement_of
from jaxpar.parallel.stages import stage_layout


def check_data_axis(cfg: Config, d: int) -> None:
    """What context parallelism and expert parallelism over a `data` axis of size d require."""
    c = cfg.parallel.context
    require(d % c == 0,
            f"parallel.context = {c} does not divide mesh.data = {d} (each sequence is split over {c} of the data "
            f"ranks); choose a context size that divides {d}, or a data size that is a multiple of {c}.")
    m = cfg.model
    if d == 1 or not m.moe or not cfg.parallel.expert_parallel:
        return
    require(m.n_experts % d == 0 or d % m.n_experts == 0,
            f"model.n_experts = {m.n_experts} and mesh.data = {d} must divide one another (expert parallelism "
            f"splits the experts over data ranks, or replicates each on data / n_experts of them); choose a data "
            f"size that divides or is a multiple of {m.n_experts}, or set parallel.expert_parallel=false to keep "
            "every expert on every data rank.")
    require(m.n_experts % d == 0 or m.d_model % d == 0,
            f"model.d_model = {m.d_model} is not divisible by mesh.data = {d} (with {d // m.n_experts} replicas "
            f"of each expert every data rank stores a 1/{d} slice of each expert's d_model dim); choose a data "
            f"size that divides {m.d_model}, or set parallel.expert_parallel=false.")


def check_model_axis(cfg: Config, t: int) -> None:
    """What tensor (and sequence) parallelism over a `model` axis of size t requires."""
    m = cfg.model
    if t == 1:
        return
    require(m.n_heads % t == 0,
            f"model.n_heads = {m.n_heads} is not divisible by mesh.model = {t} (tensor parallelism splits "
            f"attention by heads); choose a mesh.model that divides {m.n_heads}, or change model.n_heads.")
    require(m.kv_heads % t == 0 or t % m.kv_heads == 0,
            f"model.n_kv_heads = {m.kv_heads} and mesh.model = {t} must divide one another (kv heads are split "
            f"over model ranks, or each replicated on t / n_kv_heads of them); choose n_kv_heads = "
            f"{nearest_divisor(m.n_heads, t)} or a mesh.model that divides or is divided by {m.kv_heads}.")
    require(m.d_ff % t == 0,
            f"model.d_ff = {m.d_ff} is not divisible by mesh.model = {t} (tensor parallelism splits the MLP "
            f"width); choose d_ff as a multiple of {t}, e.g. {-(-m.d_ff // t) * t}.")
    etp = cfg.parallel.expert_tensor_parallel
    require(not m.moe or etp or cfg.parallel.sequence_parallel,
            f"parallel.expert_tensor_parallel = false with mesh.model = {t} keeps every expert whole on each model "
            "rank, which then routes its own sequence shard; set parallel.sequence_parallel=true, or "
            "expert_tensor_parallel=true to split the experts over model.")
    require(not m.moe or not etp or m.expert_width % t == 0,
            f"model.expert_d_ff = {m.expert_width} is not divisible by mesh.model = {t} (tensor parallelism "
            f"splits each expert's width); choose expert_d_ff as a multiple of {t}, e.g. {-(-m.expert_width // t) * t}.")
    require(m.padded_vocab % t == 0,
            f"the padded vocabulary model.vocab_size = {m.vocab_size} -> {m.padded_vocab} (a multiple of "
            f"model.vocab_multiple = {m.vocab_multiple}) is not divisible by mesh.model = {t}; set "
            f"model.vocab_multiple to a multiple of {t}.")
    if cfg.parallel.sequence_parallel:
        require(m.seq_len % t == 0,
                f"model.seq_len = {m.seq_len} is not divisible by mesh.model = {t}, but sequence parallelism "
                f"splits the sequence over model ranks; choose seq_len as a multiple of {t} or turn "
                "parallel.sequence_parallel off.")


def check_stage_axis(cfg: Config, p: int) -> None:
    """What pipeline parallelism over a `stage` axis of size p requires."""
    if p == 1:
        return
    m, par = cfg.model, cfg.parallel
    chunks = p * par.virtual_stages
    # F's saved values go into the pipeline's device stash, written in a branch of the tick that
    # must type-check against idle ticks' device zeros: host-resident ones cannot.
    require(par.remat != "offload",
            f"parallel.remat = offload cannot run with mesh.stage = {p}: the pipeline stashes what each "
            "forward saves in device buffers, and offload keeps it in host memory; set parallel.remat=dots "
            "(or dots_except_mlp), or mesh.stage=1.")
    if par.stage_layers is not None:
        counts = par.stage_layers
        require(len(counts) == p and par.virtual_stages == 1,
                f"parallel.stage_layers = {list(counts)} must give one layer count per stage (mesh.stage = {p}) "
                f"with parallel.virtual_stages = 1; give {p} counts or remove it.")
        require(min(counts) >= 1 and sum(counts) == m.n_layers,
                f"parallel.stage_layers = {list(counts)} must be positive counts that sum to model.n_layers = "
                f"{m.n_layers}; fix the counts.")
    if m.n_layers < chunks:  # no layout at all, even or not: every chunk needs a layer
        # (None where no stage count splits the layers into whole chunks: 61 layers, 2 chunks a stage.)
        fewer = max((d for d in range(1, p + 1) if m.n_layers % (d * par.virtual_stages) == 0), default=None)
        what = (f"mesh.stage = {p} needs at least {chunks} layers (one per stage)" if par.virtual_stages == 1 else
                f"mesh.stage x parallel.virtual_stages = {p} x {par.virtual_stages} = {chunks} pipeline chunks need "
                f"at least {chunks} layers (one per chunk)")
        less = (f"use fewer stages (mesh.stage={fewer})" if fewer else
                f"use fewer virtual stages (parallel.virtual_stages={m.n_layers} or less)"
                if m.n_layers < par.virtual_stages else
                f"use parallel.virtual_stages=1 with mesh.stage={min(p, m.n_layers)}")
        raise ConfigError(f"{what}, but model.n_layers = {m.n_layers}; {less} or more layers "
                          f"(model.n_layers={chunks}).")
    require(par.stage_layers is not None or m.n_layers % chunks == 0,
            f"model.n_layers = {m.n_layers} cannot be split evenly into mesh.stage x parallel.virtual_stages "
            f"= {p} x {par.virtual_stages} = {chunks} pipeline chunks; choose n_layers as a multiple of {chunks}, "
            f"or give parallel.stage_layers.")
    if m.mixed:  # each chunk must hold its dense first layers, then whole groups
        try:
            stage_layout(m, p, par.virtual_stages, par.stage_layers, placement_of(par.schedule))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    problem = _schedule_problem(par.schedule, p, par.microbatches, par.virtual_stages)
    if problem:
        raise ConfigError(problem)


@functools.lru_cache(maxsize=8192)
def _schedule_problem(name: str, p: int, m: int, v: int) -> str | None:
    """Why the schedule table cannot be built, or None (cached: the planner validates thousands of
    configs that share a table, and building one of p x m actions is not free)."""
    try:
        build(name, p, m, v)
    except ScheduleError as e:
        return str(e)
    return None


def check_batch(cfg: Config, data: int) -> None:
    """The global batch must split evenly over the data axis's sequence groups (data / context: all
    of it without context parallelism) and the microbatches."""
    tr, par = cfg.train, cfg.parallel
    c = par.context if data % par.context == 0 else 1  # (else check_data_axis refuses the context size)
    per = data // c * par.microbatches
    over = (f"mesh.data x parallel.microbatches = {data} x {par.microbatches}" if c == 1 else
            f"mesh.data / parallel.context x parallel.microbatches = {data} / {c} x {par.microbatches}")
    require(tr.global_batch % per == 0,
            f"train.global_batch = {tr.global_batch} is not divisible by {over} = {per}; set train.global_batch "
            f"to a multiple of {per} (e.g. {max(per, tr.global_batch // per * per)}).")
