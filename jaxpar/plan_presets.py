"""Compatibility: the model presets are `jaxpar.plan.presets`, the hardware presets
`jaxpar.hardware`; new code imports them from there."""

from jaxpar.hardware import GB, HARDWARE, Hardware
from jaxpar.plan.presets import MODELS

__all__ = ["GB", "HARDWARE", "Hardware", "MODELS"]
