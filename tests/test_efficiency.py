"""Every run shows its efficiency: model TFLOP/s per device and MFU in each record, the step time
split into host work and waiting for the devices, a jax.profiler trace of chosen steps, and
TensorBoard scalars of every logged metric."""

import json
import math
import struct
import sys

import pytest

from jaxpar.config import ConfigError, load_config
from jaxpar.train import efficiency
from jaxpar.train.efficiency import Efficiency, known_peak_tflops
from jaxpar.train.loop import train


@pytest.mark.parametrize("kind, dtype, peak", [
    ("NVIDIA H200", "bfloat16", 989), ("NVIDIA H100 80GB HBM3", "bfloat16", 989),
    ("NVIDIA H100 80GB HBM3", "float32", 494), ("NVIDIA A100-SXM4-80GB", "bfloat16", 312),
    ("NVIDIA A100 80GB PCIe", "float16", 312), ("NVIDIA H100 PCIe", "bfloat16", None),
    ("NVIDIA H200 NVL", "bfloat16", None), ("cpu", "float32", None),
])
def test_known_device_peaks(kind, dtype, peak):
    assert known_peak_tflops(kind, dtype) == peak


def test_model_flops_are_designs_closed_form(tiny):
    """DESIGN §6.1 by hand for the tiny llama: 6·N + 12·L·d·S per token, N without the token
    embedding (its untied head included)."""
    cfg = tiny()  # 2 layers, d 32, 4 heads of 8 (2 kv heads), d_ff 64, vocab 64, seq 16, batch 8
    d, kv, ff, vocab, layers, seq = 32, 2 * 8, 64, 64, 2, 16
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * ff + 2 * d  # q, k and v, o, SwiGLU, two RMSNorm scales
    n = layers * per_layer + d + d * vocab  # final norm, head
    per_step = (6 * n + 12 * layers * d * seq) * 8 * seq
    eff = Efficiency.of(cfg, devices=8, device_kind="NVIDIA H100 80GB HBM3")
    assert eff.model_flops_per_step == per_step and eff.peak_tflops == 494  # float32 compute: TF32
    m = eff.metrics(step_time_s=0.5)
    assert m["model_tflops_per_device"] == pytest.approx(per_step / 0.5 / 8 / 1e12)
    assert m["mfu"] == pytest.approx(m["model_tflops_per_device"] / 494)
    cpu = Efficiency.of(cfg, devices=8, device_kind="cpu")
    assert cpu.peak_tflops is None and "mfu" not in cpu.metrics(0.5)
    assert Efficiency.of(cfg.replace(runtime={"peak_tflops": 2.5}), 8, "cpu").peak_tflops == 2.5


def test_progress_text():
    rec = {"model_tflops_per_device": 1.234, "step_time_s": 1.0, "device_wait_s": 0.5, "data_time_s": 0.01}
    assert efficiency.describe(rec) == "1.23 TFLOP/s/dev, MFU n/a"
    assert efficiency.describe({**rec, "mfu": 0.1234}) == "1.23 TFLOP/s/dev, MFU 12.3%"
    host_bound = {**rec, "device_wait_s": 0.01, "data_time_s": 0.6}
    assert efficiency.describe(host_bound) == "1.23 TFLOP/s/dev, MFU n/a, host-bound (data 60%)"


