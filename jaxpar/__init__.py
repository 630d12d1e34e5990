"""jaxpar: decoder-only transformers trained with data, tensor and pipeline parallelism on one JAX mesh.

    import jaxpar
    cfg = jaxpar.load_config("configs/tiny_llama.yaml", ["train.steps=50"])
    metrics = jaxpar.train(cfg)          # list of logged metric dicts

Note `jaxpar.train` is the function; the package of the same name is importable as
`jaxpar.train.<module>` (e.g. `from jaxpar.train.step import build`).
"""

from jaxpar.config import Config, ConfigError, JaxparError, load_config
from jaxpar.train import lower_step, train  # noqa: F401  (rebinds `jaxpar.train` to the function)

__all__ = ["Config", "ConfigError", "JaxparError", "load_config", "lower_step", "train"]
__version__ = "0.1.0"
