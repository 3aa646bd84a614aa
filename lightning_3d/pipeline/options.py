"""How a model runs in pipeline stages: :class:`PipelineOptions`, the arguments of
:func:`~lightning_3d.pipeline.stages.split_stages` and :func:`~lightning_3d.pipeline.schedule.build_schedule`
that a :class:`~lightning_3d.pipeline.pipelined.PipelinedModel` (and ``Tensor3DStrategy(pipeline=...)``) takes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import arguments
from ..parallel import Plan
from .kinds import canonical_name, stages_per_rank
from .split import StageSplit


@dataclass(frozen=True)
class PipelineOptions:
    """The schedule and the split of a pipelined model; every field checked when made.

    Args:
        schedule: a name of :data:`~lightning_3d.pipeline.SCHEDULES` (``"1F1B"``, ``"GPipe"``, ...).
        n_microbatches: micro-batches a batch is cut into (they must divide it); default the
            pipeline size.
        stages_per_rank: for looped schedules (``Interleaved1F1B`` ...): stages per rank, default 2.
        split_points: the first layer of stages ``1 … S-1``; default equal layer counts.
        split: how the model's forward splits; default the built-in split of its class.
        plan: how each stage is parallelized; default the built-in plan of the model's class.
    """

    schedule: str = "1F1B"
    n_microbatches: int | None = None
    stages_per_rank: int | None = None
    split_points: Sequence[int] | None = None
    split: StageSplit | None = None
    plan: Plan | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", canonical_name(self.schedule))
        if self.n_microbatches is not None:
            arguments.positive_int(self.n_microbatches, "n_microbatches")
        stages_per_rank(self.schedule, self.stages_per_rank)
        if self.split_points is not None:
            object.__setattr__(
                self,
                "split_points",
                tuple(arguments.positive_int(p, "a split point") for p in self.split_points),
            )
        for name, cls in (("split", StageSplit), ("plan", Plan)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise ValueError(f"{name} must be a {cls.__name__} or None, got {value!r}")

    def microbatches(self, pipeline_size: int) -> int:
        """The micro-batches a batch is cut into on a grid of ``pipeline_size`` stages."""
        return self.n_microbatches if self.n_microbatches is not None else pipeline_size
