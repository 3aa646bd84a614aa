"""LayerNorm3D and RMSNorm3D over features split along a layout's feature axis."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..grid import Grid
from ..layout import Layout, as_layout, check_local_activation
from ..ops.norm import normalize
from ..ops.replicated import use_replicated_together
from ..sharding import ShardSpec
from .base import Module3D, init_sharded_, sharded_parameter


def _features(normalized_shape) -> int:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"3-D norms normalise the last dim only; got normalized_shape={shape}")
    return shape[0]


class _Norm3D(Module3D):
    """Shared body: a feature vector per affine parameter, block ``f`` replicated over the rows."""

    traceable = True

    center: bool

    def __init__(self, normalized_shape, eps, elementwise_affine, bias, layout, grid, device, dtype):
        super().__init__(grid)
        self.layout = as_layout(layout)
        self.normalized_shape = (_features(normalized_shape),)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        spec = ShardSpec(self.normalized_shape, ((self.layout.feature_axis,),))
        what = f"{type(self).__name__}({self.normalized_shape[0]}, layout={self.layout})"
        self.weight = (
            sharded_parameter(spec, self.grid, what + " weight", device, dtype)
            if elementwise_affine
            else None
        )
        self.bias = (
            sharded_parameter(spec, self.grid, what + " bias", device, dtype)
            if elementwise_affine and bias
            else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            init_sharded_(self.weight, self.grid, nn.init.ones_)
        if self.bias is not None:
            init_sharded_(self.bias, self.grid, nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_local_activation(
            x, self.layout, self.normalized_shape[0], self.grid, f"{type(self).__name__} input"
        )
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        weight, bias = use_replicated_together((self.weight, self.bias), self.grid)
        if self.grid.size(self.layout.feature_axis) == 1:  # whole rows on this rank: torch's fused kernel
            if self.center:
                return F.layer_norm(x, self.normalized_shape, weight, bias, eps)
            return F.rms_norm(x, self.normalized_shape, weight, eps)
        y = normalize(
            x, self.normalized_shape[0], eps, self.center, self.grid.group(self.layout.feature_axis)
        )
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    def replicated_parameters(self) -> list[tuple[nn.Parameter, str]]:
        return [(p, "") for p in (self.weight, self.bias) if p is not None]

    def extra_repr(self) -> str:
        return self._describe(normalized_shape=self.normalized_shape, eps=self.eps, layout=self.layout)


class LayerNorm3D(_Norm3D):
    """``nn.LayerNorm`` over the last dim of a ``layout`` block ``[..., N/pf]``; statistics reduced over ``f``."""

    center = True

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        layout: str | Layout = "z",
        grid: Grid | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, layout, grid, device, dtype)


class RMSNorm3D(_Norm3D):
    """``nn.RMSNorm`` over the last dim of a ``layout`` block; ``eps=None`` takes ``finfo(dtype).eps``."""

    center = False

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        layout: str | Layout = "z",
        grid: Grid | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(normalized_shape, eps, elementwise_affine, False, layout, grid, device, dtype)
