"""PositionEmbedding3D: learned positions, added to a z-layout activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..grid import Grid
from ..ops.replicated import use_replicated
from ..sharding import ShardSpec
from .base import Module3D, init_sharded_, sharded_parameter


class PositionEmbedding3D(Module3D):
    """``nn.Embedding(num_positions, h)`` with the features cut by z (local ``[num_positions, h/pz]``),
    replicated over x and y.

    ``forward(positions)`` (integer ``[..., s]``, e.g. ``arange(s)``) → ``[..., s, h/pz]``, to add to a
    z-layout ``[b/(px·py), s, h/pz]`` (positions ``[s]`` broadcast over the batch block).
    """

    def __init__(
        self, num_positions: int, embedding_dim: int, grid: Grid | None = None, device=None, dtype=None
    ):
        super().__init__(grid)
        self.num_positions, self.embedding_dim = num_positions, embedding_dim
        spec = ShardSpec((num_positions, embedding_dim), ((), ("z",)))
        self.weight = sharded_parameter(
            spec, self.grid, f"PositionEmbedding3D({num_positions}, {embedding_dim}) weight", device, dtype
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s init (standard normal) on the global tensor."""
        init_sharded_(self.weight, self.grid, nn.init.normal_)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, use_replicated(self.weight, self.grid))

    def replicated_parameters(self) -> list[tuple[nn.Parameter, str]]:
        return [(self.weight, "")]

    def extra_repr(self) -> str:
        return self._describe(
            num_positions=self.num_positions, embedding_dim=self.embedding_dim, layout="positions→z"
        )
