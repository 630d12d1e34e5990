"""The activations a training step saves for its backward pass, read from JAX's own linearization
of the model at the per-device shapes of a candidate layout (part of the planner's cost model:
`jaxpar.plan.memory` reads it)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from jaxpar import model

_TP_NAMES = ("heads", "mlp", "vocab", "expert_mlp")


@functools.lru_cache(maxsize=1024)
def saved_activation_bytes(mcfg, rows: int, t: int, sp: bool, remat: str, head: bool,
                           flash: bool = False, space: str | None = None, working: bool = False) -> tuple[int, int]:
    """(bytes saved for the backward pass, bytes of the largest single saved value) of the loss of
    `rows` sequences through `mcfg.n_layers` blocks (with embedding, head and loss if `head`, else
    the blocks alone) on one device of a `model` axis of size t (tensor parallelism, and sequence
    parallelism if `sp`) under remat policy `remat`.

    Read from JAX's own linearization (`saved_residuals`) of the same code the step runs, traced
    with abstract values under jaxpar's tensor-parallel marks (inside a shard_map on an abstract
    mesh): nothing is allocated, whatever the model's size. Parameters are not counted (they are
    stored anyway). With `flash`, attention is cuDNN's fused kernel as on a GPU, which saves q, k,
    v, its output and the softmax statistics instead of the [seq, seq] scores (`_flash_standin`).
    With `space` ("device" or "host"), only the values JAX places in that memory (remat `offload`
    puts its saved matmul outputs on the host). With `working`, `xla_lse` attention also saves what
    its backward materializes at once (`model.layers.backward_working_set`): with remat `none`,
    what a layer's backward holds besides cotangents."""
    from jax._src.ad_checkpoint import saved_residuals  # no public spelling in jax 0.10

    from jaxpar.sharding import LOGICAL_NAMES, Rules, TensorParallel, activation_rules
    from jaxpar.model import mtp
    from jaxpar.model.loss import cross_entropy_sum
    from jaxpar.model.transformer import REMAT_POLICIES

    names, shapes = model.param_names(mcfg), model.param_shapes(mcfg)
    split = set(_TP_NAMES) | ({"kv_heads"} if mcfg.kv_heads % t == 0 else set())
    local = jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(
        tuple(x // t if name in split and t > 1 else x for x, name in zip(s.shape, n)), s.dtype), shapes, names,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    S, D = mcfg.seq_len, mcfg.mtp_depth
    if head:  # token windows, with multi-token prediction's D more (`jaxpar.model.mtp.pad`)
        inputs = jax.ShapeDtypeStruct((rows, S + 1 + D), jnp.int32)
    else:
        inputs = jax.ShapeDtypeStruct((rows, S // t if sp and t > 1 else S, mcfg.d_model), jnp.dtype(mcfg.dtype))
    found: list = []

    def loss(params, x):
        mdl = model.bind(mcfg, params)
        if head:  # the step's objective (`mtp.objective`: the main loss, and MTP's depths)
            split = lambda rows, shift: mtp.cut(rows, shift, D)  # noqa: E731
            tokens, targets = split(x, 0)
            y = mdl.backbone(mdl.embed_tokens(tokens), remat=remat)
            return mtp.objective(mdl, y, targets, mtp.depth_rows(split, x, D, None),
                                 lambda lg, tg: cross_entropy_sum(lg, tg, mcfg.vocab_size), 1, REMAT_POLICIES[remat])
        if sp and t > 1:
            x = jax.lax.pcast(x, "model", to="varying")
        return mdl.backbone(x, remat=remat)

    def trace(_):
        # Inside the shard_map every axis is manual: the marks run Megatron's collectives and no
        # sharding constraint is left to place.
        rules = Rules({n: None for n in LOGICAL_NAMES})
        with activation_rules(None, rules, tp=TensorParallel(t, sp, mcfg.n_heads, mcfg.kv_heads),
                              compute_dtype=mcfg.dtype):
            found.extend(saved_residuals(loss, local, inputs))
        return _

    from jaxpar.model.layers import backward_working_set

    with _attention_kernel(flash), (backward_working_set() if working else contextlib.nullcontext()):
        _trace_into(found, trace, loss, local, inputs, t)
    sizes = [aval.size * aval.dtype.itemsize for aval, why in found if not str(why).startswith("from the argument")
             and (space is None or aval.memory_space.name.lower() == space)]
    return sum(sizes), max(sizes, default=0)


def _trace_into(found, trace, loss, local, inputs, t):
    from jax._src.ad_checkpoint import saved_residuals
    if t > 1:
        mesh = AbstractMesh((t,), ("model",), axis_types=(AxisType.Explicit,))
        jax.make_jaxpr(jax.shard_map(trace, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"model"}))(
            jax.ShapeDtypeStruct((), jnp.float32))
    else:  # one device: no marks are active, as in a single-device step
        found.extend(saved_residuals(loss, local, inputs))


@jax.custom_vjp
def _flash_standin(q, k, v):
    return q


def _flash_fwd(q, k, v):
    # What cuDNN's flash attention keeps for its backward: q, k, v, the output and the float32
    # log-sum-exp of each query row, [batch, heads, seq].
    out = q * 1
    lse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32) + q[..., :1].sum().astype(jnp.float32)
    return out, (q, k, v, out, lse)


def _flash_bwd(res, g):
    q, k, v, _, _ = res
    return g, jnp.zeros_like(k), jnp.zeros_like(v)


_flash_standin.defvjp(_flash_fwd, _flash_bwd)


class _attention_kernel:
    """Within this context (a trace only) `jax.nn.dot_product_attention` is the flash stand-in: the
    cuDNN kernel cannot be traced without a GPU, and only its saved values matter here."""

    def __init__(self, flash: bool):
        self.flash, self.saved = flash, None

    def __enter__(self):
        if self.flash:
            self.saved = jax.nn.dot_product_attention
            jax.nn.dot_product_attention = lambda q, k, v, **kw: _flash_standin(q, k, v)

    def __exit__(self, *exc):
        if self.flash:
            jax.nn.dot_product_attention = self.saved


@functools.lru_cache(maxsize=1024)
def _bilinear(mcfg, t: int, sp: bool, remat: str, head: bool, flash: bool,
              space: str | None = None, working: bool = False) -> tuple[float, float, float, float]:
    """(a, b, c, e) with saved bytes = a + b·rows + c·layers + e·rows·layers: every saved value is
    per row (the batch dim) or not (tables, masks), and per layer (the scan stacks it) or not
    (embedding, head, loss), so four traces give the exact bilinear form for any rows and depth."""
    f = {(r, n): saved_activation_bytes(dataclasses.replace(mcfg, n_layers=n), r, t, sp, remat, head, flash, space,
                                        working)[0]
         for r in (1, 2) for n in (1, 2)}
    e = f[2, 2] - f[1, 2] - f[2, 1] + f[1, 1]
    c = f[1, 2] - f[1, 1] - e
    b = f[2, 1] - f[1, 1] - e
    return f[1, 1] - b - c - e, b, c, e


def _activations(mcfg, rows: int, t: int, sp: bool, remat: str, head: bool, flash: bool) -> dict[str, int]:
    """Saved activations of `rows` sequences through `mcfg.n_layers` layers: stacked by the layer
    scan (`layers`), once for the step (`fixed`: RoPE tables, the causal mask), and outside the
    scan per row (`outside`: embedding, head, loss); and of one layer, what its backward holds
    besides cotangents with no remat (`layer_backward`: the residuals of every rule, and the values
    a rule's backward materializes at once, `model.layers.backward_working_set`) and what it saves
    with `remat` (`layer_saved`)."""
    out = {"layers": 0, "layer_saved": 0, "layer_backward": 0}
    for base, count in _layer_kinds(mcfg):
        a, b, c, e = _bilinear(base, t, sp, remat, head, flash)
        _, _, c0, e0 = _bilinear(base, t, sp, "none", head, flash, working=True)
        out["layers"] += int((c + e * rows) * count)  # the largest layer's, for what one layer holds:
        out["layer_saved"] = max(out["layer_saved"], int(c + e * rows))
        out["layer_backward"] = max(out["layer_backward"], int(c0 + e0 * rows))
    return {**out, "fixed": int(a), "outside": int(b * rows)}


def _layer_kinds(mcfg) -> list:
    """(a one-layer config, how many layers are like it): one kind, or a mixed MoE model's dense
    and MoE layers (`model.moe_layers`)."""
    if not mcfg.mixed:
        return [(dataclasses.replace(mcfg, n_layers=1), mcfg.n_layers)]
    one = dataclasses.replace(mcfg, n_layers=1, moe_layers="all")
    return [(one, mcfg.n_moe_layers), (model.dense_config(one), mcfg.n_layers - mcfg.n_moe_layers)]


def _offloaded(mcfg, rows: int, t: int, sp: bool, remat: str, flash: bool, platform: str) -> int:
    """Of the layer scan's saved activations, the bytes remat `offload` keeps in host memory (0 on
    XLA:CPU, where JAX lowers the host copies to nothing and they stay in device memory: measured
    equal to `dots`' temp bytes)."""
    if remat != "offload" or platform == "cpu":
        return 0
    total = 0
    for base, count in _layer_kinds(mcfg):
        _, _, c, e = _bilinear(base, t, sp, remat, True, flash, "host")
        total += int((c + e * rows) * count)
    return total


def _tap_width(m, t: int, mlp: bool = True) -> int:
    """Per token and layer, the elements of every weight matmul's input and output cotangent (what
    the split backward's I keeps for W), tensor-parallel dims divided by t (without the MLP's if
    not `mlp`: an MoE layer's are `jaxpar.plan.moe.tap_width`)."""
    qkv = (m.n_heads + 2 * m.kv_heads) * m.head_size // t
    attn = 3 * m.d_model + qkv + 2 * (m.n_heads * m.head_size // t) + m.d_model
    mats = 3 if m.arch == "llama" else 2  # up (and gate) and down
    dense = (mats - 1) * (m.d_model + m.d_ff // t) + m.d_ff // t + m.d_model
    return attn + dense * mlp


def _tap_input_width(m, t: int, mlp: bool = True) -> int:
    """The inputs' share of `_tap_width`: per token and layer, the elements of every weight
    matmul's input (q, k and v read the layer's normed input, the output projection the heads, up
    and gate the MLP's normed input, down its hidden state)."""
    attn = 3 * m.d_model + m.n_heads * m.head_size // t
    mats = 3 if m.arch == "llama" else 2
    dense = (mats - 1) * m.d_model + m.d_ff // t
    return attn + dense * mlp
