"""VocabParallelEmbedding3D: full token ids in, z-layout activation out."""

from __future__ import annotations

import torch
from torch import nn

from ..agreement import agree_on_first_call
from ..grid import Grid
from ..layout import Layout
from ..ops.embedding import vocab_parallel_embedding
from ..runtime import check_token_range
from .base import Module3D, init_sharded_, sharded_parameter
from .linear import linear_weight_spec


class VocabParallelEmbedding3D(Module3D):
    """``nn.Embedding`` with the weight ``[V, h]`` laid out as a z→y :class:`Linear3D` weight.

    Local weight ``[V/(px·py), h/pz]``; an LM head ``Linear3D(h, V, input_layout="z")`` can share
    it. Input: token ids ``[b, ...]``, the same on every cube rank. Output: z-layout
    ``[b/(px·py), ..., h/pz]``.

    Ids outside ``[0, vocab_size)`` raise ``ValueError`` on every cube rank, as in ``nn.Embedding``
    (``vocab_size`` defaults to ``num_embeddings``; a table padded for the grid, as GPT3D's, passes
    the true size, so that the padding rows are never looked up), unless
    ``RuntimeOptions.check_inputs`` is off. The first call also checks that
    every cube rank was given the same ids (one small all-gather over the cube).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        grid: Grid | None = None,
        device=None,
        dtype=None,
        vocab_size: int | None = None,
        padding_idx: int | None = None,
    ):
        super().__init__(grid)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_size = num_embeddings if vocab_size is None else vocab_size
        if not 0 < self.vocab_size <= num_embeddings:
            raise ValueError(
                f"VocabParallelEmbedding3D: vocab_size {vocab_size} must be in [1, num_embeddings = {num_embeddings}]"
            )
        if padding_idx is not None and not 0 <= padding_idx < self.vocab_size:
            raise ValueError(
                f"VocabParallelEmbedding3D: padding_idx {padding_idx} must be in [0, vocab_size = {self.vocab_size})"
            )
        self.padding_idx = padding_idx
        spec = linear_weight_spec(num_embeddings, embedding_dim, Layout("z"))
        self.weight = sharded_parameter(
            spec,
            self.grid,
            f"VocabParallelEmbedding3D({num_embeddings}, {embedding_dim}) weight",
            device,
            dtype,
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s init (standard normal) on the global tensor."""
        init_sharded_(self.weight, self.grid, nn.init.normal_)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        agree_on_first_call(self, self.grid.group("cube"), "VocabParallelEmbedding3D input", ids=ids)
        if self.options.check_inputs:
            check_token_range(
                ids,
                self.vocab_size,
                "VocabParallelEmbedding3D",
                "token id",
                deferred=self.runtime.token_checks,
            )
        px, py, _ = self.grid.shape
        b = ids.shape[0]
        if b % (px * py):
            raise ValueError(
                f"VocabParallelEmbedding3D: batch {b} must be divisible by px·py = {px * py} on grid "
                f"{self.grid.shape}; "
                f"use a batch that is a multiple of {px * py}"
            )
        i, j = self.grid.coord("x"), self.grid.coord("y")
        rows = b // px
        vocab_start = j * (self.num_embeddings // py)
        return vocab_parallel_embedding(
            ids[i * rows : (i + 1) * rows],
            self.weight,
            vocab_start,
            self.grid.group("x"),
            self.grid.group("y"),
            self.padding_idx,
        )

    def extra_repr(self) -> str:
        sizes = {"vocab_size": self.vocab_size} if self.vocab_size != self.num_embeddings else {}
        return self._describe(
            num_embeddings=self.num_embeddings, embedding_dim=self.embedding_dim, **sizes, layout="ids→z"
        )
