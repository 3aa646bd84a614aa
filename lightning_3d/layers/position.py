"""PositionEmbedding3D: GPT-2's learned positions, added to a z-layout activation."""

from __future__ import annotations

import torch
from torch import nn

from ..grid import Grid
from ..layers.base import Module3D, init_sharded_, sharded_parameter
from ..ops.replicated import use_replicated
from ..sharding import ShardSpec


class PositionEmbedding3D(Module3D):
    """Weight ``[block_size, h]`` cut by z on the features (local ``[block_size, h/pz]``), replicated over x and y.

    ``forward(seq_len)`` → ``[seq_len, h/pz]``, to add to a z-layout ``[b/(px·py), seq_len, h/pz]``.
    """

    def __init__(self, block_size: int, embedding_dim: int, grid: Grid | None = None, device=None, dtype=None):
        super().__init__(grid)
        self.block_size, self.embedding_dim = block_size, embedding_dim
        spec = ShardSpec((block_size, embedding_dim), ((), ("z",)))
        self.weight = sharded_parameter(spec, self.grid, f"PositionEmbedding3D({block_size}, {embedding_dim}) weight", device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s init (standard normal) on the global tensor."""
        init_sharded_(self.weight, self.grid, nn.init.normal_)

    def forward(self, seq_len: int) -> torch.Tensor:
        return use_replicated(self.weight, self.grid)[:seq_len]

    def extra_repr(self) -> str:
        return self._describe(block_size=self.block_size, embedding_dim=self.embedding_dim, layout="positions→z")
