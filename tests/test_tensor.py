"""Megatron tensor parallelism and sequence parallelism over `model`: exact, and exactly two
activation collectives per sub-layer pair each way, with no full-vocabulary buffer anywhere."""

import re

import jax
import numpy as np
import pytest

from helpers import assert_parity, run_reference, run_steps
from jaxpar.config import ConfigError, from_dict, load_config
from jaxpar.inspect import analyze
from jaxpar.mesh import make_mesh
from jaxpar.train.step import lower_step

def tiny_tp(arch, model, sp, data=None, zero=0, microbatches=1):
    """n_heads 8 with 2 kv heads (llama): kv heads split for t = 2, replicated for t = 4, 8.
    vocab 60 padded to 64 (vocab_multiple 8): padded logits must never be predicted."""
    return from_dict({
        "model": {"arch": arch, "n_layers": 2, "d_model": 32, "n_heads": 8, "n_kv_heads": 2 if arch == "llama" else None,
                  "d_ff": 64, "vocab_size": 60, "vocab_multiple": 8, "seq_len": 16},
        "mesh": {"data": 8 // model if data is None else data, "model": model},
        "parallel": {"sequence_parallel": sp, "zero": zero, "microbatches": microbatches, "zero_min_elements": 0},
        "train": {"steps": 3, "global_batch": 8, "lr": 1e-2, "warmup_steps": 1},
    })


_REF = {}


def reference(arch):
    if arch not in _REF:
        _REF[arch] = run_reference(tiny_tp(arch, 1, False, data=1))
    return _REF[arch]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("model", [2, 4, 8])
def test_tensor_parallel_matches_single_device(arch, model, sp):
    assert_parity(run_steps(tiny_tp(arch, model, sp)), reference(arch))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tensor_parallel_composes_with_zero_and_accumulation(zero):
    assert_parity(run_steps(tiny_tp("llama", 4, True, data=2, zero=zero, microbatches=2)), reference("llama"))


def test_padded_vocabulary_is_never_predicted():
    """With vocab 60 padded to 64, the loss is that of a 60-way softmax, on every mesh."""
    cfg = tiny_tp("llama", 1, False, data=1)
    assert cfg.model.padded_vocab == 64
    import jax.numpy as jnp
    from jaxpar import model
    from jaxpar.train.step import cross_entropy
    params = model.init_params(cfg.model, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, 17), 0, 60)
    logits = model.apply(cfg.model, params, toks[:, :-1])
    assert logits.shape[-1] == 64
    expected = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[..., :60]), toks[:, 1:, None], -1))
    np.testing.assert_allclose(cross_entropy(logits, toks[:, 1:], 60), expected, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Structure of the compiled step (remat off).

B_LOCAL, S, H = 4, 32, 64  # sequences per data shard, seq_len, d_model


def medium_tp(t, sp, **model):
    return from_dict({
        "model": {"n_layers": 2, "d_model": H, "n_heads": 8, "d_ff": 256, "vocab_size": 512, "seq_len": S, **model},
        "mesh": {"data": 8 // t, "model": t}, "parallel": {"sequence_parallel": sp},
        "train": {"global_batch": B_LOCAL * (8 // t)},
    })


_COMPILED = {}


def compiled(cfg):
    key = (cfg.mesh.model, cfg.parallel.sequence_parallel, cfg.model)
    if key not in _COMPILED:
        _COMPILED[key] = lower_step(cfg)
    return _COMPILED[key]


def layer_activation_collectives(cfg):
    """Model-axis collectives inside the layer scans that move activations, split forward/backward."""
    c, mesh = compiled(cfg)
    t = cfg.mesh.model
    acts = [x for x in analyze(c, mesh).select(spans="model", in_loop=True) if x.bytes >= B_LOCAL * S * H * 4 // t]
    backward = [x for x in acts if "transpose" in x.op_name]
    return [x for x in acts if x not in backward], backward


@pytest.mark.parametrize("t", [2, 4, 8])
def test_two_all_reduces_per_layer_each_way(t):
    cfg = medium_tp(t, False)
    L, bsh = cfg.model.n_layers, B_LOCAL * S * H * 4
    for direction in layer_activation_collectives(cfg):
        assert sorted((x.kind, x.bytes, x.executions) for x in direction) == [("all-reduce", bsh, L)] * 2


@pytest.mark.parametrize("t", [2, 4, 8])
def test_sequence_parallel_turns_each_all_reduce_into_reduce_scatter_plus_all_gather(t):
    """Real reduce-scatters (psum_scatter in the shard_map), on CPU too: no all-reduce + dynamic-slice."""
    cfg = medium_tp(t, True)
    L, bsh = cfg.model.n_layers, B_LOCAL * S * H * 4
    for direction in layer_activation_collectives(cfg):
        assert sorted((x.kind, x.bytes, x.executions) for x in direction) == \
            [("all-gather", bsh, L)] * 2 + [("reduce-scatter", bsh // t, L)] * 2


def test_kv_heads_replicated_below_t_add_no_activation_collective():
    """n_kv_heads = 2 < t = 4: kv projections replicated, still two activation all-reduces each way."""
    cfg = medium_tp(4, False, n_kv_heads=2)
    for direction in layer_activation_collectives(cfg):
        assert [x.kind for x in direction] == ["all-reduce"] * 2


@pytest.mark.parametrize("sp", [False, True])
def test_no_full_vocabulary_buffer_on_a_device(sp):
    cfg = medium_tp(4, sp)
    c, _ = compiled(cfg)
    limit = B_LOCAL * S * cfg.model.padded_vocab
    sizes = [int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"[fbs]\d+\[([\d,]+)\]", c.as_text())]
    assert sizes and max(sizes) < limit, (max(sizes), limit)


def test_sequence_parallel_lowers_temp_memory():
    """Activations dominate (long sequence, narrow model): SP shards the norm/residual regions."""
    def temp(sp):
        c, _ = compiled(medium_tp(4, sp, d_ff=128, vocab_size=64))
        return c.memory_analysis().temp_size_in_bytes
    assert temp(True) < temp(False), (temp(True), temp(False))


# ---------------------------------------------------------------------------------------------
# Bad input: before compiling, one sentence.


@pytest.mark.parametrize("overrides, message", [
    (["model.n_heads=4", "model.d_model=128"], "model.n_heads = 4 is not divisible by mesh.model = 8"),
    (["model.n_heads=8", "model.d_ff=100"], "model.d_ff = 100 is not divisible by mesh.model = 8"),
    (["model.n_heads=8", "model.vocab_size=250", "model.vocab_multiple=2"],
     "250 -> 250 (a multiple of model.vocab_multiple = 2) is not divisible by mesh.model = 8"),
    (["model.n_heads=8", "model.n_kv_heads=8", "parallel.sequence_parallel=true", "model.seq_len=12"],
     "model.seq_len = 12 is not divisible by mesh.model = 8"),
])
def test_tensor_parallel_bad_input(overrides, message):
    cfg = load_config(None, ["mesh.data=1", "mesh.model=8", *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_mesh(cfg)


def test_kv_heads_that_neither_divide_nor_are_divided_by_t():
    cfg = load_config(None, ["mesh.data=2", "mesh.model=4", "model.n_heads=12", "model.n_kv_heads=6",
                             "model.d_model=96"])
    with pytest.raises(ConfigError, match="n_kv_heads = 6 and mesh.model = 4 must divide one another"):
        make_mesh(cfg)
