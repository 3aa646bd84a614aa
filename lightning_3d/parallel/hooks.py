"""The model-level hooks a plan adds: its input and output hooks, weight prefetch while enabled, and
one replica-gradient sum per forward (:class:`~lightning_3d.ops.replicated.ReplicatedGradsAtOnce`)."""

from __future__ import annotations

from torch import nn

from ..grid import Grid
from ..layers.base import Module3D
from ..ops.matmul import WeightPrefetch
from ..ops.replicated import ReplicatedGradsAtOnce
from ..options import RuntimeOptions
from .plan import Plan


class _PrefetchWhenEnabled:
    """Enters a :class:`WeightPrefetch` around each forward of the model while ``options.prefetch`` is on."""

    def __init__(self, options: RuntimeOptions):
        self.options, self.prefetch, self.entered = options, WeightPrefetch(), []

    def enter(self, module, args) -> None:
        self.entered.append(self.options.prefetch)
        if self.options.prefetch:
            self.prefetch.__enter__()

    def leave(self, module, args, output) -> None:
        if self.entered.pop():
            self.prefetch.__exit__()


class _ReplicatedGradsEachForward:
    """Enters a fresh :class:`ReplicatedGradsAtOnce` over the model's current 3-D layers around each forward."""

    def __init__(self, grid: Grid):
        self.grid, self.entered = grid, []

    def enter(self, module: nn.Module, args) -> None:
        uses = [use for m in module.modules() if isinstance(m, Module3D) for use in m.replicated_parameters()]
        self.entered.append(ReplicatedGradsAtOnce(self.grid, uses).__enter__())

    def leave(self, module, args, output) -> None:
        self.entered.pop().__exit__()


def attach_model_hooks(model: nn.Module, plan: Plan, grid: Grid, options: RuntimeOptions) -> None:
    """Register the plan's ``before_forward`` / ``after_forward``, the prefetch switch and the
    replica-gradient sum on ``model``."""
    if plan.before_forward is not None:
        before = plan.before_forward
        model.register_forward_pre_hook(lambda m, args, kwargs: before(m, grid, args, kwargs), with_kwargs=True)
    prefetch = _PrefetchWhenEnabled(options)
    model.register_forward_pre_hook(prefetch.enter)
    model.register_forward_hook(prefetch.leave, always_call=True)
    replicated = _ReplicatedGradsEachForward(grid)
    model.register_forward_pre_hook(replicated.enter)
    model.register_forward_hook(replicated.leave, always_call=True)
    if plan.after_forward is not None:
        after = plan.after_forward
        model.register_forward_hook(lambda m, args, kwargs, out: after(m, grid, args, kwargs, out), with_kwargs=True)
