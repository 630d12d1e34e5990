"""Training: state, the jitted step, optimizer, data, the loop and the `python -m jaxpar.train` CLI."""

from jaxpar.train.loop import train
from jaxpar.train.step import Program, TrainState, build, cross_entropy, loss_fn, lower_step

__all__ = ["Program", "TrainState", "build", "cross_entropy", "loss_fn", "lower_step", "train"]
