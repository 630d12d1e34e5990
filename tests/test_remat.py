"""Remat policies beyond none/dots/full: `dots_except_mlp` (save the attention projections,
recompute the MLP) and `offload` (what `dots` saves, in pinned host memory). Parity with one
device, what each saves read from the compiled step and from JAX's own residuals, the planner's
model of them, and the refusals."""

import dataclasses
import types

import jax
import pytest

from helpers import COMPILER_OPTIONS, assert_parity, run_reference, run_steps
from jaxpar import costs
from jaxpar.config import ConfigError, from_dict
from jaxpar.mesh import make_mesh
from jaxpar.train.step import build, check_host_memory

_REF = {}


def check_parity(cfg):
    key = (cfg.model.arch, cfg.model.n_layers, cfg.train.global_batch)
    if key not in _REF:  # the single-device run without remat
        _REF[key] = run_reference(cfg.replace(parallel={"remat": "none", "schedule": "1f1b"}))
    assert_parity(run_steps(cfg), _REF[key])


# Each policy on a mesh where its names matter: tensor parallelism (the attention output is
# named after its all-reduce, or reduce-scatter under SP), ZeRO (no gathered weight saved), and
# for dots_except_mlp a split-backward pipeline (the tapped matmuls of ZB-H1).
@pytest.mark.parametrize("arch, remat, mesh, par", [
    ("llama", "dots_except_mlp", (2, 1, 2), dict(zero=1, sequence_parallel=True)),
    ("gpt2", "dots_except_mlp", (4, 1, 2), dict(zero=3, zero_min_elements=0)),
    ("llama", "dots_except_mlp", (1, 2, 2), dict(schedule="zb_h1", microbatches=4)),
    ("llama", "offload", (2, 1, 2), dict(zero=3, zero_min_elements=0, sequence_parallel=True)),
    ("gpt2", "offload", (4, 1, 1), dict(zero=1, microbatches=2)),
])
def test_policy_matches_single_device(tiny, arch, remat, mesh, par):
    cfg = tiny(arch, mesh=dict(zip(("data", "stage", "model"), mesh)), parallel=dict(remat=remat, **par))
    check_parity(cfg)


def medium(remat):
    """Big enough that saved activations dominate XLA's fixed buffers (d_ff 3 x d_model, seq 128)."""
    return from_dict({"model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "n_kv_heads": 2, "d_ff": 384,
                                "vocab_size": 256, "seq_len": 128},
                      "mesh": {"data": 2}, "parallel": {"remat": remat}, "train": {"global_batch": 4}})


def test_compiled_step_holds_what_each_policy_saves():
    """dots_except_mlp keeps less than dots (not the MLP's [seq, d_ff] up and gate outputs) and
    more than full (the q, k, v and attention outputs); offload on XLA:CPU holds what dots does
    (JAX lowers its host copies to nothing on CPU, whose device memory is host memory)."""
    temp = {}
    for remat in ("dots", "dots_except_mlp", "full", "offload"):
        program = build(cfg := medium(remat), make_mesh(cfg, jax.devices()[:2]))
        # (LLVM's optimizations off, as the parity runs: buffer assignment is XLA's, the same.)
        compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile(COMPILER_OPTIONS)
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["full"] < temp["dots_except_mlp"] < temp["dots"], temp
    # Per device, 4 layers x 2 rows x 128 tokens: the MLP's two saved [d_ff] outputs are 3.1 MB,
    # q, k, v and o 2.1 MB; XLA's reuse of buffers takes part of each (measured 2.36 and 2.02 MB).
    assert temp["dots"] - temp["dots_except_mlp"] > 1.5e6, temp
    assert temp["dots_except_mlp"] - temp["full"] > 1.0e6, temp
    assert temp["offload"] == temp["dots"], temp


def test_offload_saves_the_matmul_outputs_in_host_memory():
    """JAX's own residuals of the model under `offload`: every matmul output `dots` saves is in
    host memory, the device keeps only what `full` keeps (each layer's input)."""
    m = medium("offload").model
    saved = lambda remat, space=None: costs.saved_activation_bytes(m, 2, 1, False, remat, False, space=space)[0]  # noqa: E731
    assert saved("offload", "host") > 0
    assert saved("offload", "host") + saved("offload", "device") == saved("dots")
    assert saved("offload", "device") == saved("full")
    assert saved("dots", "host") == 0


def test_planner_models_each_policy():
    """On a GPU the offloaded bytes leave the device total (and are reported as host memory); on
    CPU they stay (measured above). Recomputed FLOPs: dots = offload < dots_except_mlp < full."""
    cfg = from_dict({"model": {"n_layers": 4, "d_model": 256, "n_heads": 4, "d_ff": 1024, "vocab_size": 256,
                               "seq_len": 256, "dtype": "bfloat16"}, "train": {"global_batch": 8}})
    at = lambda remat: dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, remat=remat))  # noqa: E731
    shape = (1, 1, 1)
    gpu = {r: costs.memory(at(r), shape, "gpu") for r in ("dots", "offload", "dots_except_mlp", "full")}
    host = gpu["offload"]["host_activations"]
    assert host > 0 and gpu["dots"]["host_activations"] == 0
    assert gpu["offload"]["total"] == gpu["dots"]["total"] - host
    assert gpu["full"]["total"] < gpu["dots_except_mlp"]["total"] < gpu["dots"]["total"]
    cpu = costs.memory(at("offload"), shape, "cpu")
    assert cpu["host_activations"] == 0 and cpu["total"] == costs.memory(at("dots"), shape, "cpu")["total"]
    flops = {r: costs.hardware_flops_per_token(at(r), 1) for r in ("none", "dots", "offload", "dots_except_mlp", "full")}
    assert flops["none"] < flops["dots"] == flops["offload"] < flops["dots_except_mlp"] < flops["full"], flops


def test_offload_is_refused_under_a_pipeline(tiny):
    cfg = tiny(mesh={"data": 1, "stage": 2}, parallel={"remat": "offload", "microbatches": 2})
    with pytest.raises(ConfigError, match=r"parallel.remat = offload cannot run with mesh.stage = 2.*set parallel.remat=dots"):
        build(cfg, make_mesh(cfg, jax.devices()[:2]))


def test_offload_is_refused_without_pinned_host_memory(tiny):
    cfg = tiny(parallel={"remat": "offload"})
    device = types.SimpleNamespace(platform="neuron", addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
    with pytest.raises(ConfigError, match=r"parallel.remat = offload needs pinned_host memory.*\['device'\].*"
                                          r"set parallel.remat=dots"):
        check_host_memory(cfg, device)
    check_host_memory(cfg, jax.devices()[0])  # XLA:CPU lists pinned_host
    check_host_memory(tiny(parallel={"remat": "dots"}), device)  # only offload needs it
