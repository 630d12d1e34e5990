"""Parallelism strategies, one module each: `zero` (data-axis sharding of model state) and
`gradients` (data-parallel loss and gradients with one reduction per step)."""
