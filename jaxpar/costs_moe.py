"""Compatibility: the mixture-of-experts part of the cost model is `jaxpar.plan.moe`; new code
imports it from there."""

from jaxpar.plan.moe import (all_to_all, assembled_experts, capacity_scale, describe_params, exchange, expert_counts,
                             expert_ids, expert_parallel, gemm_terms, is_expert_leaf, mlp_width, moe_fraction, moe_layers_on_stage,
                             param_counts, recomputed_flops_per_token, recomputes_experts, routes_sequence_shard,
                             tap_width, whole_experts_bytes)

__all__ = ["all_to_all", "assembled_experts", "capacity_scale", "describe_params", "exchange", "expert_counts",
           "expert_ids", "expert_parallel",
           "gemm_terms", "is_expert_leaf", "mlp_width", "moe_fraction", "moe_layers_on_stage", "param_counts",
           "recomputed_flops_per_token", "recomputes_experts", "routes_sequence_shard", "tap_width",
           "whole_experts_bytes"]
