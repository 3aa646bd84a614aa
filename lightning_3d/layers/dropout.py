"""Dropout3D: an independent mask stream on every rank, replayed by activation checkpointing."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio) that spreads rank ids over the seed space


class Dropout3D(nn.Module):
    """``nn.Dropout`` for partitioned activations.

    RNG scheme: each call draws one seed from the default CPU generator (in step on every rank,
    since all ranks seed alike and draw alike) and mixes in the global rank, so every rank masks its
    own block with its own stream. ``torch.utils.checkpoint`` restores the CPU RNG state before
    recomputing, so the recomputed masks equal the first ones.
    """

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return _drop(x, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


@torch.compiler.disable
def _drop(x: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` masked by this rank's stream (module doc); opaque to ``torch.compile``, whose own RNG would not
    follow the scheme."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator(device=x.device)
    gen.manual_seed((seed ^ ((rank + 1) * _MIX)) % 2**63)
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen)
    return x * keep / (1.0 - p)
