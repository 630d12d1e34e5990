"""`model.moe_exchange` (docs/moe.md, "The exchange"): expert parallelism's fixed and ragged token
exchanges. XLA:CPU cannot run `ragged_all_to_all`, so the ragged path is proven on CPU in two
parts: `ragged_plan`'s offsets and sizes against a numpy reference (a loop over ranks and
experts), and the whole `experts_parallel` ragged path, values and gradients, with the exchange
emulated by all-gathers under the same contract as jax documents it (checked on its example);
its GPU program is only lowered (jax.export for CUDA): one ragged all-to-all each way forward and
backward, one all-gather of the counts, one sort."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.mesh import make_mesh
from jaxpar.model import moe as moe_lib
from jaxpar.model import moe_exchange as mx
from jaxpar.train.step import build
from test_moe import moe_run

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # CPU thread-count warnings


def reference_plan(counts, me):
    """`ragged_plan` by loops: rank `me`'s rows sorted by expert; on each rank the rows of its
    local expert 0 from rank 0, 1, ..., then of expert 1, ...; the return the mirror."""
    R, E = counts.shape
    El = E // R
    send_off = [int(np.sum(counts[me, :e])) for e in range(E)]

    def landing(src, e):  # where src's rows for expert e start on e's rank
        q, l = divmod(e, El)
        start = sum(int(counts[s, q * El + j]) for s in range(R) for j in range(l))
        return start + sum(int(counts[s, e]) for s in range(src))

    out_off = [landing(me, e) for e in range(E)]
    recv = [int(counts[i // El, me * El + i % El]) for i in range(E)]
    recv_off = [landing(i // El, me * El + i % El) for i in range(E)]
    src_off = [int(np.sum(counts[i // El, :me * El + i % El])) for i in range(E)]
    forward = (send_off, list(counts[me]), out_off, recv)
    back = (recv_off, recv, src_off, list(counts[me]))
    return forward, back, [int(np.sum(counts[:, me * El + l])) for l in range(El)]


def simulate(plans, operands, out_rows):
    """Every rank's result of one ragged all-to-all by jax's documented contract (numpy)."""
    R = len(plans)
    per = len(plans[0][0]) // R
    outs = [np.zeros((out_rows, *operands[0].shape[1:]), operands[0].dtype) for _ in range(R)]
    for src, (in_off, sizes, out_off, _) in enumerate(plans):
        for i in range(len(in_off)):
            n = sizes[i]
            outs[i // per][out_off[i]:out_off[i] + n] = operands[src][in_off[i]:in_off[i] + n]
    for dst, (_, _, _, recv) in enumerate(plans):  # each receiver's recv_sizes match what it gets
        assert [plans[i // per][1][dst * per + i % per] for i in range(len(recv))] == list(recv)
    return outs


COUNTS = {  # [ranks, experts]
    "balanced": np.full((4, 8), 3),
    "empty experts": np.array([[2, 0, 1, 0, 4, 0, 0, 1], [0, 0, 3, 0, 1, 2, 0, 0],
                               [5, 0, 0, 0, 0, 0, 0, 2], [1, 0, 2, 0, 0, 3, 0, 0]]),
    "a rank receiving nothing": np.array([[2, 1, 0, 0, 4, 1], [0, 3, 0, 0, 1, 2], [5, 0, 0, 0, 0, 2]]),
    "a rank sending nothing": np.array([[0, 0, 0, 0], [3, 1, 4, 1], [0, 2, 0, 7], [1, 0, 0, 0]]),
    "one expert per rank": np.array([[4, 0], [2, 6]]),
}


@pytest.mark.parametrize("name", COUNTS)
def test_ragged_plan_is_the_reference_and_the_round_trip_is_identity(name):
    counts = COUNTS[name]
    R, E = counts.shape
    El = E // R
    plans = []
    for me in range(R):
        forward, back, sizes = mx.ragged_plan(jnp.asarray(counts, jnp.int32), me)
        want_f, want_b, want_sizes = reference_plan(counts, me)
        assert [list(map(int, a)) for a in forward] == [list(map(int, a)) for a in want_f], me
        assert [list(map(int, a)) for a in back] == [list(map(int, a)) for a in want_b], me
        assert list(map(int, sizes)) == want_sizes
        plans.append((forward, back, sizes))
    # Every rank's rows tagged (rank, expert, j), sorted by expert: each receiver gets them grouped
    # by local expert, each expert's run the senders' in rank order; back, each row where it was.
    rows = [np.array([(r, e, j) for e in range(E) for j in range(counts[r, e])] + [(-1, -1, -1)] * 2,
                     np.int64).reshape(-1, 3) for r in range(R)]
    out_rows = int(counts.sum())  # room for everything on one rank
    recv = simulate([[np.asarray(a) for a in p[0]] for p in plans], rows, out_rows)
    for me in range(R):
        want = [(s, me * El + l, j) for l in range(El) for s in range(R) for j in range(counts[s, me * El + l])]
        got = [tuple(r) for r in recv[me][:len(want)]]
        assert got == want and not recv[me][len(want):].any(), me
    back = simulate([[np.asarray(a) for a in p[1]] for p in plans], recv, rows[0].shape[0] + 64)
    for r in range(R):
        n = int(counts[r].sum())
        np.testing.assert_array_equal(back[r][:n], rows[r][:n])
        assert not back[r][n:].any()


def test_the_emulation_is_jax_documented_ragged_all_to_all():
    """The example of `jax.lax.ragged_all_to_all`'s docstring, on 2 ranks."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    args = [np.array(a, np.int32) for a in ([[1, 2, 2], [3, 4, 0]], [[0, 0, 0, 0]] * 2, [[0, 1], [0, 1]],
                                            [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])]

    def body(*a):
        return mx.emulated_ragged_all_to_all(*(x[0] for x in a), axis_name="x")[None]

    got = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"))(
        *(jax.device_put(a, NamedSharding(mesh, P("x"))) for a in args))
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


