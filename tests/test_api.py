"""The Python API: `jaxpar.train` is the package `jaxpar/train/` and also the function that trains.

Each check runs in a fresh interpreter, because what `jaxpar.train` is bound to depends on the
order of the imports that ran before (a test process has imported everything already).
"""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the suite's 8 devices; the run below asks for its own count
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_train_package_imports_as_a_package_and_trains_as_a_function():
    """`import jaxpar.train.step` before or after `import jaxpar`; `jaxpar.train` stays callable."""
    out = _python("""
        import types
        import jaxpar.train.step
        import jaxpar
        assert isinstance(jaxpar.train, types.ModuleType), type(jaxpar.train)
        assert callable(jaxpar.train), "jaxpar.train is not callable after import jaxpar.train.step"
        assert callable(jaxpar.train.step.build)
        from jaxpar.train.step import build
        assert build is jaxpar.train.step.build
        import jaxpar.train.loop as loop
        assert loop.train is jaxpar.train.train
        import inspect
        assert list(inspect.signature(jaxpar.train).parameters) == ["cfg", "mesh", "callback"]
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_jaxpar_train_dispatches_to_the_training_loop():
    """`import jaxpar; jaxpar.train(cfg, ...)` is `jaxpar.train.loop.train(cfg, ...)`: 2 steps on 1 device."""
    out = _python("""
        import tempfile
        import jaxpar
        run_dir = tempfile.mkdtemp()
        cfg = jaxpar.load_config("configs/tiny_llama.yaml", [
            "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
            "model.vocab_size=64", "model.seq_len=16", "train.steps=2", "train.global_batch=4",
            "train.log_every=1", "train.run_dir=" + run_dir, "runtime.cpu_devices=1", "mesh.data=1"])
        seen = []
        history = jaxpar.train(cfg, callback=seen.append)
        assert [r["step"] for r in history] == [1, 2], list(history)
        assert seen == list(history)
        import jaxpar.train.step  # importing a submodule afterwards leaves the function callable
        assert callable(jaxpar.train) and jaxpar.train.step.build is not None
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
