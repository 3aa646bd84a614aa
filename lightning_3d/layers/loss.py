"""CrossEntropyLoss3D: the module form of :func:`vocab_parallel_cross_entropy`."""

from __future__ import annotations

import torch
from torch import nn

from ..grid import Grid, resolve_grid
from ..ops.cross_entropy import vocab_parallel_cross_entropy


class CrossEntropyLoss3D(nn.Module):
    """Mean cross-entropy of y-layout logits ``[b/(px·pz), ..., V/py]`` against full targets ``[b, ...]``."""

    def __init__(self, ignore_index: int = -100, grid: Grid | None = None):
        super().__init__()
        self.ignore_index = ignore_index
        self.grid = resolve_grid(grid)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.ignore_index, self.grid)