def layer_case(d, E, N, k, D=16, F=8):
    x = jax.random.normal(jax.random.key(0), (d * N, D))
    scores = jax.random.uniform(jax.random.key(1), (d * N, E))
    if E >= 8:  # experts 2 and 3 never chosen: on 4 ranks rank 1 (experts 2, 3) receives nothing
        scores = scores.at[:, 2:4].set(-1.0)
    experts = jax.lax.top_k(scores, k)[1]  # k distinct experts per token, as the router picks them
    gates = jax.random.uniform(jax.random.key(2), (d * N, k))
    ws = [jax.random.normal(jax.random.key(3 + i), s) * 0.3 for i, s in enumerate([(E, D, F), (E, D, F), (E, F, D)])]
    return x, experts, gates, ws


def ep_loss(mesh, d, E, N, k, exchange, groups=None, kernel="auto"):
    El = max(1, E // d)
    rows = N * min(k, El)  # (`buffer_rows`, dropless)

    def body(x, e, g, keep, w1, w2, w3):
        return moe_lib.experts_parallel(x, e, g, keep, w1, w2, w3, n_experts=E, rows=rows, groups=groups,
                                        exchange=exchange, kernel=kernel)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 7, out_specs=P("data"))
    return lambda x, e, g, keep, *w: jnp.sum(jnp.sin(f(x, e, g, keep, *w)))


@pytest.mark.parametrize("case", ["split", "capacity", "replicated"])
def test_the_ragged_path_is_the_fixed_path_and_the_dropless_layer(case):
    """`experts_parallel` on 4 data ranks (8 experts: an empty expert and a rank that receives
    nothing; with a capacity mask dropping a third of the assignments), or 8 ranks with 4 experts
    on 2 replicas each (exchange groups): the ragged exchange (emulated) gives the fixed
    exchange's values and gradients, and both the one-device dropless layer's."""
    d, E, N, k = (8, 4, 6, 2) if case == "replicated" else (4, 8, 6, 2)
    mesh = jax.make_mesh((d,), ("data",), devices=jax.devices()[:d])
    x, experts, gates, ws = layer_case(d, E, N, k)
    keep = (jax.random.uniform(jax.random.key(9), (d * N, k)) > 0.33).astype(jnp.float32)
    keep = keep if case == "capacity" else jnp.ones_like(keep)

    def dense(x, g, *w):
        return jnp.sum(jnp.sin(moe_lib.experts_dropless(x, experts, g * keep, *w)))

    want = jax.value_and_grad(dense, argnums=(0, 1, 2, 3, 4))(x, gates, *ws)
    groups, w_ep = None, ws
    if case == "replicated":  # each rank holds its own expert whole (rank q: expert q // 2)
        groups = moe_lib.replica_groups(E, d)
        w_ep = [w[jnp.arange(d) // (d // E)] for w in ws]
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))  # noqa: E731
    got = {}
    for exchange in ("fixed", "ragged"):
        loss = ep_loss(mesh, d, E, N, k, exchange, groups=groups)
        f = jax.jit(jax.value_and_grad(lambda x, g, *w: loss(x, put(experts), g, put(keep), *w),
                                       argnums=(0, 1, 2, 3, 4)))
        with mx.emulated():
            got[exchange] = f(put(x), put(gates), *map(put, w_ep))
    if case == "replicated":  # the replicas' weight gradients summed: the expert's
        for ex in got:
            value, (dx, dg, *dw) = got[ex]
            got[ex] = value, (dx, dg, *[np.asarray(a).reshape(E, 2, *a.shape[1:]).sum(1) for a in dw])
    for a, b, c in zip(jax.tree.leaves(want), jax.tree.leaves(got["fixed"]), jax.tree.leaves(got["ragged"])):
        np.testing.assert_allclose(b, a, atol=2e-5)
        np.testing.assert_allclose(c, a, atol=2e-5)
    assert float(jnp.max(jnp.abs(got["ragged"][1][2]))) > 0.1  # the experts' gradients are not trivially 0


