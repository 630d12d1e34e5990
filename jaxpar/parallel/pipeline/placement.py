"""Which stage holds which pipeline chunk: the one rule read by the tables
(`schedules.Schedule.stage_of`, `chunk_at`, `lane_of`), the layer slots and storage order
(`jaxpar.parallel.stages`, `executor`) and the executor's hops (`setup`). Plain Python.

Chunks are numbered 0..p·v-1 in model order; local chunk k of stage s is chunk c with c // p = k.

- `"interleaved"` (Megatron's; every schedule but the V ones): chunk c on stage c mod p, so local
  chunk k of stage s is k·p + s, and activations travel round the ring (stage p-1's chunk k feeds
  stage 0's chunk k+1).
- `"v"` (v = 2; `zb_v`, `dualpipe_v`): stage s holds chunks s and 2p-1-s. The first half's
  activations go down the stages (s -> s+1), the second half's back up (s+1 -> s); the hop from
  chunk p-1 to chunk p stays on stage p-1; the last chunk (the head and the loss) is on stage 0.
  Messages into a second-half chunk arrive in a second receive lane (`lane_of`)."""

from __future__ import annotations

from jaxpar.parallel.pipeline.vshape import V_SCHEDULES

PLACEMENTS = ("interleaved", "v")


def placement_of(schedule: str) -> str:
    """The placement a schedule's tables use: "v" for the V-shape schedules, else "interleaved"."""
    return "v" if schedule in V_SCHEDULES else "interleaved"


def stage_of(chunk: int, p: int, placement: str) -> int:
    """The stage that holds `chunk`."""
    return chunk % p if placement != "v" else min(chunk, 2 * p - 1 - chunk)


def chunk_at(stage: int, local: int, p: int, placement: str) -> int:
    """The chunk that is local chunk `local` of `stage` (`stage_of`'s inverse)."""
    return local * p + stage if placement != "v" or local == 0 else 2 * p - 1 - stage


def lane_of(chunk: int, p: int, placement: str) -> int:
    """The receive lane of messages into `chunk`: 1 for the V's second half, else 0."""
    return int(placement == "v" and chunk >= p)


def stage_order(p: int, v: int, placement: str) -> list[int]:
    """The chunks in stage-major order of (stage, local chunk): how a stage's contiguous slice of
    the stacked layers holds its chunks (`executor`) and how the layer slots are laid out."""
    return [chunk_at(s, k, p, placement) for s in range(p) for k in range(v)]
