"""Replicated values inside the cube: identity forward, gradient summed over the replicas.

A bias or norm weight block is held by every rank that uses it (the replicated-vector variant of
DESIGN §3, which works on every grid). Each replica's backward yields the gradient of its own rows
only; summing over the replicas gives every one of them the full gradient.
"""

from __future__ import annotations

import torch

from .. import comm
from ..grid import Grid
from ..sharding import get_spec, replicated_grad_group


class _SumGradOverReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad, _ = comm.all_reduce(grad.contiguous().clone(), ctx.group)
        return grad, None


def use_replicated(param: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``param`` for use in a forward; its gradient is summed over the ranks that replicate it.

    The replicating axes come from the parameter's :class:`~lightning_3d.sharding.ShardSpec`.
    """
    group = replicated_grad_group(get_spec(param), grid)
    return param if group is None else _SumGradOverReplicas.apply(param, group)
