"""jaxpar.inspect: collectives, their axes, bytes and run counts, read from compiled HLO."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.inspect import Report, analyze, parse_hlo

AXES = ("data", "stage", "model")
AUTO = (jax.sharding.AxisType.Auto,) * 3


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), AXES, axis_types=AUTO)


def _report(mesh, body, out_specs, x_shape=(8, 16), in_specs=P("data", "model")):
    """Analyze a jitted shard_map of `body` over an f32 input of `x_shape`."""
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    x = jax.random.normal(jax.random.key(0), x_shape, jnp.float32)
    return analyze(jax.jit(f).lower(x).compile(), mesh)


def _only(report):
    assert len(report.collectives) == 1, f"expected one collective, got {report.collectives}"
    return report.collectives[0]


# Per-device block of the default f32[8, 16] input split over ("data", "model"): f32[4, 8].
BLOCK_BYTES = 4 * 8 * 4


@pytest.mark.parametrize("axis, out_specs", [("model", P("data")), ("data", P(None, "model"))])
def test_psum_over_one_axis_is_one_all_reduce_over_that_axis(mesh, axis, out_specs):
    c = _only(_report(mesh, lambda x: lax.psum(x, axis), out_specs))
    assert (c.kind, c.axes, c.bytes) == ("all-reduce", (axis,), BLOCK_BYTES)
    assert (c.in_loop, c.executions, c.executions_known) == (False, 1, True)
    assert "psum" in c.op_name


def test_psum_in_scan_runs_once_per_iteration(mesh):
    def body(x):
        return lax.scan(lambda c, _: (c + lax.psum(c, "model"), None), x, None, length=5)[0]

    c = _only(_report(mesh, body, P("data", "model")))
    assert (c.kind, c.axes, c.in_loop, c.executions) == ("all-reduce", ("model",), True, 5)


def test_psum_in_nested_scans_runs_product_of_lengths(mesh):
    def body(x):
        inner = lambda c, _: (c + lax.psum(c, "model"), None)
        outer = lambda c, _: (lax.scan(inner, c, None, length=4)[0], None)
        return lax.scan(outer, x, None, length=3)[0]

    c = _only(_report(mesh, body, P("data", "model")))
    assert (c.in_loop, c.executions) == (True, 12)


def test_all_gather_over_data_has_gathered_bytes(mesh):
    # all_gather's result still varies over "data" to shard_map, hence the out_specs.
    c = _only(_report(mesh, lambda x: lax.all_gather(x, "data", tiled=True), P("data", "model")))
    assert (c.kind, c.axes, c.bytes) == ("all-gather", ("data",), 2 * BLOCK_BYTES)


def test_psum_scatter_over_data_is_reduce_scatter_with_scattered_bytes(mesh):
    # Input replicated over "data" (f32[8, 8] per device), scattered into f32[4, 8] blocks.
    report = _report(mesh, lambda x: lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True),
                     P("data", "model"), in_specs=P(None, "model"))
    c = _only(report)
    assert (c.kind, c.axes, c.bytes) == ("reduce-scatter", ("data",), BLOCK_BYTES)


def test_ppermute_over_stage_is_collective_permute_over_stage(mesh):
    c = _only(_report(mesh, lambda x: lax.ppermute(x, "stage", [(0, 1), (1, 0)]),
                      P(("data", "stage"), "model")))
    assert (c.kind, c.axes, c.bytes) == ("collective-permute", ("stage",), BLOCK_BYTES)


@pytest.mark.parametrize("axis, out_specs", [("model", P("data")), ("data", P(None, "model"))])
def test_permuted_device_order_maps_groups_to_the_right_axes(axis, out_specs):
    devices = np.array(jax.devices())[[3, 6, 0, 5, 1, 7, 2, 4]].reshape(2, 2, 2)
    permuted = Mesh(devices, AXES, axis_types=AUTO)
    c = _only(_report(permuted, lambda x: lax.psum(x, axis), out_specs))
    assert c.axes == (axis,)


def test_replica_group_ids_are_read_through_the_device_order(mesh):
    # Ids index the program's device assignment; here id 1 is the device one step along "data".
    order = [mesh.devices[i, j, k] for j in range(2) for k in range(2) for i in range(2)]
    hlo = _module("%r = f32[4]{0} all-reduce(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, "
                  "to_apply=%add")
    assert parse_hlo(hlo, mesh)[0].axes == ("model",)
    assert parse_hlo(hlo, mesh, device_order=order)[0].axes == ("data",)


def test_memory_counts_replicated_argument_bytes_per_device(mesh):
    x = jax.device_put(jnp.zeros(1024, jnp.float32), NamedSharding(mesh, P()))
    report = analyze(jax.jit(lambda x: x * 2).lower(x).compile(), mesh)
    assert report.memory.argument_bytes == 1024 * 4


# --- parse_hlo on handwritten HLO -----------------------------------------------------------

def _module(*entry_lines, extra=""):
    """A module with an f32 add reducer, `extra` computations and an ENTRY of `entry_lines`."""
    body = "\n".join("  " + line for line in ("%p = f32[4]{0} parameter(0)",) + entry_lines)
    return f"""HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}
{extra}
ENTRY %main (p: f32[4]) -> f32[4] {{
{body}
}}
"""


@pytest.mark.parametrize("groups, axes", [
    ("[4,2]<=[8]", ("model",)),
    ("[4,2]<=[2,4]T(1,0)", ("data",)),
    ("[2,4]<=[4,2]T(1,0)", ("data", "stage")),
    ("[2,4]<=[2,2,2]T(0,2,1)", ("stage", "model")),
    ("[1,8]<=[8]", AXES),
    ("{{0,1},{2,3},{4,5},{6,7}}", ("model",)),
    ("{{0,2},{1,3},{4,6},{5,7}}", ("stage",)),
    ("{}", AXES),
    ("{{0},{1},{2},{3},{4},{5},{6},{7}}", ()),
    # The mesh form XLA prints for GSPMD-placed collectives (seen from jax 0.10.2 on CPU).
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", ("data",)),
    ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([4,2]T(1,0)) {'axis_0'}",
     ("data", "model")),
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}",
     ("stage",)),
    ("mesh['a'=8] {'a':(1)2}", ("data",)),
    ("mesh['a'=8] {'a':(4)2}", ("model",)),
    ("mesh['a'=8] {'a':(2)4}", ("stage", "model")),
    ("mesh['a'=2,'b'=4], device_ids=(0,2,4,6,1,3,5,7) {'b'}", ("data", "stage")),
])
def test_replica_group_formats(mesh, groups, axes):
    hlo = _module(f"ROOT %r = f32[4]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
                  "use_global_device_ids=true, to_apply=%add")
    assert parse_hlo(hlo, mesh)[0].axes == axes


def test_bytes_sum_tuple_elements_of_any_dtype(mesh):
    hlo = _module("%q = bf16[2,3]{1,0} parameter(1)", "%f = f8e4m3fn[5]{0} parameter(2)",
                  "%r = (f32[4]{0}, bf16[2,3]{1,0}, f8e4m3fn[5]{0}) all-reduce(%p, %q, %f), "
                  "replica_groups={{0,1}}, to_apply=%add")
    assert parse_hlo(hlo, mesh)[0].bytes == 4 * 4 + 6 * 2 + 5


def test_async_pair_is_one_collective_with_the_done_shape(mesh):
    hlo = _module("%s = (f32[4]{0}, f32[8]{0}) all-gather-start(%p), replica_groups=[4,2]<=[8], "
                  "dimensions={0}",
                  "ROOT %d = f32[8]{0} all-gather-done(%s)")
    (c,) = parse_hlo(hlo, mesh)
    assert (c.kind, c.bytes, c.axes, c.name) == ("all-gather", 32, ("model",), "s")


def test_collective_permute_axes_are_where_source_and_target_differ(mesh):
    hlo = _module('ROOT %r = f32[4]{0} collective-permute(%p), '
                  'source_target_pairs={{0,4},{4,0},{1,5},{5,1}}, metadata={op_name="x/ppermute"}')
    (c,) = parse_hlo(hlo, mesh)
    assert (c.kind, c.axes, c.op_name) == ("collective-permute", ("data",), "x/ppermute")


_LOOP = """
%cond{n} (t: (s32[], f32[4])) -> pred[] {{
  %t = (s32[], f32[4]{{0}}) parameter(0)
  ROOT %c = pred[] constant(true)
}}
"""


def test_executions_multiply_known_trip_counts_and_flag_unknown_ones(mesh):
    ar = "all-reduce(%x), replica_groups=[4,2]<=[8], to_apply=%add"
    extra = (_LOOP.format(n=1) + _LOOP.format(n=2) + f"""
