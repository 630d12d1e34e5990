"""Behaviour of the model: causality, remat, jit, grouped-query attention, bf16 compute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import model
from jaxpar.config import ModelConfig
from jaxpar.train.step import cross_entropy


def small(arch="llama", **kw) -> ModelConfig:
    base = dict(arch=arch, n_layers=2, d_model=32, n_heads=4, d_ff=64, vocab_size=64, seq_len=16)
    return ModelConfig(**{**base, **kw})


def tokens(seed, cfg, batch=2):
    return jax.random.randint(jax.random.key(seed), (batch, cfg.seq_len), 0, cfg.vocab_size)


def loss(cfg, params, toks, remat="none"):
    logits = model.apply(cfg, params, toks[:, :-1], remat=remat)
    return cross_entropy(logits, toks[:, 1:])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_causal(arch):
    """The output at position t has zero gradient with respect to the inputs after t, nonzero before."""
    cfg = small(arch)
    m = model.bind(cfg, model.init_params(cfg, jax.random.key(1)))
    x_BxTxD = m.embed_tokens(tokens(2, cfg))
    t = 5
    g = jax.grad(lambda x: m.head(m.backbone(x))[:, t].sum())(x_BxTxD)
    assert float(jnp.abs(g[:, t + 1:]).max()) == 0.0, "a later position influenced an earlier output"
    assert float(jnp.abs(g[:, :t + 1]).min(axis=-1).max()) > 0.0, "earlier positions must influence it"


@pytest.mark.parametrize("remat", ["full", "dots", "dots_except_mlp", "offload"])
def test_remat_equals_no_remat(remat):
    cfg = small()
    params = model.init_params(cfg, jax.random.key(3))
    toks = tokens(4, cfg)
    l0, g0 = jax.value_and_grad(loss, argnums=1)(cfg, params, toks)
    l1, g1 = jax.value_and_grad(loss, argnums=1)(cfg, params, toks, remat)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)  # same ops recomputed: rounding-level only
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_jit_equals_no_jit(arch):
    cfg = small(arch)
    params = model.init_params(cfg, jax.random.key(5))
    toks = tokens(6, cfg)
    eager = model.apply(cfg, params, toks)
    jitted = jax.jit(lambda p, t: model.apply(cfg, p, t))(params, toks)
    # XLA fuses differently under jit: float32 rounding of sums of ~32 terms.
    np.testing.assert_allclose(jitted, eager, atol=1e-5)


def test_gqa_matches_repeated_kv_heads():
    """GQA with K kv heads equals full multi-head attention whose kv weights repeat each head N/K times."""
    gqa = small(n_heads=4, n_kv_heads=2)
    mha = small(n_heads=4, n_kv_heads=4)
    params = model.init_params(gqa, jax.random.key(7))
    rep = jax.tree.map(lambda x: x, params)
    for w in ("wk", "wv"):
        rep["blocks"]["attn"][w] = jnp.repeat(params["blocks"]["attn"][w], 2, axis=2)  # [L, D, K, H] -> [L, D, N, H]
    toks = tokens(8, gqa)
    assert params["blocks"]["attn"]["wk"].shape[2] == 2
    np.testing.assert_allclose(model.apply(gqa, params, toks), model.apply(mha, rep, toks), atol=1e-5)


def test_auto_attention_is_cudnn_on_a_gpu(monkeypatch):
    """`model.attention: auto` asks jax for cuDNN's kernel on a GPU where the model's rule applies
    (bf16/fp16, head size a multiple of 8 up to 128), XLA's elsewhere and where cuDNN refuses the
    shapes while tracing. jax's own default (`implementation=None`) is XLA's attention, which on
    an H200 held the float32 [seq, seq] scores of every head (64 GiB for Llama-1B at 8 x 2048)."""
    from jaxpar.model import layers

    asked, refuse = [], []
    real = jax.nn.dot_product_attention

    def spy(*args, implementation=None, **kw):
        asked.append(implementation)
        if implementation in refuse:
            raise NotImplementedError("cuDNN refuses these shapes")
        return real(*args, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    q = jnp.zeros((1, 8, 4, 16), jnp.bfloat16)

    def implementation(backend, **kw):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        asked.clear()
        layers.dot_product_attention(q, q, q, small(**kw))
        return asked

    assert implementation("gpu", dtype="bfloat16") == ["cudnn"]
    assert implementation("gpu", dtype="float16") == ["cudnn"]
    assert implementation("cpu", dtype="bfloat16") == ["xla"]
    assert implementation("gpu", dtype="float32") == ["xla"]
    assert implementation("gpu", dtype="bfloat16", head_dim=12) == ["xla"]
    assert implementation("gpu", dtype="bfloat16", attention="xla") == ["xla"]
    assert implementation("gpu", dtype="float32", attention="cudnn") == ["cudnn"]
    refuse.append("cudnn")
    assert implementation("gpu", dtype="bfloat16") == ["cudnn", "xla"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bf16_compute_close_to_float32(arch):
    cfg = small(arch)
    params = model.init_params(cfg, jax.random.key(9))
    toks = tokens(10, cfg, batch=4)
    l32 = float(loss(cfg, params, toks))
    l16 = float(loss(small(arch, dtype="bfloat16"), params, toks))
    assert np.isfinite(l16)
    # bf16 keeps 8 bits of mantissa: relative error ~4e-3 per op, averaged over the loss's terms.
    assert abs(l16 - l32) < 0.02 * l32, (l16, l32)


def test_param_tree_names_every_dim():
    cfg = small("llama")
    shapes, names = model.param_shapes(cfg), model.param_names(cfg)
    for s, n in zip(jax.tree.leaves(shapes), jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))):
        assert len(s.shape) == len(n)
    assert names["blocks"]["mlp"]["w_up"] == ("layers", "embed", "mlp")
