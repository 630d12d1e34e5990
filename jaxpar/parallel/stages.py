"""Which layers each pipeline chunk runs: one description read by the executor, the storage
layout, the config check and the planner (DESIGN.md §5.5).

The model's layers are cut into p·v contiguous chunks, placed on the stages as the schedule's
placement says (`jaxpar.parallel.pipeline.placement`: chunks s, s + p, ... on stage s, or the V's
s and 2p-1-s): evenly, or by `parallel.stage_layers`. Every stage runs the same program, so every chunk has the same
number of layer slots per stack of `blocks` (one stack; two for a model with dense and MoE layers,
`jaxpar.model.transformer.MixedBlocks`), and a slot that holds no layer of this chunk is inactive:
its layer is skipped (a `lax.cond`, no compute) and receives no gradient. The chunk's program is a
model of its own (`chunk_model`): for a mixed model, K' dense layers and then G' groups of N - 1
dense layers and one MoE layer, where K' and G' are the most any chunk holds; a chunk's first
dense layers fill its first prefix slots, its groups its first group slots.

Where every slot is active and the chunks are in order, the chunks are a reshape of the stacked
`[layers, ...]` parameters split evenly over `stage` (`gather` false). Otherwise the stacks are
stored with `stage` on another dim, and each step hands every stage its `slots` ([p, v, width]
flattened, stage-major) by one all-to-all over `stage` and the gradients back by another
(`layer_slot`: each layer's one slot; `jaxpar.parallel.pipeline.stash.to_slots`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.model.transformer import layer_order
from jaxpar.parallel.pipeline.placement import stage_of


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """The chunks' layer slots. Per stack kind ("" for a model of one kind of block, else "dense"
    and "moe"): `width[kind]` slots per chunk; `active[kind]`, bool [p, v, width]: does the slot
    hold a layer; `slots[kind]`, int [p·v·width]: the stack's layer each slot holds (an inactive
    slot repeats an active one of the stack, so that it holds finite values); `layer_slot[kind]`,
    int [layers of the stack]: the slot of each layer."""

    p: int
    v: int
    width: dict[str, int]
    active: dict[str, np.ndarray]
    slots: dict[str, np.ndarray]
    layer_slot: dict[str, np.ndarray]
    prefix: int  # K': the chunk model's first dense layers (mixed models)
    groups: int  # G': the chunk model's groups of the pattern (mixed models; 0 otherwise)

    @property
    def gather(self) -> bool:
        """Does the step gather the stacks into slot order (some slot inactive)?"""
        return any(not a.all() for a in self.active.values())

    def layers_per_chunk(self) -> np.ndarray:
        """Active layers (all stacks) of each (stage, local chunk): int [p, v]."""
        return sum(a.sum(-1) for a in self.active.values())


def chunk_counts(n_layers: int, p: int, v: int, stage_layers: tuple[int, ...] | None) -> list[int]:
    """Layers of each global chunk, in model order: `stage_layers` (v = 1) or an even split."""
    if stage_layers is not None:
        return list(stage_layers)
    return [n_layers // (p * v)] * (p * v)


def valid_stage_layout(m, p: int, v: int = 1, stage_layers: tuple[int, ...] | None = None,
                       placement: str = "interleaved") -> StageLayout | None:
    """`stage_layout`, or None for chunks a mixed model cannot have (the config check refuses those
    with the sentence `stage_layout` raises; the planner and the storage layout, asked about them
    before that check, fall back to an even split)."""
    try:
        return stage_layout(m, p, v, stage_layers, placement)
    except ValueError:
        return None


def stage_layout(m, p: int, v: int = 1, stage_layers: tuple[int, ...] | None = None,
                 placement: str = "interleaved") -> StageLayout:
    """The chunks' layer slots of model config `m` on p stages of v chunks, placed by `placement`
    ("interleaved" or "v", `jaxpar.parallel.pipeline.placement`). Raises ValueError (a sentence)
    where a mixed model's chunk does not hold its dense first layers then whole groups."""
    counts = chunk_counts(m.n_layers, p, v, stage_layers)
    starts = np.cumsum([0, *counts[:-1]])
    mixed = m.mixed
    # Per global chunk and kind: the stack's layers it runs, in slot order (prefix, then groups).
    if not mixed:
        per_chunk = [{"": list(range(a, a + c))} for a, c in zip(starts, counts)]
        prefix, groups = 0, 0
        kinds = ("",)
    else:
        K, N = m.moe_pattern
        order = layer_order(m)  # the stack entry of each of the model's layers, per kind
        order_dense = {int(layer): i for i, layer in enumerate(order["dense"])}
        order_moe = {int(layer): i for i, layer in enumerate(order["moe"])}
        per_chunk = []
        for a, c in zip(starts, counts):
            b = a + c
            head = list(range(a, min(b, K)))  # its share of the dense first layers
            rest = max(a, K)
            if (rest - K) % N or (b - rest) % N:
                raise ValueError(
                    f"model.moe_layers = {m.moe_layers} cannot be pipelined with layers [{a}, {b}) in one chunk: "
                    f"after the dense first layers a chunk must hold whole groups of {N} layers (the MoE layer "
                    f"last); choose parallel.stage_layers (or n_layers) so that every chunk does.")
            g = (b - rest) // N
            dense = [order_dense[i] for i in head]
            moe = []
            for j in range(g):
                first = rest + j * N
                dense += [order_dense[i] for i in range(first, first + N - 1)]
                moe.append(order_moe[first + N - 1])
            per_chunk.append({"dense": dense, "moe": moe, "_head": len(head)})
        prefix, groups = max(c["_head"] for c in per_chunk), max(len(c["moe"]) for c in per_chunk)
        kinds = ("dense", "moe")
    N = m.moe_pattern[1] if mixed else 1
    width = ({"": int(max(counts))} if not mixed else {"dense": prefix + groups * (N - 1), "moe": groups})
    active = {k: np.zeros((p, v, width[k]), bool) for k in kinds}
    slots = {k: np.zeros((p, v, width[k]), np.int64) for k in kinds}
    for c, chunk in enumerate(per_chunk):
        s, k = stage_of(c, p, placement), c // p  # (local chunk c // p in every placement)
        for kind in kinds:
            layers = chunk[kind]
            if mixed and kind == "dense":  # prefix slots [0, K'), then the groups' dense slots
                h = chunk["_head"]
                places = [*range(h), *range(prefix, prefix + len(layers) - h)]
            else:
                places = list(range(len(layers)))
            fill = layers[-1] if layers else 0
            slots[kind][s, k, :] = fill
            for place, layer in zip(places, layers):
                slots[kind][s, k, place] = layer
                active[kind][s, k, place] = True
    # An inactive slot repeats a layer of its stack (finite values); padding never feeds a gradient.
    layer_slot = {}
    for kind in kinds:
        flat_active, flat_slots = active[kind].reshape(-1), slots[kind].reshape(-1)
        n = int(flat_active.sum())
        where = np.full(n, -1, np.int64)
        where[flat_slots[flat_active]] = np.flatnonzero(flat_active)
        assert (where >= 0).all(), "every layer of the stack has a slot"
        layer_slot[kind] = where
    return StageLayout(p=p, v=v, width=width, active=active, slots={k: s.reshape(-1) for k, s in slots.items()},
                       layer_slot=layer_slot, prefix=prefix, groups=groups)


def chunk_model(m, layout: StageLayout):
    """The model config one chunk runs: its slots per stack, in the pattern's order."""
    if list(layout.width) == [""]:
        return dataclasses.replace(m, n_layers=layout.width[""])
    N = m.moe_pattern[1]
    n_layers = layout.prefix + layout.groups * N
    pattern = ",".join(([f"first_dense:{layout.prefix}"] if layout.prefix else []) + ([f"every:{N}"] if N > 1 else []))
    return dataclasses.replace(m, n_layers=n_layers, moe_layers=pattern or "all")
