"""FusedLinear3D: ``groups`` Linear3D layers that read the same input, run as one 3-D matmul.

The dense twin is ``nn.Linear(in, groups·out)`` whose output is ``groups`` chunks (q, k, v; or gate,
up). A plain Linear3D split of that ``[groups·out, in]`` weight would give y-block ``j`` rows of
one chunk only; attention needs q, k and v of the same heads on one rank. So the global tensor is
the dense weight viewed as ``[groups, out, in]`` and only ``out`` is cut:

- weight ``ShardSpec((groups, out, in), ((), (r, "x"), (f,)))``: local ``[groups, out/(px·pr), in/pf]``
  (``f`` the input layout's feature axis, ``r`` its other row axis);
- bias ``ShardSpec((groups, out), ((), (r,)))``: local ``[groups, out/pr]``, replicated over x and f.

The dense weight is the row-major flattening of the global tensor (``reshape(groups·out, in)``), so
dense export, load and resharding all follow from the spec with no permutation. A dense twin that
stores the packed weight ``[in, groups·out]`` (Hugging Face's ``Conv1D``: GPT-2's ``c_attn``) is
built with ``transposed=True``: its dense tensor is that flattening transposed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import nn

from ..grid import Grid
from ..layout import Layout, as_layout, check_local_activation
from ..ops.matmul import matmul_abt
from ..ops.replicated import use_replicated
from ..options import RuntimeOptions
from ..sharding import ShardSpec
from .base import Module3D, init_sharded_, sharded_parameter
from .linear import linear_weight_spec


class FusedLinear3D(Module3D):
    """``groups`` stacked ``in → out`` linears on one input.

    Input: a block ``[b/(px·pr), ..., in/pf]`` of ``input_layout``. Output: a block
    ``[b/(px·pf), ..., groups·out/pr]`` in the other layout whose ``chunk(groups, -1)`` gives, for
    each group, its output block ``j`` (``out`` cut by ``pr``): exactly what ``Linear3D(in, out)``
    would give for that group, as the dense twin's output chunks into the groups' full outputs.

    ``transposed``: the dense twin stores the weight ``[in, groups·out]`` (as :class:`Linear3D`'s).
    """

    traceable = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        groups: int,
        bias: bool = True,
        input_layout: str | Layout = "z",
        grid: Grid | None = None,
        device=None,
        dtype=None,
        options: RuntimeOptions | None = None,
        transposed: bool = False,
    ):
        super().__init__(grid, options)
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.dense_transposed = ("weight",) if transposed else ()
        self.input_layout = as_layout(input_layout)
        self.output_layout = self.input_layout.other
        what = f"FusedLinear3D({in_features}, {groups}×{out_features}, input_layout={self.input_layout})"
        plain = linear_weight_spec(out_features, in_features, self.input_layout)
        self.weight = sharded_parameter(
            ShardSpec((groups,) + plain.global_shape, ((),) + plain.dims),
            self.grid,
            what + " weight",
            device,
            dtype,
        )
        bias_spec = ShardSpec((groups, out_features), ((), (self.input_layout.row_axis,)))
        self.bias = sharded_parameter(bias_spec, self.grid, what + " bias", device, dtype) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear(in, out)``'s init for each group."""
        bound = 1 / math.sqrt(self.in_features)
        init_sharded_(
            self.weight, self.grid, lambda w: [nn.init.kaiming_uniform_(g, a=math.sqrt(5)) for g in w]
        )
        if self.bias is not None:
            init_sharded_(self.bias, self.grid, lambda b: nn.init.uniform_(b, -bound, bound))

    @property
    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the dense twin ``nn.Linear(in, groups·out)``'s tensors (before ``dense_transposed``)."""
        shapes = {"weight": (self.groups * self.out_features, self.in_features)}
        if self.bias is not None:
            shapes["bias"] = (self.groups * self.out_features,)
        return shapes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The x all-gather stacked the weight blocks as [px, groups, out/(px·pr)]: put the groups
        # outermost (a view when px = 1, one copy otherwise).
        return self._product(x).transpose(-3, -2).flatten(-3)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """The 3-D product ``[..., px, groups, out/(px·pr)]``: its columns in the order the x
        all-gather stacks the weight blocks."""
        check_local_activation(x, self.input_layout, self.in_features, self.grid, "FusedLinear3D input")
        px = self.grid.size("x")
        bias = self._bias()
        if bias is not None:  # in the product's column order [px, groups, out/(px·pr)], added inside the GEMM
            bias = bias.unflatten(-1, (px, -1)).transpose(0, 1).flatten()
        y = matmul_abt(x, self.weight, self._directions, self.grid, self.runtime, bias)
        return y.unflatten(-1, (px, self.groups, -1))

    def forward_groups(self, x: torch.Tensor, runs: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The output cut into runs of ``runs[i]`` consecutive groups (summing to ``groups``), each
        ``[..., px, runs[i], out/(px·pr)]``: the columns as the product leaves them, each group in
        ``px`` blocks (``self(x)`` is ``y.transpose(-3, -2).flatten(-3)`` of them all, a copy when
        px > 1). Code that works on each feature or head alone (SwiGLU, RoPE) reads the groups
        there, so that neither they nor their gradients are copied into the packed order first.

        On a one-rank cube each run is a product of its own (its rows of the weight), so each
        output is contiguous, and backward takes each run's gradient as it comes instead of
        concatenating them into the packed layout first (attention's q, k and v gradients come
        from separate kernels). On larger cubes, views of one 3-D product. It runs outside the
        module's call: forward hooks registered on the layer do not see it."""
        if sum(runs) != self.groups:
            raise ValueError(
                f"runs {list(runs)} sum to {sum(runs)}, not to the {self.groups} groups of {self.extra_repr()}"
            )
        if self.grid.cube_size > 1:
            return self._product(x).split(list(runs), -2)
        check_local_activation(x, self.input_layout, self.in_features, self.grid, "FusedLinear3D input")
        bias, starts = self._bias(), itertools.accumulate(runs, initial=0)
        return tuple(
            matmul_abt(
                x,
                self.weight[start : start + n],
                self._directions,
                self.grid,
                self.runtime,
                None if bias is None else bias[start : start + n].flatten(),
            ).unflatten(-1, (1, n, -1))
            for start, n in zip(starts, runs)
        )

    @property
    def _directions(self) -> tuple[str, str, str]:
        return (self.input_layout.row_axis, "x", self.input_layout.feature_axis)

    def _bias(self) -> torch.Tensor | None:
        """The bias ``[groups, out/pr]`` for this forward, its gradient summed over its replicas."""
        if self.bias is None:
            return None
        return use_replicated(self.bias, self.grid, grad_summed_over=self._directions[2])

    def replicated_parameters(self) -> list[tuple[nn.Parameter, str]]:
        """The bias, whose gradient the product's reduce-scatter over the feature axis already sums."""
        return [(self.bias, self.input_layout.feature_axis)] if self.bias is not None else []

    def extra_repr(self) -> str:
        return self._describe(
            in_features=self.in_features,
            out_features=self.out_features,
            groups=self.groups,
            layout=f"{self.input_layout}→{self.output_layout}",
            **({"dense": "[in, groups·out]"} if self.dense_transposed else {}),
        )
