"""Replicated values inside the cube: identity forward, gradient summed over the replicas.

A bias or norm weight block is held by every rank that uses it (instead of the paper's storage on
the cube diagonal, which a non-cubic grid lacks: this works on every grid). Each replica's backward yields the gradient of its own rows
only; summing over the replicas gives every one of them the full gradient.
"""

from __future__ import annotations

import torch

from .. import comm
from ..grid import Grid
from ..sharding import get_spec, replicated_grad_group


class _SumGradsOverReplicas(torch.autograd.Function):
    """Identity on several tensors; backward sums their gradients over ``group`` in one all-reduce."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])  # a fresh buffer: the all-reduce works in place
        comm.all_reduce(flat, ctx.group)
        return (None,) + tuple(part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads))


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
    group = replicated_grad_group(get_spec(present[0]), grid, grad_summed_over)
    if any(get_spec(p).replicated_axes != get_spec(present[0]).replicated_axes for p in present):
        raise ValueError("use_replicated_together needs parameters replicated over the same axes: "
                         + ", ".join(repr(get_spec(p).replicated_axes) for p in present))
    used = iter(present if group is None else _SumGradsOverReplicas.apply(group, *present))
    return tuple(None if p is None else next(used) for p in params)
