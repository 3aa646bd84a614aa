"""Linear3D: ``y = x Wᵀ + b`` on the grid, turning one activation layout into the other."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..grid import Grid
from ..layout import Layout, as_layout, check_local_activation
from ..ops.matmul import matmul_abt
from ..ops.replicated import use_replicated
from ..options import RuntimeOptions
from ..sharding import ShardSpec
from .base import Module3D, init_sharded_, sharded_parameter


def linear_weight_spec(out_features: int, in_features: int, input_layout: Layout) -> ShardSpec:
    """``[out, in]`` weight of a Linear3D reading ``input_layout``.

    For ``"z"`` input: out rows cut by y (block ``j``) then x (sub-block ``i``), in columns by z;
    local ``[out/(px·py), in/pz]``. Exchange y and z for ``"y"`` input. Every element lives on
    exactly one rank of the cube.
    """
    return ShardSpec(
        (out_features, in_features), ((input_layout.row_axis, "x"), (input_layout.feature_axis,))
    )


class Linear3D(Module3D):
    """3-D parallel ``nn.Linear``.

    Input: a block ``[b/(px·pr), ..., in/pf]`` of ``input_layout`` (feature axis ``f``, other row
    axis ``r``). Output: ``[b/(px·pf), ..., out/pr]`` in the other layout.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        input_layout: ``"z"`` (output in ``"y"``) or ``"y"`` (output in ``"z"``).
        grid: defaults to the current grid.
        options: the run-time choices (``save_gathered``, ``async_tp``); default
            :class:`~lightning_3d.options.RuntimeOptions`.
        transposed: the dense twin stores the weight ``[in, out]`` (Hugging Face's ``Conv1D``):
            dense state dicts, loads and exports hold it so. The 3-D weight is ``[out, in]`` either way.
    """

    traceable = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_layout: str | Layout = "z",
        grid: Grid | None = None,
        device=None,
        dtype=None,
        options: RuntimeOptions | None = None,
        transposed: bool = False,
    ):
        super().__init__(grid, options)
        self.in_features, self.out_features = in_features, out_features
        self.dense_transposed = ("weight",) if transposed else ()
        self.input_layout = as_layout(input_layout)
        self.output_layout = self.input_layout.other
        what = f"Linear3D({in_features}, {out_features}, input_layout={self.input_layout})"
        self.weight = sharded_parameter(
            linear_weight_spec(out_features, in_features, self.input_layout),
            self.grid,
            what + " weight",
            device,
            dtype,
        )
        bias_spec = ShardSpec((out_features,), ((self.input_layout.row_axis,),))
        self.bias = sharded_parameter(bias_spec, self.grid, what + " bias", device, dtype) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s init on the global tensors: the same weights as ``nn.Linear`` from the same seed."""
        init_sharded_(self.weight, self.grid, lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            init_sharded_(self.bias, self.grid, lambda b: nn.init.uniform_(b, -bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_local_activation(x, self.input_layout, self.in_features, self.grid, "Linear3D input")
        directions = (self.input_layout.row_axis, "x", self.input_layout.feature_axis)
        bias = (
            use_replicated(self.bias, self.grid, grad_summed_over=directions[2])
            if self.bias is not None
            else None
        )
        return matmul_abt(x, self.weight, directions, self.grid, self.runtime, bias)

    def replicated_parameters(self) -> list[tuple[nn.Parameter, str]]:
        """The bias, whose gradient the product's reduce-scatter over the feature axis already sums."""
        return [(self.bias, self.input_layout.feature_axis)] if self.bias is not None else []

    def extra_repr(self) -> str:
        layouts = f"{self.input_layout}→{self.output_layout}"
        return self._describe(
            in_features=self.in_features,
            out_features=self.out_features,
            layout=layouts,
            **({"dense": "[in, out]"} if self.dense_transposed else {}),
        )
