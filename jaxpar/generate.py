"""Sampling from a trained or imported model: greedy or temperature / top-k, with a KV cache, on
one device or with tensor parallelism (heads, MLP width and vocabulary split over `model`).

`python -m jaxpar.generate (--run-dir RUN | --hf DIR) --prompt TEXT [--max-new-tokens N]
[--temperature T] [--top-k K] [--seed S] [--model-parallel T]`
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from typing import Sequence

from jaxpar.config import Config, JaxparError, ModelConfig


class GenerateError(JaxparError):
    """A prompt or sampling setting that cannot be run."""


def _config(cfg: Config | ModelConfig) -> Config:
    return cfg if isinstance(cfg, Config) else Config(model=cfg)


def check_request(cfg: ModelConfig, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float,
                  top_k: int | None) -> None:
    """Every rule a generation request must follow, as one GenerateError sentence."""
    if cfg.block != "pre_norm":
        raise GenerateError(f"model.block = {cfg.block!r}: the KV-cache decode path knows the pre_norm block only; "
                            "sample from a pre_norm model.")
    if len(prompt_ids) == 0:
        raise GenerateError("the prompt is empty; give at least one token of prompt.")
    bad = next((int(i) for i in prompt_ids if not 0 <= int(i) < cfg.vocab_size), None)
    if bad is not None:
        raise GenerateError(f"prompt token id {bad} is outside the model's vocabulary 0 .. {cfg.vocab_size - 1}; "
                            "use the model's own tokenizer.")
    if max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens = {max_new_tokens} must be at least 1.")
    if len(prompt_ids) + max_new_tokens > cfg.seq_len:
        raise GenerateError(f"the prompt's {len(prompt_ids)} tokens plus max_new_tokens = {max_new_tokens} exceed "
                            f"the model's context model.seq_len = {cfg.seq_len}; shorten the prompt or ask for "
                            f"at most {max(cfg.seq_len - len(prompt_ids), 0)} new tokens.")
    if temperature < 0:
        raise GenerateError(f"temperature = {temperature} must not be negative; use 0 for greedy decoding.")
    if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
        raise GenerateError(f"top_k = {top_k} must lie in 1 .. {cfg.vocab_size} (the vocabulary size).")


def param_shardings(cfg: Config, mesh) -> dict:
    """NamedShardings of the parameters on `mesh` by the storage rules (no ZeRO): heads, MLP width
    and vocabulary over `model`, layers over `stage`."""
    import jax
    from jax.sharding import NamedSharding

    from jaxpar import model
    from jaxpar.sharding import storage_rules

    rules = storage_rules(cfg, mesh)
    return jax.tree.map(lambda names: NamedSharding(mesh, rules.spec(names)), model.param_names(cfg.model),
                        is_leaf=lambda x: isinstance(x, tuple))


def generate(cfg: Config | ModelConfig, params: dict, prompt_ids: Sequence[int], max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, seed: int = 0, mesh=None,
             eos_id: int | Sequence[int] | None = None) -> list[int]:
    """The new token ids after `prompt_ids` (at most `max_new_tokens`; stops after `eos_id`, or
    after any of several).

    temperature 0: greedy (argmax); else sampling from softmax(logits / temperature), restricted
    to the `top_k` most likely tokens when given; token i uses key fold_in(key(seed), i), so a
    seed gives the same tokens on any mesh. With `mesh` (axes data, stage, model) the parameters
    are placed by the storage rules and GSPMD runs the model's tensor parallelism; without it, one
    device. The prompt is run once (prefill), then each new token reads the KV cache.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.model.decode import cache_names, init_cache

    full = _config(cfg)
    mcfg = full.model
    check_request(mcfg, prompt_ids, max_new_tokens, temperature, top_k)
    length = len(prompt_ids) + max_new_tokens
    prefill, step = _programs(full, mesh, temperature == 0, top_k)
    cache = init_cache(mcfg, 1, length)
    if mesh is not None:
        from jax.sharding import NamedSharding

        from jaxpar.parallel.checks import check_model_axis
        from jaxpar.mesh import check_mesh
        from jaxpar.sharding import compute_rules

        check_mesh(mesh)
        if mesh.shape["data"] != 1 or mesh.shape["stage"] != 1:
            raise GenerateError(f"generation runs one sequence with tensor parallelism only, but the mesh is "
                                f"{dict(mesh.shape)}; use a mesh with data = stage = 1 (e.g. --model-parallel t).")
        check_model_axis(full, mesh.shape["model"])
        params = jax.device_put(params, param_shardings(full, mesh))
        rules = compute_rules(full, mesh)
        cache = jax.device_put(cache, {n: NamedSharding(mesh, rules.spec(names))
                                       for n, names in cache_names(mcfg).items()})
    key, temperature = jax.random.key(seed), np.float32(temperature)
    token, cache = prefill(params, jnp.asarray([list(prompt_ids)], jnp.int32), cache, key, temperature)
    out = [int(token[0])]
    stop = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    for pos in range(len(prompt_ids), length - 1):
        if out[-1] in stop:
            break
        token, cache = step(params, token, cache, np.int32(pos), key, np.int32(len(out)), temperature)
        out.append(int(token[0]))
    return out


