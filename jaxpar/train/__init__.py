"""Training: state, the jitted step, optimizer, data, the loop and the `python -m jaxpar.train` CLI.

This package is also callable: `jaxpar.train(cfg)` is `jaxpar.train.loop.train(cfg)`. So
`jaxpar.train` is one object whatever was imported first, and `import jaxpar.train.step`,
`from jaxpar.train.step import build` and `jaxpar.train(cfg)` all work side by side (a function
of the same name would be replaced by the package as soon as a submodule is imported).
"""

import sys
import types

from jaxpar.train import loop
from jaxpar.train.loop import train
from jaxpar.train.step import Program, TrainState, build, cross_entropy, loss_fn, lower_step

__all__ = ["Program", "TrainState", "build", "cross_entropy", "loss_fn", "lower_step", "train"]


class _CallablePackage(types.ModuleType):
    """The `jaxpar.train` package, callable as the training loop."""

    def __call__(self, cfg, *, mesh=None, callback=None):
        """Train `cfg` and return the logged metrics: `jaxpar.train.loop.train` (see its docstring)."""
        return self.loop.train(cfg, mesh=mesh, callback=callback)


sys.modules[__name__].__class__ = _CallablePackage
