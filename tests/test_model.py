"""Behaviour of the model: causality, remat, jit, grouped-query attention, bf16 compute."""

import math
import re

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
    (bf16/fp16, head size a multiple of 8 up to 128), and runs `xla_lse` elsewhere and where cuDNN
    refuses the shapes while tracing. jax's own default (`implementation=None`) is XLA's attention,
    which on an H200 held the float32 [seq, seq] scores of every head (64 GiB for Llama-1B at
    8 x 2048)."""
    from jaxpar.model import layers

    asked, refuse = [], []
    real = jax.nn.dot_product_attention

    def spy(*args, implementation=None, **kw):
        asked.append(implementation)
        if implementation in refuse:
            raise NotImplementedError("cuDNN refuses these shapes")
        return real(*args, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    monkeypatch.setattr(layers, "lse_attention", lambda q, k, v: asked.append("xla_lse") or q)
    q = jnp.zeros((1, 8, 4, 16), jnp.bfloat16)

    def implementation(backend, **kw):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        asked.clear()
        layers.dot_product_attention(q, q, q, small(**kw))
        return asked

    assert implementation("gpu", dtype="bfloat16") == ["cudnn"]
    assert implementation("gpu", dtype="float16") == ["cudnn"]
    assert implementation("cpu", dtype="bfloat16") == ["xla_lse"]
    assert implementation("gpu", dtype="float32") == ["xla_lse"]
    assert implementation("gpu", dtype="bfloat16", head_dim=12) == ["xla_lse"]
    assert implementation("gpu", dtype="bfloat16", attention="xla") == ["xla"]
    assert implementation("gpu", dtype="bfloat16", attention="xla_lse") == ["xla_lse"]
    assert implementation("gpu", dtype="float32", attention="cudnn") == ["cudnn"]
    refuse.append("cudnn")
    assert implementation("gpu", dtype="bfloat16") == ["cudnn", "xla_lse"]


def _saved(f, *args):
    """Shapes of the values JAX's linearization of f keeps for the backward pass (not its arguments)."""
    from jax._src.ad_checkpoint import saved_residuals  # no public spelling in jax 0.10

    return [a.shape for a, why in saved_residuals(f, *args) if not str(why).startswith("from the argument")]


def test_lse_attention_query_blocks():
    """Causal query blocks of at least 64 rows, at most 8, dividing the sequence; one block where
    the keys are not the queries' own sequence."""
    from jaxpar.model.lse_attention import query_blocks

    assert query_blocks(32, 32) == [(0, 32)]
    assert query_blocks(128, 128) == [(0, 64), (64, 128)]
    assert query_blocks(192, 192) == [(0, 64), (64, 128), (128, 192)]
    assert query_blocks(4096, 4096) == [(i * 512, (i + 1) * 512) for i in range(8)]
    assert query_blocks(100, 100) == [(0, 100)]
    assert query_blocks(130, 130) == [(0, 65), (65, 130)]
    assert query_blocks(128, 256) == [(0, 128)]


@pytest.mark.parametrize("dtype,T", [("float32", 32), ("bfloat16", 32), ("float32", 192), ("bfloat16", 192)])
def test_lse_attention_is_xlas_attention_keeping_no_seq_by_seq_value(dtype, T):
    """`xla_lse` computes XLA's attention (grouped-query heads: 8 query heads over 2 kv heads) and
    its gradients, and keeps [heads, seq] floats for its backward where XLA's keeps [seq, seq]
    probabilities, scores and masks; at T = 192 in three causal query blocks (`query_blocks`),
    at 32 in one. Tolerances: the forward is the same einsums and float32 softmax (float32
    rounding apart: a block's row sums run over its own keys); the backward recomputes the
    probabilities as exp(s - lse) instead of reusing softmax's and sums dk and dv over the
    blocks, a few float32 ulps (bf16: its 8-bit mantissa on the cast ds)."""
    from jaxpar.model.lse_attention import lse_attention

    B, N, K, H = 2, 8, 2, 16
    ks = jax.random.split(jax.random.key(0), 4)
    dt = jnp.dtype(dtype)
    q = jax.random.normal(ks[0], (B, T, N, H), dt)
    k, v = (jax.random.normal(key, (B, T, K, H), dt) for key in ks[1:3])
    g = jax.random.normal(ks[3], (B, T, N, H), dt)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    out, pull = jax.vjp(lse_attention, q, k, v)
    want, pull_ref = jax.vjp(ref, q, k, v)
    rtol = 2e-6 if dtype == "float32" else 2e-2
    f32 = lambda a: np.asarray(a.astype(jnp.float32))
    np.testing.assert_allclose(f32(out), f32(want), rtol=rtol, atol=rtol)
    for got, exp in zip(pull(g), pull_ref(g)):
        np.testing.assert_allclose(f32(got), f32(exp), rtol=rtol, atol=rtol * float(jnp.abs(f32(exp)).max()))
    kept = _saved(lambda q, k, v: lse_attention(q, k, v).astype(jnp.float32).sum(), q, k, v)
    assert kept and all(s[-2:] != (T, T) for s in kept), kept
    assert any(s[-2:] == (T, T) for s in _saved(lambda q, k, v: ref(q, k, v).astype(jnp.float32).sum(), q, k, v))