def lowered(exchange, platform, grad):
    d, E, N, k, D, F = 4, 8, 12, 2, 16, 8
    mesh = jax.sharding.AbstractMesh((d,), ("data",))
    # (The grouped matmuls as GPUs run them under `auto`: `ragged_dot`; the CPU's `_blocked`
    # pads each expert's rows to whole blocks.)
    loss = ep_loss(mesh, d, E, N, k, exchange, kernel="ragged_dot")
    f = jax.grad(loss, argnums=(0, 2, 4, 5, 6)) if grad else loss
    args = [jax.ShapeDtypeStruct((d * N, D), jnp.float32), jax.ShapeDtypeStruct((d * N, k), jnp.int32),
            jax.ShapeDtypeStruct((d * N, k), jnp.float32), jax.ShapeDtypeStruct((d * N, k), jnp.float32)] + [
        jax.ShapeDtypeStruct(s, jnp.float32) for s in [(E, D, F), (E, D, F), (E, F, D)]]
    checks = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    return jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(*args).mlir_module()


@pytest.mark.parametrize("grad", [False, True])
def test_the_ragged_path_lowers_for_cuda_one_exchange_each_way(grad):
    """The GPU program, lowered without a GPU: two ragged all-to-alls forward (to the experts and
    back) and two more in the backward (their transposes), no all-to-all of the token rows, one
    all-gather (the counts), one sort (the routing permutation), into the worst-case receive
    buffer (dropless)."""
    text = lowered("ragged", "cuda", grad)
    assert len(re.findall(r"custom_call @ragged_all_to_all\(", text)) == (4 if grad else 2)
    assert "stablehlo.all_to_all" not in text
    assert len(re.findall(r"stablehlo\.all_gather", text)) == 1
    assert len(re.findall(r"stablehlo\.sort", text)) == 1
    # Each rank's receive buffer: 4 ranks x 12 tokens x min(k, 2 local experts) rows of d_model.
    assert "tensor<96x16xf32>" in re.search(r"custom_call @ragged_all_to_all\(.*", text).group(0)


def test_the_fixed_path_sorts_once():
    """The fixed exchange's receiver groups its rows by a counting sort: one sort in the program
    forward and backward (the sender's argsort by expert)."""
    text = lowered("fixed", "cpu", True)
    assert len(re.findall(r"stablehlo\.sort", text)) == 1
    # (Forward the rows, their local experts' ids and the results; backward the two transposes.)
    assert "@ragged_all_to_all" not in text and len(re.findall(r"stablehlo\.all_to_all", text)) == 5


def test_auto_is_ragged_on_gpus_only():
    assert [mx.resolve("auto", p) for p in ("gpu", "cpu", "tpu")] == ["ragged", "fixed", "fixed"]
    assert [mx.resolve(c, "cpu") for c in ("fixed", "ragged")] == ["fixed", "ragged"]


def test_ragged_is_refused_on_cpu_before_compiling():
    cfg = moe_run(4, 1, 1, moe_exchange="ragged")
    with pytest.raises(ConfigError) as err:
        build(cfg, make_mesh(cfg, jax.devices()[:4]))
    msg = str(err.value)
    assert msg.startswith("model.moe_exchange = ragged") and "set model.moe_exchange=auto" in msg and "\n" not in msg
