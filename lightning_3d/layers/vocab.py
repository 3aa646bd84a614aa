"""A vocabulary padded to ``V'`` rows so that it splits on the grid: the embedding and the LM head over it.

``V' = padded_vocab_size(V, grid, multiple)`` is a multiple of ``lcm(multiple, px·py)`` (the rows of
a z-input weight are cut by py, then px). The padded rows are zeros in a dense load, never looked
up, and their logits are set to the dtype's lowest value, so they drop out of a softmax, a loss
(their gradient is zero) and sampling. Both modules declare ``dense_shapes``, so dense state dicts
and checkpoint export hold the ``V`` real rows only.
"""

from __future__ import annotations

import math

import torch

from ..grid import Grid, resolve_grid
from ..options import RuntimeOptions
from .embedding import VocabParallelEmbedding3D
from .linear import Linear3D


def padded_vocab_size(vocab_size: int, grid: Grid | None = None, multiple: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``lcm(multiple, px·py)``."""
    px, py, _ = resolve_grid(grid).shape
    m = math.lcm(multiple, px * py)
    return m * math.ceil(vocab_size / m)


class PaddedEmbedding3D(VocabParallelEmbedding3D):
    """:class:`VocabParallelEmbedding3D` of ``vocab_size`` real rows stored as ``padded_vocab_size`` rows."""

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        embedding_dim: int,
        grid: Grid | None = None,
        device=None,
        dtype=None,
        padding_idx: int | None = None,
    ):
        super().__init__(
            padded_vocab_size,
            embedding_dim,
            grid,
            device,
            dtype,
            vocab_size=vocab_size,
            padding_idx=padding_idx,
        )

    @property
    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """The dense ``nn.Embedding(vocab_size, embedding_dim)`` weight."""
        return {"weight": (self.vocab_size, self.embedding_dim)}


class LMHead3D(Linear3D):
    """LM head ``nn.Linear(in_features, vocab_size)``: z-layout ``[b/(px·py), ..., in/pz]`` → y-layout
    logits ``[b/(px·pz), ..., V'/py]`` over the padded vocabulary, padded logits at the dtype's lowest value.

    A tied head shares the :class:`PaddedEmbedding3D` weight: both are ``[V', h]`` z-input weights.
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        padded_vocab_size: int,
        bias: bool = False,
        grid: Grid | None = None,
        device=None,
        dtype=None,
        options: RuntimeOptions | None = None,
    ):
        if padded_vocab_size < vocab_size:
            raise ValueError(f"padded_vocab_size {padded_vocab_size} < vocab_size {vocab_size}")
        super().__init__(in_features, padded_vocab_size, bias, "z", grid, device, dtype, options)
        self.vocab_size = vocab_size

    @property
    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """The dense ``nn.Linear(in_features, vocab_size)``'s tensors."""
        shapes = {"weight": (self.vocab_size, self.in_features)}
        if self.bias is not None:
            shapes["bias"] = (self.vocab_size,)
        return shapes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        width = logits.shape[-1]
        start = self.grid.coord("y") * width
        if start + width <= self.vocab_size:
            return logits
        padded = torch.arange(start, start + width, device=logits.device) >= self.vocab_size
        return logits.masked_fill(padded, torch.finfo(logits.dtype).min)
