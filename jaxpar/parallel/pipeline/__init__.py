"""Pipeline parallelism over `stage`: schedule tables as data, and one executor that runs any
valid table (DESIGN.md §5).

Plain Python (no JAX), importable on their own:

- `schedules`: tables `tick x stage -> actions` (F, B, I, W), their placements, builders, slot
  assignment and validation; `vshape`: the V schedules' stage programs; `simulate`: their
  simulation; `timeline`: their text and PNG rendering;
- `table`: a schedule as the executor consumes it (`Table`, `table_of`) and `stashes_inputs`.

The executor (JAX), in the order a step runs it:

- `setup`: `Setup`, what every stage knows before tracing (and the data-axis reduction after the loop);
- `plan`: `StagePlan`, the frozen layout of one stage's stash, taps and packing, from abstract traces;
- `actions`: F, B or I, and W as functions of the plan;
- `tick`: the scan's carry and one tick of the table (the actions, then the hops);
- `stash`: reading and writing stash rows in place, packing I's outputs for W, layer slots;
- `executor`: `make_pipeline_loss_and_grads`, the shard_map around the tick loop.

This package imports no JAX itself: the executor's names below load their modules on first use,
so that `jaxpar.parallel.pipeline.schedules` stays plain Python.
"""

from __future__ import annotations

import sys
import types

from jaxpar.parallel.pipeline import table as _table
from jaxpar.parallel.pipeline.table import Table, stashes_inputs, table_of

# The executor's names (JAX), each loaded from its module on first access.
__all__ = ["STASH_MATMUL_INPUTS", "Carry", "Setup", "StagePlan", "Table", "make_pipeline_loss_and_grads",
           "stashes_inputs", "table_of"]


def __getattr__(name: str):
    if name == "make_pipeline_loss_and_grads":
        from jaxpar.parallel.pipeline.executor import make_pipeline_loss_and_grads
        return make_pipeline_loss_and_grads
    if name == "Setup":
        from jaxpar.parallel.pipeline.setup import Setup
        return Setup
    if name == "StagePlan":
        from jaxpar.parallel.pipeline.plan import StagePlan
        return StagePlan
    if name == "Carry":
        from jaxpar.parallel.pipeline.tick import Carry
        return Carry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """`jaxpar.parallel.pipeline.STASH_MATMUL_INPUTS` is the switch in `table`, which
    `stashes_inputs` reads: setting it here (a test measuring without it) sets it there."""

    @property
    def STASH_MATMUL_INPUTS(self) -> bool:  # noqa: N802 (the switch's name)
        return _table.STASH_MATMUL_INPUTS

    @STASH_MATMUL_INPUTS.setter
    def STASH_MATMUL_INPUTS(self, value: bool):  # noqa: N802
        _table.STASH_MATMUL_INPUTS = value


sys.modules[__name__].__class__ = _Package