@functools.lru_cache(maxsize=16)
def _programs(cfg: Config, mesh, greedy: bool, top_k: int | None):
    """Jitted (prefill, step) for a config and mesh, compiled once per prompt and cache length.

    Token i is drawn with key fold_in(key, i) from logits / temperature (top-k restricted), or
    is the argmax when `greedy`; padded vocabulary ids are never drawn."""
    import jax
    import jax.numpy as jnp

    from jaxpar.model.decode import extend
    from jaxpar.sharding import activation_rules, compute_rules

    mcfg = cfg.model

    def sample(logits_BxV, key, i, temperature):
        logits_BxV = jnp.where(jnp.arange(logits_BxV.shape[-1]) < mcfg.vocab_size, logits_BxV, -jnp.inf)
        if greedy:
            return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        logits_BxV = logits_BxV / temperature
        if top_k is not None:
            kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
            logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
        return jax.random.categorical(jax.random.fold_in(key, i), logits_BxV).astype(jnp.int32)

    def rules():
        return contextlib.nullcontext() if mesh is None else activation_rules(mesh, compute_rules(cfg, mesh))

    def prefill(params, tokens_BxT, cache, key, temperature):
        with rules():
            logits, cache = extend(mcfg, params, tokens_BxT, cache, jnp.int32(0))
        return sample(logits[:, -1], key, 0, temperature), cache

    def step(params, token_B, cache, pos, key, i, temperature):
        with rules():
            logits, cache = extend(mcfg, params, token_B[:, None], cache, pos)
        return sample(logits[:, -1], key, i, temperature), cache

    return jax.jit(prefill, donate_argnums=2), jax.jit(step, donate_argnums=2)


# --------------------------------------------------------------------------------------------
# CLI


def parse_args(argv=None) -> argparse.Namespace:
    from jaxpar.cli import Parser, check_at_least, check_model_folder, check_run_dir

    parser = Parser(prog="python -m jaxpar.generate", description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="a run directory with checkpoints (jaxpar.train, or jaxpar.convert --to)")
    src.add_argument("--hf", help="a Hugging Face model folder (config.json + *.safetensors)")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=50, help="tokens to generate (default 50)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 for greedy decoding (default 1.0)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--model-parallel", type=int, default=1,
                        help="tensor parallelism over this many devices (default 1: one device)")
    parser.add_argument("--cpu-devices", type=int, default=None, help="simulate this many CPU devices")
    parser.add_argument("--allow-stale", action="store_true",
                        help="with --run-dir: sample from the newest checkpoint even if the run logged later steps")
    args = parser.parse_args(argv)
    # A path of the wrong kind, or an impossible value, is one `error:` line before anything is loaded.
    check_model_folder(parser, "--hf", args.hf, "--run-dir")
    check_run_dir(parser, "--run-dir", args.run_dir, "--hf")
    check_at_least(parser, "--max-new-tokens", args.max_new_tokens, 1, "ask for at least one new token")
    check_at_least(parser, "--temperature", args.temperature, 0, "pass 0 for greedy decoding, or a positive "
                   "temperature")
    check_at_least(parser, "--top-k", args.top_k, 1, "pass a positive k, or leave it out to sample from the "
                   "whole vocabulary")
    check_at_least(parser, "--model-parallel", args.model_parallel, 1, "pass 1 (one device) or more")
    check_at_least(parser, "--cpu-devices", args.cpu_devices, 1, "pass a positive number of simulated devices, "
                   "or leave it out")
    return args


