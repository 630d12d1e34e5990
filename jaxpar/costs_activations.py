"""Compatibility: the activations a step saves are `jaxpar.plan.activations`; new code imports
them from there."""

from jaxpar.plan.activations import _activations, _offloaded, _tap_input_width, _tap_width, saved_activation_bytes

__all__ = ["_activations", "_offloaded", "_tap_input_width", "_tap_width", "saved_activation_bytes"]