def test_lse_attention_query_blocks_skip_the_masked_triangle(monkeypatch):
    """From the compiled forward and backward: in 4 causal query blocks (T = 256) the attention
    runs (n + 1) / 2n = 5/8 of the one-block program's FLOPs (every [T, S] product and elementwise
    op is computed for the blocks under the diagonal only); 0.7 leaves room for the ops that do
    not scale (the per-row log-sum-exp and delta, the pads of dk and dv)."""
    from jaxpar.model import lse_attention as la

    B, T, N, K, H = 1, 256, 4, 2, 16
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.float32)

    def flops():
        step = jax.jit(jax.grad(lambda q, k, v: la.lse_attention(q, k, v).sum(), argnums=(0, 1, 2)))
        return step.lower(q, kv, kv).compile().cost_analysis()["flops"]

    assert len(la.query_blocks(T, T)) == 4
    blocked = flops()
    monkeypatch.setattr(la, "MAX_BLOCKS", 1)
    assert len(la.query_blocks(T, T)) == 1
    assert blocked < 0.7 * flops(), blocked


def test_lse_attention_transposes_no_score_sized_array():
    """From the compiled forward and backward on XLA:CPU: every attention matmul runs heads-major
    (`lse_attention._heads`), so the only transposes move [T, heads, H]-sized values (q, k, v, do
    in; o, dq, dk, dv out), none a query block's [t, S] scores, probabilities or their cotangents.
    In XLA's [B, T, K, G, H] order each einsum transposed its operands and ds was computed in two
    layouts (B 2, T 128, 4 heads over 2 kv heads of 16: transposes of up to 65,536 floats)."""
    from jaxpar.model import lse_attention as la

    B, T, N, K, H = 2, 128, 4, 2, 16
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.float32)
    step = jax.jit(jax.grad(lambda q, k, v: la.lse_attention(q, k, v).sum(), argnums=(0, 1, 2)))
    text = step.lower(q, kv, kv).compile().as_text()
    moved = [math.prod(int(d) for d in m.group(1).split(",") if d)
             for m in re.finditer(r"= f32\[([0-9,]*)\]\{[0-9,]*\} transpose\(", text)]
    assert la.query_blocks(T, T) == [(0, 64), (64, 128)]
    assert moved and max(moved) <= B * T * N * H < B * N * 64 * 64, sorted(moved)


def test_the_planners_working_set_trace_counts_one_query_block():
    """`backward_working_set` (the planner's trace of what a layer's backward holds) saves, beside
    `xla_lse` attention's residuals, the largest query block's float32 p, dp and ds, exactly: at T
    = 128, the block of rows [64, 128) over all 128 keys."""
    from jaxpar.model.layers import backward_working_set, dot_product_attention

    cfg = ModelConfig(arch="llama", n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
                      vocab_size=64, seq_len=128)
    B, T, N, K, H = 2, 128, 4, 2, 16
    q = jnp.ones((B, T, N, H), jnp.float32)
    kv = jnp.ones((B, T, K, H), jnp.float32)
    f = lambda q, k, v: dot_product_attention(q, k, v, cfg).sum()
    kept = lambda: sum(math.prod(s) for s in _saved(f, q, kv, kv))
    plain = kept()
    with backward_working_set():
        assert kept() - plain == 3 * B * N * 64 * T


@pytest.mark.parametrize("x_shape,w_shape,k", [
    ((2, 16, 8), (8, 24), 1),      # C < O: the transposed input feeds the weight gradient
    ((2, 16, 24), (24, 8), 1),     # C > O (an MLP's down projection): the transposed cotangent
    ((2, 16, 4, 6), (4, 6, 8), 2),  # two contracting dims (attention's output projection)
])
def test_linear_is_the_einsum_with_its_gradients(x_shape, w_shape, k):
    """`layers.linear` (on XLA:CPU a custom backward whose weight gradient multiplies a transposed
    copy of the smaller of x and g) computes the einsum and its gradients. Tolerance: float32
    sums in another order."""
    from jaxpar.model.layers import linear

    kx, kw, kg = jax.random.split(jax.random.key(2), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    n = len(x_shape)
    ref = lambda x, w: jnp.einsum(x, list(range(n)), w, [*range(n - k, n), *range(n, n + len(w_shape) - k)])
    out, pull = jax.vjp(lambda x, w: linear(x, w, k), x, w)
    want, pull_ref = jax.vjp(ref, x, w)
    g = jax.random.normal(kg, out.shape)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    for got, exp in zip(pull(g), pull_ref(g)):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)


def test_swiglu_keeps_its_two_inputs_only():
    """`layers.swiglu` is silu(g) * u with JAX's gradients, keeping g and u for its backward, where
    JAX's own derivative keeps four more [tokens, d_ff] values; a dense llama layer keeps three
    [tokens, d_ff] values in all (g, u and the down projection's input). Tolerance: the backward's
    float32 sigmoid formula against JAX's chain rule, a few ulps."""
    from jaxpar.model.layers import swiglu

    g, u, dh = (jax.random.normal(key, (4, 8, 48)) for key in jax.random.split(jax.random.key(1), 3))
    plain = lambda g, u: jax.nn.silu(g) * u
    out, pull = jax.vjp(swiglu, g, u)
    want, pull_ref = jax.vjp(plain, g, u)
    np.testing.assert_array_equal(out, want)
    for got, exp in zip(pull(dh), pull_ref(dh)):
        np.testing.assert_allclose(got, exp, rtol=1e-6, atol=1e-6)
    assert len(_saved(lambda g, u: swiglu(g, u).sum(), g, u)) == 0  # g and u are its arguments
    assert len(_saved(lambda g, u: plain(g, u).sum(), g, u)) >= 2
    cfg = small(n_layers=1, d_ff=48)
    params = model.init_params(cfg, jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (2, cfg.seq_len, cfg.d_model))
    wide = [s for s in _saved(lambda p, x: model.bind(cfg, p).backbone(x, remat="none").sum(), params, x) if s[-1] == 48]
    assert len(wide) == 3, wide


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
