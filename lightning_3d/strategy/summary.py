"""Lightning's model summary with the full model's parameter counts (no Lightning import).

Lightning's ``ModelSummary`` counts ``p.numel()``: on a grid, rank 0's shard. Here a parameter
counts the dense shape its module declares (``dense_shapes``: a vocabulary padded for the grid
counts its true rows), else the global shape of its :class:`~lightning_3d.sharding.ShardSpec`, and
a plain parameter (replicated over the cube) its own size, and pipeline stages the whole
model's parameters, so the table and its totals are the dense model's.
Both 3-D strategies put their summary callback in place of Lightning's (:class:`SummariseGlobally`).
"""

from __future__ import annotations

import math

from torch import nn

from ..pipeline import PipelinedModel
from ..sharding import get_spec


def global_numel(param) -> int:
    """The number of elements of ``param`` in the full model (its global shape when sharded)."""
    spec = get_spec(param)
    if spec is not None:
        return math.prod(spec.global_shape)
    return getattr(
        param, "ds_numel", param.numel()
    )  # a plain parameter that ZeRO-3 partitioned keeps its size there


def dense_numels(module: nn.Module) -> dict[int, int]:
    """``id(param)`` → its elements in the dense model, for the parameters whose modules declare ``dense_shapes``."""
    out = {}
    for sub in module.modules():
        declared = getattr(sub, "dense_shapes", None)
        for name, shape in declared.items() if isinstance(declared, dict) else ():
            param = dict(sub.named_parameters()).get(name)
            if param is not None:
                out[id(param)] = math.prod(shape)
    return out


def global_count(module: nn.Module, dense: dict[int, int], trainable_only: bool = False) -> int:
    """Parameters of ``module`` in the dense model (each shared parameter once); ``dense`` from :func:`dense_numels`.
    A :class:`~lightning_3d.pipeline.PipelinedModel` counts the whole model's, every stage's."""
    staged = [m for m in module.modules() if isinstance(m, PipelinedModel)]
    held = {id(p) for m in staged for p in m.parameters()}
    whole = sum(m.whole_trainable if trainable_only else m.whole_parameters for m in staged)
    return whole + sum(
        dense.get(id(p), global_numel(p))
        for p in module.parameters()
        if id(p) not in held and (p.requires_grad or not trainable_only)
    )


class GlobalCounts:
    """Mixed into Lightning's ``utilities.model_summary.ModelSummary``: every count is the full model's."""

    def __init__(self, model, max_depth: int = 1) -> None:
        self.module, self.dense = model, dense_numels(model)
        super().__init__(model, max_depth)

    @property
    def param_nums(self) -> list[int]:
        return [global_count(module, self.dense) for _, module in self.named_modules]

    @property
    def total_parameters(self) -> int:
        return global_count(self.module, self.dense)

    @property
    def trainable_parameters(self) -> int:
        return global_count(self.module, self.dense, trainable_only=True)


class GlobalSummaryCallback:
    """Mixed into Lightning's ``callbacks.ModelSummary``: it summarises with :attr:`summary_class` (a
    :class:`GlobalCounts`)."""

    summary_class: type

    def _summary(self, trainer, pl_module):
        return self.summary_class(pl_module, max_depth=self._max_depth)


class SummariseGlobally:
    """Strategy mixin: :meth:`summarise_globally` swaps Lightning's summary callbacks for their full-model
    subclasses."""

    summary_callbacks: dict[
        type, type
    ]  # Lightning's callback class → its subclass mixing in GlobalSummaryCallback

    def summarise_globally(self, trainer) -> None:
        """Replace each of ``trainer``'s summary callbacks by the subclass of the same settings
        (``_max_depth``, ``_summarize_kwargs``)."""
        trainer.callbacks = [self._global(callback) for callback in trainer.callbacks]

    def _global(self, callback):
        cls = self.summary_callbacks.get(type(callback))
        return callback if cls is None else cls(max_depth=callback._max_depth, **callback._summarize_kwargs)
