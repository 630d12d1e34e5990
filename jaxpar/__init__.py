"""jaxpar: decoder-only transformers trained with data, tensor and pipeline parallelism on one JAX mesh.

    import jaxpar
    cfg = jaxpar.load_config("configs/tiny_llama.yaml", ["train.steps=50"])
    metrics = jaxpar.train(cfg)          # list of logged metric dicts

`jaxpar.train` is the package `jaxpar/train/`, callable as the training loop
(`jaxpar.train.loop.train`), so its modules import as usual: `import jaxpar.train.step`,
`from jaxpar.train.step import build`.
"""

from jaxpar.config import Config, ConfigError, JaxparError, load_config
from jaxpar import train  # the package, callable: train(cfg) runs jaxpar.train.loop.train
from jaxpar.train import lower_step

__all__ = ["Config", "ConfigError", "JaxparError", "load_config", "lower_step", "train"]
from jaxpar.version import __version__
