"""Activation layouts: which grid axes split a ``[batch, ..., features]`` activation.

Two layouts exist, named by the axis that splits the features:

- ``"z"``: batch block ``(i, j)`` (cut by px, then py), feature block ``l``.
  Local shape ``[b/(px·py), ..., N/pz]``. A Transformer block's input and output.
- ``"y"``: batch block ``(i, l)``, feature block ``j``. Local shape ``[b/(px·pz), ..., N/py]``.

Batches are cut whole sequences at a time, so attention over a sequence is local. A
:class:`~lightning_3d.layers.Linear3D` turns one layout into the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .agreement import agree_on_first_call
from .grid import Grid, resolve_grid
from .sharding import ShardSpec, shard_tensor, unshard_tensor


@dataclass(frozen=True)
class Layout:
    """A layout, named by its feature axis (``"z"`` or ``"y"``)."""

    feature_axis: str

    def __post_init__(self):
        if self.feature_axis not in ("y", "z"):
            raise ValueError(f"layout must be 'z' or 'y', got {self.feature_axis!r}")

    @property
    def row_axis(self) -> str:
        """The axis that cuts the batch inside an x block (the other of y, z)."""
        return "y" if self.feature_axis == "z" else "z"

    @property
    def other(self) -> Layout:
        """The layout a Linear3D turns this one into."""
        return Layout(self.row_axis)

    @property
    def name(self) -> str:
        return self.feature_axis

    def spec(self, shape: tuple[int, ...]) -> ShardSpec:
        """ShardSpec of a global activation ``[batch, ..., features]`` in this layout."""
        middle = ((),) * (len(shape) - 2)
        return ShardSpec(tuple(shape), (("x", self.row_axis),) + middle + ((self.feature_axis,),))

    def __str__(self) -> str:
        return self.feature_axis


def as_layout(layout: str | Layout) -> Layout:
    """``"z"`` / ``"y"`` / a Layout → Layout."""
    return layout if isinstance(layout, Layout) else Layout(layout)


class _Split(torch.autograd.Function):
    """Replicated full activation → local shard; backward assembles the full gradient everywhere."""

    @staticmethod
    def forward(ctx, full, spec, grid):
        ctx.spec, ctx.grid = spec, grid
        return shard_tensor(full, spec, grid).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return unshard_tensor(grad, ctx.spec, ctx.grid), None, None


class _Gather(torch.autograd.Function):
    """Local shard → full activation on every cube rank; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, local, spec, grid):
        ctx.spec, ctx.grid = spec, grid
        return unshard_tensor(local, spec, grid)

    @staticmethod
    def backward(ctx, grad):
        return shard_tensor(grad, ctx.spec, ctx.grid).contiguous(), None, None


def split_activation(
    full: torch.Tensor, layout: str | Layout = "z", grid: Grid | None = None
) -> torch.Tensor:
    """This rank's block of a full activation ``[batch, ..., features]`` (the same on every cube rank).

    Differentiable: the gradient of ``full`` is the full gradient, on every cube rank. The first
    call on a grid checks that every cube rank passed the same shape (one small all-gather).
    """
    grid = resolve_grid(grid)
    agree_on_first_call(grid, grid.group("cube"), "split_activation input", full=full)
    spec = as_layout(layout).spec(tuple(full.shape))
    spec.check(grid, "activation")
    return _Split.apply(full, spec, grid)


def gather_activation(
    local: torch.Tensor, layout: str | Layout = "z", grid: Grid | None = None
) -> torch.Tensor:
    """The full activation ``[batch, ..., features]`` on every cube rank, from each rank's block."""
    grid = resolve_grid(grid)
    agree_on_first_call(grid, grid.group("cube"), "gather_activation input", local=local)
    layout = as_layout(layout)
    shape = list(local.shape)
    shape[0] *= grid.size("x" + layout.row_axis)
    shape[-1] *= grid.size(layout.feature_axis)
    return _Gather.apply(local, layout.spec(tuple(shape)), grid)


def check_local_activation(x: torch.Tensor, layout: Layout, features: int, grid: Grid, who: str) -> None:
    """Raise ``ValueError`` unless ``x`` is a local block of a ``[batch, ..., features]`` activation in ``layout``.

    The first call of each ``who`` on a grid first checks that every cube rank holds a block of
    the same shape, as the layout requires (one small all-gather), so that a batch the ranks
    disagree on raises on all of them instead of hanging their collectives.
    """
    agree_on_first_call(grid, grid.group("cube"), who, input=x)
    f = grid.size(layout.feature_axis)
    if x.dim() < 2 or x.shape[-1] * f != features:
        raise ValueError(
            f"{who}: expected a {layout}-layout block [batch/(px·p{layout.row_axis}), ..., "
            f"{features}/p{layout.feature_axis}="
            f"{features // f if features % f == 0 else features / f}], got {list(x.shape)} on grid {grid.shape}"
        )
    px, py, pz = grid.shape
    batch = x.shape[0] * grid.size("x" + layout.row_axis)
    if batch % (px * py) or batch % (px * pz):
        raise ValueError(
            f"{who}: global batch {batch} must be divisible by px·py = {px * py} and px·pz = {px * pz} on "
            f"grid {grid.shape}; "
            f"use a batch that is a multiple of {math.lcm(px * py, px * pz)}"
        )
