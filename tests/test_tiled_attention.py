"""The attention kernel tiled over queries and keys (`jaxpar.model.tiled_attention`): exact against
XLA's attention, within documents, over the tile pairs it is given, and O(seq · tile) in memory with
the causal optimum's matmul work, from the compiled program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.inspect import dot_flops
from jaxpar.model import tiled_attention as ta

B, N, K, H = 2, 4, 2, 8  # grouped-query heads: 4 query heads over 2 kv heads


def _inputs(T, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, H), dtype)
    k, v = (jax.random.normal(key, (B, T, K, H), dtype) for key in ks[1:3])
    return q, k, v, jax.random.normal(ks[3], (B, T, N, H), dtype)


def _reference(q, k, v, mask=None):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


def _close(got, want, rtol):
    got, want = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (got, want))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(float(np.abs(want).max()), 1.0))


@pytest.mark.parametrize("dtype,block", [("float32", 64), ("float32", 16), ("float32", 8), ("bfloat16", 16)])
def test_tiled_attention_is_xlas_attention_and_its_gradients(dtype, block):
    """Output and the gradients of q, k and v equal XLA's attention's, in one tile (64) and in 4 and
    8 tiles a side (10 and 36 tile pairs). Tolerances: the online softmax rescales its running sums
    as tiles arrive and the backward recomputes the probabilities as exp(s − lse), a few float32
    ulps; bfloat16: the 8-bit mantissa of the cast probabilities and ds, as `xla_lse`'s test."""
    q, k, v, g = _inputs(64, jnp.dtype(dtype))
    out, pull = jax.vjp(lambda q, k, v: ta.attention(q, k, v, block=block), q, k, v)
    want, pull_ref = jax.vjp(_reference, q, k, v)
    rtol = 2e-6 if dtype == "float32" else 2e-2
    _close(out, want, rtol)
    for got, exp in zip(pull(g), pull_ref(g)):
        _close(got, exp, rtol)


def test_tiled_attention_reads_only_the_tile_pairs_it_is_given():
    """The lower triangle of tiles is the whole causal attention; a list without the tiles of the
    first keys is another function (the work list is what runs, not a hint)."""
    q, k, v, _ = _inputs(32)
    pairs = ta.causal_pairs(4)
    assert pairs.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [2, 1], [2, 2], [3, 0], [3, 1], [3, 2], [3, 3]]
    _close(ta.attention(q, k, v, pairs=pairs, block=8), _reference(q, k, v), 2e-6)
    without_first_keys = pairs[(pairs[:, 1] > 0) | (pairs[:, 0] == 0)]
    assert not np.allclose(ta.attention(q, k, v, pairs=without_first_keys, block=8), _reference(q, k, v), atol=1e-3)


def test_tiled_attention_stays_inside_documents():
    """With segments, each query sees the earlier keys of its own document only: row 0 packs three
    documents (cut inside tiles and on a tile edge), row 1 is one document; outputs and gradients
    equal XLA's attention under the same mask, and each document's outputs equal its own attention."""
    T = 64
    q, k, v, g = _inputs(T)
    seg = jnp.array([[0] * 20 + [1] * 12 + [2] * 32, [0] * T], jnp.int32)
    index = jnp.arange(T, dtype=jnp.int32)
    mask = ta.Mask(index, index, seg, seg)
    out, pull = jax.vjp(lambda q, k, v: ta.attention(q, k, v, mask, block=16), q, k, v)
    same = (seg[:, :, None] == seg[:, None, :])[:, None]
    want, pull_ref = jax.vjp(lambda q, k, v: _reference(q, k, v, same), q, k, v)
    _close(out, want, 2e-6)
    for got, exp in zip(pull(g), pull_ref(g)):
        _close(got, exp, 2e-6)
    for a, b in ((0, 20), (20, 32), (32, 64)):
        _close(out[0, a:b], _reference(q[:1, a:b], k[:1, a:b], v[:1, a:b])[0], 2e-6)