%inner (t: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %t = (s32[], f32[4]{{0}}) parameter(0)
  %x = f32[4]{{0}} get-tuple-element(%t), index=1
  %in_inner = f32[4]{{0}} {ar}
  ROOT %o = (s32[], f32[4]{{0}}) tuple(%x, %in_inner)
}}

%outer (t: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %t = (s32[], f32[4]{{0}}) parameter(0)
  %x = f32[4]{{0}} get-tuple-element(%t), index=1
  %in_outer = f32[4]{{0}} {ar}
  ROOT %w = (s32[], f32[4]{{0}}) while(%t), condition=%cond2, body=%inner, backend_config={{"known_trip_count":{{"n":"4"}}}}
}}

%unknown (t: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %t = (s32[], f32[4]{{0}}) parameter(0)
  %x = f32[4]{{0}} get-tuple-element(%t), index=1
  %in_unknown = f32[4]{{0}} {ar}
  ROOT %o = (s32[], f32[4]{{0}}) tuple(%x, %in_unknown)
}}
""")
    hlo = _module("%x = f32[4]{0} negate(%p)",
                  f"%top = f32[4]{{0}} {ar}",
                  "%t = (s32[], f32[4]{0}) tuple(%p, %p)",
                  '%w1 = (s32[], f32[4]{0}) while(%t), condition=%cond1, body=%outer, '
                  'backend_config={"known_trip_count":{"n":"3"}}',
                  "ROOT %w2 = (s32[], f32[4]{0}) while(%t), condition=%cond1, body=%unknown",
                  extra=extra)
    runs = {c.name: (c.in_loop, c.executions, c.executions_known) for c in parse_hlo(hlo, mesh)}
    assert runs == {"top": (False, 1, True), "in_outer": (True, 3, True),
                    "in_inner": (True, 12, True), "in_unknown": (True, 1, False)}


def test_to_dict_is_json_with_the_documented_keys(mesh):
    report = _report(mesh, lambda x: lax.psum(x, "model"), P("data"))
    d = json.loads(json.dumps(report.to_dict()))
    assert set(d["memory"]) == {"argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                                "generated_code_bytes", "host_argument_bytes"}
    assert {"kind", "axes", "bytes", "in_loop", "executions", "op_name", "executions_known",
            "name", "computation"} <= set(d["collectives"][0])
    assert d["collectives"][0]["axes"] == ["model"]


def test_traffic_filters_by_kind_exact_axes_and_spanned_axis(mesh):
    hlo = _module("%a = f32[4]{0} all-reduce(%p), replica_groups=[4,2]<=[8], to_apply=%add",
                  "%b = f32[8]{0} all-gather(%p), replica_groups=[2,4]<=[4,2]T(1,0), "
                  "dimensions={0}",
                  "ROOT %c = f32[4]{0} all-reduce(%p), replica_groups=[4,2]<=[2,4]T(1,0), "
                  "to_apply=%add")
    report = Report(memory=None, collectives=parse_hlo(hlo, mesh))
    assert report.traffic() == 16 + 32 + 16
    assert report.traffic("all-reduce") == 32
    assert report.traffic(axes="data") == 16
    assert report.traffic(axes=("stage", "data")) == 32
    assert report.traffic(spans="data") == 48
    assert report.traffic(kind=("all-gather", "all-reduce"), spans="model") == 16
    assert report.table().row_count == 3


def _in_flight(mesh, body, out_specs=P("data", "model")):
    from jaxpar.inspect import collectives_in_flight
    f = jax.shard_map(body, mesh=mesh, in_specs=P("data", "model"), out_specs=out_specs)
    return collectives_in_flight(jax.jit(f).lower(jnp.ones((8, 16), jnp.float32)).compile().as_text())


def test_collectives_in_flight_counts_independent_ones_not_chained_ones(mesh):
    # Two reductions over different groups (not combinable) of the same input: both can wait at once.
    assert _in_flight(mesh, lambda x: lax.psum(x, "model") + lax.psum(x * 2, "data")) == 2
    # The second reduces the first's result: one at a time.
    assert _in_flight(mesh, lambda x: lax.psum(lax.psum(x, "model") * 2, "data")) == 1
    # A loop of reductions counts as its body's, beside an independent reduction outside it.
    scan = lambda x: lax.scan(lambda c, _: (c + lax.psum(c, "model"), None), x, None, length=3)[0]  # noqa: E731
    assert _in_flight(mesh, lambda x: scan(x) + lax.all_gather(x, "data", tiled=True)[:4]) == 2


def test_host_argument_bytes_are_the_entry_parameters_in_memory_space_5():
    """Arguments placed in host memory (`pinned_host` shardings, `parallel.offload`) carry S(5) in
    the compiled entry layout; the others, scalars and outputs do not count."""
    from jaxpar.inspect import host_argument_bytes

    hlo = ("HloModule jit_step, entry_computation_layout={(f32[512,256]{1,0}, f32[512,256]{1,0:S(5)}, "
           "bf16[8]{0:S(5)}, s32[])->(f32[512,256]{1,0:S(5)})}\n")
    assert host_argument_bytes(hlo) == 512 * 256 * 4 + 8 * 2
    assert host_argument_bytes("HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}") == 0


def test_cli_applies_runtime_xla_flags_before_compiling(tmp_path):
    """`python -m jaxpar.inspect` compiles with the flags training gets (runtime.xla_flags, in a
    fresh process before the backend starts) and prints them: here --xla_dump_to, whose dump
    shows that XLA read it."""
    import os
    import subprocess
    import sys

    dump = tmp_path / "dump"
    sets = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.vocab_size=64",
            "model.seq_len=16", "train.global_batch=8", "runtime.cpu_devices=8", f"runtime.xla_flags=--xla_dump_to={dump}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "jaxpar.inspect", *[a for s in sets for a in ("--set", s)]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next((s for s in proc.stdout.splitlines() if s.startswith("xla ")), None)
    assert line is not None and f"--xla_dump_to={dump}" in line, proc.stdout
    assert dump.is_dir() and any(dump.iterdir()), "XLA did not read the flag"


# --- context parallelism's collectives in a compiled step -----------------------------------

@pytest.mark.parametrize("c, kind", [(2, "all_gather"), (4, "all_gather"), (2, "ring"), (4, "ring")])
def test_context_collectives_are_named_with_the_kv_bytes_per_layer(tiny, c, kind):
    """A context-parallel step on data 8: its K/V all-gathers and their reduce-scatters (or the
    ring's hops) are named context's, once per layer, with the bytes of the formula."""
    from jaxpar.train.step import lower_step

    cfg = tiny(model={"seq_len": 32}, mesh={"data": 8},
               parallel={"context": c, "context_attention": kind})
    m = cfg.model
    compiled, mesh = lower_step(cfg)
    report = analyze(compiled, mesh, c)
    # One rank's K (or V): its B_loc sequences' 2L = T / c tokens of every kv head.
    b_loc = cfg.train.global_batch // (8 // c)
    block = b_loc * (m.seq_len // c) * m.kv_heads * m.head_size * 4  # float32
    ctx = report.select(context=True)
    assert ctx and all(x.axes == ("data",) and x.in_loop and x.executions == m.n_layers for x in ctx)
    assert report.select(context=True) == report.select(context=True, axes="data")
    # Nothing else is named: the gradient all-reduce, the batch's all-to-alls stay plain data.
    assert not [x for x in report.select(context=False) if x.kind in ("all-gather", "reduce-scatter",
                                                                        "collective-permute")]
    fwd = [x for x in ctx if "transpose(" not in x.op_name]
    bwd = [x for x in ctx if "transpose(" in x.op_name]
    if kind == "all_gather":
        assert [x.kind for x in fwd] == ["all-gather"] * 2 and {x.bytes for x in fwd} == {c * block}
        # The backward gathers K and V again (the forward saves the rank's own) and scatters dK, dV.
        assert sorted(x.kind for x in bwd) == ["all-gather"] * 2 + ["reduce-scatter"] * 2
        assert {x.bytes for x in bwd if x.kind == "all-gather"} == {c * block}
        assert {x.bytes for x in bwd if x.kind == "reduce-scatter"} == {block}
    else:
        assert {x.kind for x in ctx} == {"collective-permute"} and {x.bytes for x in ctx} == {block}
        assert (len(fwd), len(bwd)) == (2 * (c - 1), 2 * (c - 1) + 2 * c)
    # Received per device per layer (the ring model of `device_traffic`): (c − 1)/c of the gathered
    # K and V forward, as many gathered again and reduce-scattered backward; the ring's forward hops
    # the same bytes.
    share = {"all-gather": (c - 1) / c, "reduce-scatter": c - 1, "collective-permute": 1}
    assert sum(x.bytes * share[x.kind] for x in fwd) == 2 * (c - 1) * block
    assert sum(x.bytes * share[x.kind] for x in bwd) == (4 * (c - 1) if kind == "all_gather" else 4 * c - 2) * block
    # Without c the groups alone name them (c < data).
    assert [x.context for x in analyze(compiled, mesh).collectives] == [x.context for x in report.collectives]