@pytest.mark.parametrize("override, expected", [
    ("train.profile_steps=0", "train.profile_steps = 0 must be at least 1"),
    ("train.profile_start=0", "train.profile_start = 0 must be a step number in 1 .. train.steps = 300"),
    ("train.profile_start=301", "train.profile_start = 301 must be a step number"),
    ("runtime.peak_tflops=0", "runtime.peak_tflops = 0 must be positive"),
    ("runtime.peak_tflops=-989", "runtime.peak_tflops = -989 must be positive"),
])
def test_bad_keys_are_refused(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert expected in str(e.value), e.value


def _scalars(path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of a TensorBoard event file, read from its TFRecord framing (length,
    its CRC, the serialized Event, its CRC) with the Event proto tensorboardX ships."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    data, i = path.read_bytes(), 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        event = Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4
        for v in event.summary.value:
            out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def test_run_records_efficiency_traces_and_writes_tensorboard(tiny, tmp_path):
    run = tmp_path / "run"
    cfg = tiny(train={"steps": 4, "log_every": 2, "eval_every": 2, "eval_batches": 1, "run_dir": str(run),
                      "profile_start": 2, "profile_steps": 2, "tensorboard": True},
               runtime={"peak_tflops": 1e-3})
    history = train(cfg)

    records = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4]
    flops = Efficiency.of(cfg, 8, "cpu").model_flops_per_step
    for r in records:
        assert r["model_tflops_per_device"] == pytest.approx(flops / r["step_time_s"] / 8 / 1e12), r
        assert r["mfu"] == pytest.approx(r["model_tflops_per_device"] / 1e-3), r
        parts = [r["data_time_s"], r["dispatch_time_s"], r["device_wait_s"]]
        # Disjoint parts of the wall time per step (evaluation is taken out of it).
        assert min(parts) >= 0 and sum(parts) <= r["step_time_s"] * 1.01, r
    assert [r["step"] for r in history] == [1, 2, 4]

    traces = list((run / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0, list((run / "profile").rglob("*"))

    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, events
    scalars = _scalars(events[0])
    expected = {k: {r["step"]: r[k] for r in records if k in r} for r in records for k in r if k != "step"}
    assert set(scalars) == set(expected) and "val_loss" in scalars, sorted(scalars)
    for tag, by_step in expected.items():
        assert set(scalars[tag]) == set(by_step), tag
        for step, value in by_step.items():  # stored as float32
            assert math.isclose(scalars[tag][step], value, rel_tol=1e-6, abs_tol=1e-30), (tag, step)


def test_tensorboard_without_tensorboardx_is_refused_before_anything_is_written(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    cfg = tiny(train={"run_dir": str(tmp_path / "run"), "tensorboard": True})
    with pytest.raises(ConfigError, match="needs the tensorboardX package, which is not installed"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_the_evaluated_step_keeps_its_device_time(tiny, tmp_path, monkeypatch):
    """An evaluation starts while the step before it may still run on the devices: the time left of
    that step is the step's (device_wait_s, in step_time_s), not the evaluation's (taken out of
    step_time_s), else the evaluated step reports inflated tokens/s and MFU. Here every step's new
    parameters become ready only after a host-side sleep of DELAY seconds (a callback in a jitted
    function, which runs asynchronously on the 8 CPU devices): step 2's parameters are ready no
    sooner than 2 * DELAY after step 1 was dispatched, shortly before step 1 is recorded, so the
    evaluated step 2 waits at least DELAY for them (without the wait, its step time is ~0)."""
    import dataclasses
    import time
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.train import loop

    DELAY = 0.5

    def sleep(loss):
        time.sleep(DELAY)
        return np.float32(0)

    @jax.jit
    def delayed(params, loss):
        zero = jax.pure_callback(sleep, jax.ShapeDtypeStruct((), jnp.float32), loss)
        return jax.tree.map(lambda x: x + zero.astype(x.dtype), params)

    class SlowStep:
        def __init__(self, step):
            self.step = step

        def lower(self, *args):
            compiled = self.step.lower(*args).compile()

            def run(state, batch):
                state, metrics = compiled(state, batch)
                return state._replace(params=delayed(state.params, metrics["loss"])), metrics
            return types.SimpleNamespace(compile=lambda: run)

    def build(cfg, mesh=None):
        program = real_build(cfg, mesh)
        return dataclasses.replace(program, step=SlowStep(program.step))

    real_build = loop.build
    monkeypatch.setattr(loop, "build", build)
    cfg = tiny(train={"steps": 2, "log_every": 1, "eval_every": 2, "eval_batches": 1,
                      "run_dir": str(tmp_path / "run")})
    history = train(cfg)
    assert [r["step"] for r in history] == [1, 2] and "val_loss" in history[1]
    evaluated = history[1]
    assert evaluated["device_wait_s"] >= DELAY and evaluated["step_time_s"] >= DELAY, evaluated


def test_cli_refuses_tensorboard_without_tensorboardx_before_printing(tmp_path, monkeypatch, capsys):
    """The CLI's pre-checks: one `error:` line, exit 2, before the summary and before anything is written."""
    from jaxpar.train.__main__ import main

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    monkeypatch.chdir(tmp_path)
    assert main(["--set", "train.tensorboard=true",
                 "--set", f"train.run_dir={tmp_path / 'run'}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    assert captured.err.startswith("error: train.tensorboard = true needs the tensorboardX package")
    assert captured.err.count("\n") == 1 and list(tmp_path.iterdir()) == []
