"""The schedules of ``torch.distributed.pipelining`` by name, and which stages each rank runs under one.

One stage per rank (``GPipe``, ``1F1B``): rank ``r`` of the pipe group runs stage ``r``. Looped
schedules (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``) run ``v`` stages per rank:
rank ``r`` runs stages ``r, r + pp, …, r + (v-1)·pp``. V-shaped ones (``ZBVZeroBubble``, ``DualPipeV``)
run two: ``r`` and ``2·pp - 1 - r``, so the first and the last stage share rank 0.
"""

from __future__ import annotations

from torch.distributed.pipelining import schedules

from .. import arguments
from ..grid import Grid

#: the names ``schedule_class`` takes (case-insensitive), as ``torch.distributed.pipelining`` spells them
SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
#: the schedules with weight actions (W) apart from the backward, to which weight gradients are deferred
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def canonical_name(name: str) -> str:
    """``name`` as :data:`SCHEDULES` spells it; ``ValueError`` listing them for any other."""
    found = {s.lower(): s for s in SCHEDULES}.get(str(name).lower())
    if found is None or not hasattr(schedules, f"Schedule{found}"):
        available = [s for s in SCHEDULES if hasattr(schedules, f"Schedule{s}")]
        raise ValueError(f"unknown pipeline schedule {name!r}; this torch has {available}")
    return found


def schedule_class(name: str) -> type:
    """The ``torch.distributed.pipelining`` schedule class called ``name``."""
    return getattr(schedules, f"Schedule{canonical_name(name)}")


def fixed_stages_per_rank(name: str) -> int | None:
    """The stages per rank schedule ``name`` runs: 1 (single-stage), 2 (V-shaped), or None (looped: any)."""
    name = canonical_name(name)
    if issubclass(schedule_class(name), schedules.PipelineScheduleSingle):
        return 1
    return 2 if name in V_SHAPED else None


def stages_per_rank(name: str, asked: int | None = None) -> int:
    """How many stages each rank runs under schedule ``name``: :func:`fixed_stages_per_rank`, or
    ``asked`` (default 2) for looped ones; ``ValueError`` when ``asked`` does not fit."""
    fixed = fixed_stages_per_rank(name)
    if fixed is None:
        return 2 if asked is None else arguments.positive_int(asked, "stages_per_rank")
    if asked not in (None, fixed):
        raise ValueError(
            f"schedule {canonical_name(name)} runs {fixed} stage(s) per rank, not {asked}; leave stages_per_rank unset"
        )
    return fixed


def stage_indices(grid: Grid, name: str, per_rank: int | None = None) -> list[int]:
    """The stages this rank runs under schedule ``name``, in stage order (see the module's docstring)."""
    v, pp, r = stages_per_rank(name, per_rank), grid.pipeline_size, grid.stage
    return [r, 2 * pp - 1 - r] if canonical_name(name) in V_SHAPED else [r + k * pp for k in range(v)]


def stage_owner(stage: int, pipeline_size: int, name: str) -> int:
    """The pipe-group rank (pipeline stage of the grid) that runs ``stage`` under schedule ``name``."""
    if canonical_name(name) in V_SHAPED and stage >= pipeline_size:
        return 2 * pipeline_size - 1 - stage
    return stage % pipeline_size
