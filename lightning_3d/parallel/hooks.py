"""The model-level hooks ``parallelize`` adds: the plan's input and output hooks and, around each
forward, the model's :class:`~lightning_3d.runtime.Runtime` at work: its token-range checks read
once at the end (:class:`~lightning_3d.runtime.DeferredTokenChecks`), its weight prefetch
(:class:`~lightning_3d.runtime.WeightPrefetch`), its weight gradients handed on at the end of
backward while ``grads_at_end`` is on (:class:`~lightning_3d.runtime.WeightGradsAtEnd`), and one
replica-gradient sum per forward (:class:`~lightning_3d.ops.replicated.ReplicatedGradsAtOnce`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch import nn

from ..grid import Grid
from ..layers.base import Module3D
from ..ops.replicated import ReplicatedGradsAtOnce
from ..runtime import Runtime
from ..sharding import get_spec
from .plan import Plan


class _EachForward:
    """Enters the context ``make()`` returns around each forward of the module (nested calls nest)."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]):
        self.make, self.entered = make, []

    def enter(self, module: nn.Module, args) -> None:
        context = self.make()
        context.__enter__()
        self.entered.append(context)

    def leave(self, module, args, output) -> None:
        self.entered.pop().__exit__(None, None, None)


def _replicated_uses(layers: list[Module3D]) -> list:
    """Every replicated parameter use ``layers`` declare, read at each forward (a conversion may replace parameters)."""
    return [use for layer in layers for use in layer.replicated_parameters()]


def _gathered_weights(layers: list[Module3D], grid: Grid) -> list:
    """The weights ``layers`` hold that 3-D products gather over x (none when x has one rank)."""
    if grid.size("x") == 1:
        return []
    specs = [(p, get_spec(p)) for layer in layers for p in layer.parameters(recurse=False) if p.dim() > 1]
    return [p for p, spec in specs if spec is not None and "x" in sum(spec.dims, ())]


def attach_model_hooks(model: nn.Module, plan: Plan, grid: Grid, runtime: Runtime) -> None:
    """Register the plan's ``before_forward`` / ``after_forward`` and, around each forward, the
    runtime's token checks, prefetch (as the runtime holds it at the forward's start) and
    ``grads_at_end`` hand-out, and the replica-gradient sum on ``model``. The contexts are entered
    before ``before_forward`` runs, so that its token checks defer too and an error it raises leaves
    each as entered (PyTorch runs ``always_call`` hooks then); the token checks are read last."""
    tokens = _EachForward(lambda: runtime.token_checks)
    prefetch = _EachForward(lambda: runtime.prefetch or contextlib.nullcontext())
    # The 3-D layers are found once, not at each forward (a walk over a 24-layer GPT's 273 modules
    # takes the host 0.13 ms); a layer added later sums its own gradients, as one outside a model does.
    layers = [m for m in model.modules() if isinstance(m, Module3D)]
    replicated = _EachForward(lambda: ReplicatedGradsAtOnce(grid, _replicated_uses(layers)))
    grads_at_end = _EachForward(
        lambda: (
            runtime.late_grads.handing_out(_gathered_weights(layers, grid))
            if runtime.options.grads_at_end
            else contextlib.nullcontext()
        )
    )
    for entered in (tokens, prefetch, replicated, grads_at_end):
        model.register_forward_pre_hook(entered.enter)
    if plan.before_forward is not None:
        before = plan.before_forward
        model.register_forward_pre_hook(
            lambda m, args, kwargs: before(m, grid, args, kwargs), with_kwargs=True
        )
    model.register_forward_hook(prefetch.leave, always_call=True)
    model.register_forward_hook(replicated.leave, always_call=True)
    model.register_forward_hook(grads_at_end.leave, always_call=True)
    if plan.after_forward is not None:
        after = plan.after_forward
        model.register_forward_hook(
            lambda m, args, kwargs, out: after(m, grid, args, kwargs, out), with_kwargs=True
        )
    model.register_forward_hook(tokens.leave, always_call=True)
