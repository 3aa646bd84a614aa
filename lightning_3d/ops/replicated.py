"""Replicated values inside the cube: identity forward, gradient summed over the replicas.

A bias or norm weight block is held by every rank that uses it (instead of the paper's storage on
the cube diagonal, which a non-cubic grid lacks: this works on every grid). Each replica's backward
yields the gradient of its own rows only; summing over the replicas gives every one of them the
full gradient.

Alone, each use sums its gradients in its own all-reduce as its layer's backward runs: one
synchronisation of the ranks per layer. Inside :class:`ReplicatedGradsAtOnce` (which
:func:`~lightning_3d.parallel.parallelize` enters around every forward of the model) the uses
take views from one autograd node made at the start of the forward, whose backward runs once,
after the last layer's: one all-reduce per replica group and step. Each listed parameter holds
its views for the context's lifetime (attribute ``_replica_views``, ``{axes: view}``): a
compiled block reads them as inputs of its graph, with guards on neither the parameter's
identity nor the view's, so every block shares one graph.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .. import comm
from ..grid import Grid
from ..sharding import get_spec, replicated_grad_axes

_VIEWS = "_replica_views"  # on a parameter inside a ReplicatedGradsAtOnce: {axes: its view from the context's node}


class _SumGradsOverReplicas(torch.autograd.Function):
    """Identity on several tensors; backward sums their gradients over each group in one all-reduce.

    ``groups``: ``((group, count), ...)``, each taking the next ``count`` tensors (of one dtype).
    A tensor that got no gradient contributes zeros and gets None back.
    """

    @staticmethod
    def forward(ctx, groups, *tensors):
        ctx.groups, ctx.shapes = groups, [t.shape for t in tensors]
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        like = next(g for g in grads if g is not None)
        pending, start = [], 0
        for group, count in ctx.groups:  # a fresh buffer per group: the all-reduce works in place
            span = range(start, start + count)
            flat = torch.cat(
                [
                    (grads[i] if grads[i] is not None else like.new_zeros(ctx.shapes[i])).reshape(-1)
                    for i in span
                ]
            )
            pending.append((span, *comm.all_reduce(flat, group, async_op=True)))
            start += count
        out = [None] * len(grads)
        for span, flat, handle in pending:
            handle.wait()
            for i, part in zip(span, flat.split([ctx.shapes[i].numel() for i in span])):
                out[i] = None if grads[i] is None else part.view(ctx.shapes[i])
        return (None, *out)


def use_replicated(param: torch.Tensor, grid: Grid, grad_summed_over: str = "") -> torch.Tensor:
    """``param`` for use in a forward; its gradient is summed over the ranks that replicate it.

    The replicating axes come from the parameter's :class:`~lightning_3d.sharding.ShardSpec`;
    ``grad_summed_over`` names those the forward's own backward already sums over (a bias added
    before a reduce-scatter over that axis), which are left out.
    """
    (out,) = use_replicated_together([param], grid, grad_summed_over)
    return out


def use_replicated_together(params, grid: Grid, grad_summed_over: str = "") -> tuple:
    """:func:`use_replicated` for several parameters with the same replicating axes (a norm's weight
    and bias), their gradients summed in one all-reduce; None entries pass through."""
    present = [p for p in params if p is not None]
    if not present:
        return tuple(params)
    axes = replicated_grad_axes(get_spec(present[0]), grid, grad_summed_over)
    if any(get_spec(p).replicated_axes != get_spec(present[0]).replicated_axes for p in present):
        raise ValueError(
            "use_replicated_together needs parameters replicated over the same axes: "
            + ", ".join(repr(get_spec(p).replicated_axes) for p in present)
        )
    if not axes:
        return tuple(params)
    held = [(getattr(p, _VIEWS, None) or {}).get(axes) for p in present]
    if all(view is not None for view in held):
        views = iter(held)
    else:
        views = iter(_SumGradsOverReplicas.apply(((grid.group(axes), len(present)),), *present))
    return tuple(None if p is None else next(views) for p in params)


class ReplicatedGradsAtOnce:
    """Context for one forward: replicated gradients summed in one all-reduce per replica group.

    On entry (with grad enabled) it passes ``uses`` through one :class:`_SumGradsOverReplicas`
    node, grouped by replicating axes and dtype; inside, :func:`use_replicated` returns that node's
    view of a listed parameter instead of making a node of its own. The node's backward runs
    after every layer's (it was made first), so the ranks synchronise once per group and step
    rather than once per layer; gradients are the same. A parameter used with axes it was not
    listed with falls back to its own node; a listed one the forward does not use gets no gradient.

    Args:
        grid: the grid of the layers.
        uses: ``(parameter, grad_summed_over)`` pairs, as the layers'
            :meth:`~lightning_3d.layers.base.Module3D.replicated_parameters` declare them.
    """

    def __init__(self, grid: Grid, uses: Iterable[tuple[nn.Parameter, str]]):
        self.grid, self.uses, self._outer = grid, list(uses), []
        self._params = list({id(p): p for p, _ in self.uses}.values())

    def __enter__(self) -> ReplicatedGradsAtOnce:
        self._outer.append([(p, getattr(p, _VIEWS, None)) for p in self._params])
        views = self._views() if torch.is_grad_enabled() else {}
        for p in self._params:
            setattr(p, _VIEWS, views.get(id(p)))
        return self

    def __exit__(self, *exc) -> None:
        for p, outer in self._outer.pop():
            setattr(p, _VIEWS, outer)

    def _views(self) -> dict[int, dict[str, torch.Tensor]]:
        """``{id(parameter): {axes: its view}}`` from one new node."""
        by_group: dict[tuple[str, torch.dtype], dict[int, nn.Parameter]] = {}
        for param, summed in self.uses:
            axes = replicated_grad_axes(get_spec(param), self.grid, summed)
            if axes and param.requires_grad:
                by_group.setdefault((axes, param.dtype), {})[id(param)] = param
        if not by_group:
            return {}
        keys = sorted(by_group, key=str)  # the same order on every rank
        groups = tuple((self.grid.group(axes), len(by_group[axes, dtype])) for axes, dtype in keys)
        views = iter(
            _SumGradsOverReplicas.apply(groups, *(p for key in keys for p in by_group[key].values()))
        )
        out: dict[int, dict[str, torch.Tensor]] = {}
        for axes, dtype in keys:
            for p in by_group[axes, dtype].values():
                out.setdefault(id(p), {})[axes] = next(views)
        return out