def load(run_dir: str | None, hf_dir: str | None, mesh_model: int, allow_stale: bool = False):
    """(Config, params on the mesh, mesh or None, folder holding any tokenizer.json, the step read
    from a run directory or None). A run directory's newest checkpoint is refused when the run
    logged later steps than it holds, unless `allow_stale` (`checkpoint.newest_trained`)."""
    import jax

    from jaxpar import hf, model
    from jaxpar.mesh import make_mesh
    from jaxpar.train.checkpoint import newest_trained, restore_params, run_config

    step = None
    if run_dir is not None:
        if not os.path.isdir(run_dir):
            raise GenerateError(f"run directory {run_dir!r} does not exist; pass a directory written by "
                                "jaxpar.train (with checkpoints) or jaxpar.convert.")
        step = newest_trained(run_dir, allow_stale)
        cfg = run_config(run_dir, step)[0]
        folder = _run_tokenizer_folder(run_dir, cfg)
    else:
        folder = hf_dir
        cfg = Config(model=hf.config_from_hf(folder))
    cfg = cfg.replace(mesh={"data": 1, "stage": 1, "model": mesh_model},
                      parallel={"sequence_parallel": False, "zero": 0, "microbatches": 1, "virtual_stages": 1,
                                "stage_layers": None},
                      train={"global_batch": 1}, model={"init_from": None})
    if mesh_model < 1 or mesh_model > jax.device_count():
        raise GenerateError(f"--model-parallel {mesh_model} must lie in 1 .. {jax.device_count()} (the devices "
                            "there are); pass a smaller --model-parallel, or --cpu-devices N to simulate N devices.")
    mesh = make_mesh(cfg, jax.devices()[:mesh_model]) if mesh_model > 1 else None
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = param_shardings(cfg, mesh) if mesh is not None else jax.tree.map(lambda _: one,
                                                                                 model.param_shapes(cfg.model))
    if run_dir is not None:
        return cfg, restore_params(run_dir, shardings, step)[1], mesh, folder, step
    return cfg, hf.load_params(folder, cfg, shardings), mesh, folder, None


def _run_tokenizer_folder(run_dir: str, cfg: Config) -> str:
    """Where a run's tokenizer.json is: the run directory (jaxpar.convert copies it there), else
    the prepared data directory it trained on; without one, the byte tokenizer is used."""
    if os.path.isfile(os.path.join(run_dir, "tokenizer.json")):
        return run_dir
    source = cfg.data.source
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "tokenizer.json")):
        return source
    return run_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxpar.logs import quiet_libraries

    quiet_libraries()
    try:
        if args.allow_stale and args.run_dir is None:
            raise GenerateError("--allow-stale applies to --run-dir only; drop it with --hf.")
        from jaxpar.mesh import use_cpu_devices

        use_cpu_devices(args.cpu_devices)
        from jaxpar.tokenizer import byte_tokenizer, load_tokenizer

        cfg, params, mesh, folder, step = load(args.run_dir, args.hf, args.model_parallel, args.allow_stale)
        if step is not None:  # stderr: stdout is the text
            print(f"sampling from step {step} of {args.run_dir}", file=sys.stderr)
        tok = load_tokenizer(folder) if os.path.isfile(os.path.join(folder, "tokenizer.json")) else byte_tokenizer()
        ids = tok.prompt_ids(args.prompt)
        new = generate(cfg, params, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed, mesh,
                       eos_id=tok.stop_ids)
        print(tok.decode(list(ids) + new))
        return 0
    except JaxparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