def test_merge_of_two_key_halves_is_the_whole_attention():
    """Two partial attentions over disjoint keys merged by their log-sum-exp (`merge`, what a ring of
    key blocks does) are the attention over all keys; a row that saw no key of one part (o = 0,
    lse = MASKED) takes the other's values unchanged."""
    T = 32
    q, k, v, _ = _inputs(T)
    qh, kh, vh = ta.heads_major(q, K), ta.kv_heads_major(k), ta.kv_heads_major(v)
    index = jnp.arange(T, dtype=jnp.int32)
    mask = ta.Mask(index, index)
    scale = 1 / H ** 0.5
    first = np.array([[i, 0] for i in range(4)], np.int32)  # every query tile against key tile 0
    rest = np.array([[i, j] for i in range(4) for j in range(1, i + 1)], np.int32)
    o1, l1 = ta.forward(qh, kh, vh, mask, first, 8, scale)
    o2, l2 = ta.forward(qh, kh, vh, mask, rest, 8, scale)
    assert float(l2[..., :8].max()) == float(np.float32(ta.MASKED)) and float(jnp.abs(o2[..., :8, :]).max()) == 0.0
    o, _ = ta.merge(o1, l1, o2, l2)
    got = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, T, N, H)
    _close(got, _reference(q, k, v), 2e-6)


def test_tiled_attention_memory_and_work_from_the_compiled_program():
    """Forward and backward at T = 1,024 in tiles of 128 (8 a side), from the compiled program:
    XLA's temporaries at most 1/8 of the query-blocked `xla_lse` kernel's (its largest block is
    [128, 1024] scores, a tile pair's [128, 128]; measured 1.6 against 36.9 MiB), and the matmul
    FLOPs exactly the causal optimum: the 36 tile pairs of the lower triangle (half the [T, T]
    work plus the diagonal tiles), 7 matmuls each (q·kᵀ, p·v; the backward's q·kᵀ again, dv, dp,
    dq, dk). `cost_analysis` counts the scan's body once, so the FLOPs are read with the loops'
    trip counts (`jaxpar.inspect.dot_flops`)."""
    from jaxpar.model.lse_attention import lse_attention

    T, b = 1024, 128
    q = jax.ShapeDtypeStruct((1, T, N, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, K, H), jnp.float32)

    def compiled(f):
        return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))).lower(q, kv, kv).compile()

    tiled = compiled(lambda q, k, v: ta.attention(q, k, v, block=b))
    blocked = compiled(lse_attention)
    assert tiled.memory_analysis().temp_size_in_bytes * 8 <= blocked.memory_analysis().temp_size_in_bytes
    n = T // b
    optimum = 7 * 2 * H * N * (n * (n + 1) // 2) * b * b
    flops, known = dot_flops(tiled.as_text())
    assert known and flops == optimum, (flops, optimum)
    assert tiled.cost_analysis()["flops"] < optimum / 4  # (the body counted once)


def test_tile_sizes():
    """One tile up to BLOCK positions; beyond, the largest divisor of T up to BLOCK, and one tile
    where no divisor is at least MIN_TILE (a prime length runs untiled rather than in 1-token tiles)."""
    assert ta.tile(256) == 256 and ta.tile(512) == 512
    assert ta.tile(4096) == 512 and ta.tile(1536) == 512 and ta.tile(1200) == 400
    assert ta.tile(1031) == 1031  # prime


def test_long_sequences_run_the_tiled_kernel(monkeypatch):
    """`model.attention: auto` and `xla_lse` off cuDNN run the query-blocked kernel up to BLOCK
    positions and the tiled one beyond it, and on packed documents at any length."""
    from jaxpar.config import from_dict
    from jaxpar.model import layers

    asked = []
    monkeypatch.setattr(layers, "lse_attention", lambda q, k, v: asked.append("blocked") or q)
    monkeypatch.setattr(ta, "attention", lambda q, k, v, mask: asked.append("tiled") or q)
    cfg = from_dict({"model": {"d_model": 32, "n_heads": 4, "seq_len": 1024}}).model

    def run(T, segments=None):
        asked.clear()
        q = jnp.zeros((1, T, 4, 8))
        with layers.sequence_layout(None if segments is None else layers.packed(segments)):
            layers.dot_product_attention(q, q, q, cfg)
        return asked

    assert run(512) == ["blocked"]
    assert run(1024) == ["tiled"]
    assert run(64, jnp.zeros((1, 64), jnp.int32)) == ["tiled"]
