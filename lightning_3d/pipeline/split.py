"""How a model's forward splits into pipeline stages: a :class:`StageSplit` per model family, and the
layers each stage holds (:func:`layer_ranges`).

A split names the model's list of repeated layers, the modules only the first stage keeps (the
embeddings) and those only the last keeps (final norm, head, loss), and runs the model's own pieces:
``embed`` (ids → hidden), ``blocks`` (the layers a stage holds), ``head`` (hidden → logits) and
``loss``. Built-in splits are registered by class name, as plans are
(:func:`~lightning_3d.parallel.register_plan`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..grid import Grid


@dataclass(frozen=True)
class MicroBatch:
    """The shape of every micro-batch a schedule runs, and what a split derives from it once.

    ``batch`` sequences of ``seq_len`` tokens; the hand-over between stages is the z-layout block of
    ``[rows, row_len, hidden]`` (``rows = batch``, ``row_len = seq_len`` for whole sequences; token
    rows cut each sequence into ``rows / batch`` rows). ``state``: the split's own (token rows,
    position ids, an attention mask).
    """

    batch: int
    seq_len: int
    rows: int
    row_len: int
    state: Any = None


class StageSplit(ABC):
    """A model family's forward in pieces that pipeline stages run (a subclass per family).

    Every method takes the stage's model: the whole model's class and module names, holding only
    the stage's modules, parallelized. The pieces run the model's own modules, so that each stage
    computes what the whole model computes between the same layers.
    """

    #: the ``nn.ModuleList`` of repeated layers that the stages share out (``"transformer.h"``)
    layers: ClassVar[str]
    #: modules that only the first stage keeps (the embeddings)
    first: ClassVar[tuple[str, ...]]
    #: modules that only the last stage keeps (the final norm, the head, the loss)
    last: ClassVar[tuple[str, ...]]
    ignore_index: ClassVar[int] = -100

    @abstractmethod
    def micro_batch(self, model: nn.Module, grid: Grid, batch: int, seq_len: int) -> MicroBatch:
        """Check that micro-batches of ``batch`` sequences of ``seq_len`` tokens run on ``grid``
        (``ValueError`` naming the numbers and the fix), and derive what every stage needs for them."""

    @abstractmethod
    def embed(self, model: nn.Module, ids: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The first stage's start: ids ``[batch, seq_len]`` (the same on every cube rank) → this rank's
        z-layout hidden block."""

    @abstractmethod
    def blocks(self, model: nn.Module, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The layers the stage holds, in order, on a z-layout hidden block."""

    @abstractmethod
    def head(self, model: nn.Module, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The last stage's end: z-layout hidden → y-layout logits ``[rows/(px·pz), row_len, V'/py]``."""

    @abstractmethod
    def loss(
        self, model: nn.Module, logits: torch.Tensor, targets: torch.Tensor, mb: MicroBatch
    ) -> torch.Tensor:
        """The model's loss on a micro-batch: the mean over its counted targets (:meth:`counted`)."""

    def counted(self, targets: torch.Tensor) -> torch.Tensor:
        """Which targets ``[batch, seq_len]`` the loss averages over (bool, same shape)."""
        return targets != self.ignore_index

    @abstractmethod
    def hidden_size(self, model: nn.Module) -> int:
        """The width of the hidden state handed from stage to stage."""

    def logits_width(self, model: nn.Module) -> int:
        """The logits' full last dim on the last stage: its 3-D head's (padded) vocabulary."""
        return model.lm_head.out_features


_splits: dict[str, Callable[[nn.Module], StageSplit]] = {}


def register_split(class_name: str, make_split: Callable[[nn.Module], StageSplit]) -> None:
    """Make ``make_split(model)`` the built-in split of models whose class (or a base class) is named
    ``class_name``, plain or qualified by its module (as :func:`~lightning_3d.parallel.register_plan`)."""
    _splits[class_name] = make_split


def find_split(model: nn.Module) -> StageSplit:
    """The built-in split of ``model``'s class; ``ValueError`` naming the class and the fix when there is none."""
    for cls in type(model).__mro__:
        for name in (f"{cls.__module__}.{cls.__qualname__}", cls.__name__):
            if name in _splits:
                return _splits[name](model)
    raise ValueError(
        f"no built-in pipeline split for {type(model).__name__} (built in: {', '.join(sorted(_splits))}); "
        f"pass split_stages(model, split=...) a StageSplit subclass, or register one with "
        f"lightning_3d.pipeline.register_split({type(model).__name__!r}, make_split)"
    )


def layer_ranges(n_layers: int, n_stages: int, split_points: Sequence[int] | None = None) -> list[range]:
    """The layers of each of ``n_stages`` stages, every stage at least one.

    ``split_points``: the first layer of stages ``1 … n_stages-1``, increasing. Without them, equal
    counts: the first ``n_layers % n_stages`` stages hold one layer more (the embedding's and the
    head's cost are not weighed: pass split points to move layers off the first or last stage).
    """
    if split_points is None:
        if n_layers < n_stages:
            raise ValueError(
                f"{n_stages} pipeline stages need at least one layer each, but the model has {n_layers}; "
                f"use at most {n_layers} stages (pipeline_size × stages per rank)"
            )
        per, extra = divmod(n_layers, n_stages)
        split_points = [k * per + min(k, extra) for k in range(1, n_stages)]
    points = [0, *split_points, n_layers]
    if len(points) != n_stages + 1 or any(a >= b for a, b in zip(points, points[1:])):
        raise ValueError(
            f"split_points {list(split_points)} must be {n_stages - 1} increasing layer indices in 1..{n_layers - 1} "
            f"(the first layer of stages 1..{n_stages - 1} of {n_stages}), every stage holding at least one layer"
        )
    return [range(a, b) for a, b in zip(points, points[1:])]
