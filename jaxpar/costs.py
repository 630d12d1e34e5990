"""Compatibility: the cost model moved into the planner's package. Per-device memory and the model
state are `jaxpar.plan.memory`, the collectives and their bytes `jaxpar.plan.collectives`, the
step time `jaxpar.plan.steptime`, the model's FLOPs per token `jaxpar.model.flops`; new code
imports them from there. These names stay for the tests, benchmarks and documents that use them."""

from jaxpar.model.flops import model_flops_per_token
from jaxpar.plan.activations import saved_activation_bytes
from jaxpar.plan.collectives import Collective, bytes_per_axis, collectives, compiled_bytes_per_axis
from jaxpar.plan.memory import _BYTES, abstract_mesh, check, memory, model_state, uses_flash_attention
from jaxpar.plan.steptime import (CALIBRATION, MATMUL_EFFICIENCY, Roofline, busiest_stage_layers, compute_floor,
                                  compute_seconds, compute_terms, hardware_flops_per_token, step_time)

__all__ = ["CALIBRATION", "Collective", "MATMUL_EFFICIENCY", "Roofline", "_BYTES", "abstract_mesh",
           "busiest_stage_layers", "bytes_per_axis", "check", "collectives", "compiled_bytes_per_axis",
           "compute_floor", "compute_seconds", "compute_terms", "hardware_flops_per_token", "memory",
           "model_flops_per_token", "model_state", "saved_activation_bytes", "step_time", "uses_flash_attention"]
