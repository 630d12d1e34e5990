"""Every test runs on 8 simulated CPU devices; the suite refuses to run on anything else."""

import os

# Before JAX starts a backend: 8 host devices, and nothing grabbing a GPU if one is present. LLVM's
# optimizations off for every program the suite compiles (and the CLI processes it starts, which
# inherit XLA_FLAGS): the level changes how each fused kernel is emitted, not the HLO, its buffers
# or what it computes (measured: the same compiled HLO text and memory analysis, compile 35-40%
# faster), and compiling is most of the suite's time (`helpers.COMPILER_OPTIONS`, the same choice).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxpar.mesh import use_cpu_devices  # noqa: E402

use_cpu_devices(8)  # and threads enough for their collectives (PJRT_NPROC, inherited by subprocesses)

if jax.device_count() != 8:  # no test may quietly pass on one device
    raise RuntimeError(f"tests need 8 simulated CPU devices, JAX started with {jax.device_count()}")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")


@pytest.fixture
def tiny():
    """A tiny model config for fast compiles: override what a test needs with `tiny(arch=..., ...)`."""
    from jaxpar.config import Config, from_dict

    def make(arch: str = "llama", **sections) -> Config:
        base = {
            "model": {"arch": arch, "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2 if arch == "llama" else None,
                      "d_ff": 64, "vocab_size": 64, "seq_len": 16},
            "train": {"steps": 3, "global_batch": 8, "lr": 1e-2, "warmup_steps": 1, "log_every": 1},
        }
        for name, values in sections.items():
            base.setdefault(name, {}).update(values)
        return from_dict(base)

    return make
