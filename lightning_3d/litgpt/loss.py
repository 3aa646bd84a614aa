"""LitGPT's training loss on the grid: the vocabulary-parallel cross-entropy of y-layout logits."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.cross_entropy import vocab_parallel_cross_entropy
from ..parallel import grid_of, runtime_of


def cross_entropy(
    model: nn.Module,
    logits: torch.Tensor | list[torch.Tensor],
    targets: torch.Tensor,
    ignore_index: int = -100,
) -> torch.Tensor:
    """What ``litgpt.utils.chunked_cross_entropy(logits, targets)`` computes on the unparallelized
    model: the mean cross-entropy over the targets that are not ``ignore_index``, softmax over
    LitGPT's padded vocabulary (``config.padded_vocab_size``); its local passes over the logits
    compiled while the model's options say ``compile``.

    Args:
        model: the parallelized ``litgpt.model.GPT`` that made ``logits``.
        logits: this rank's y-layout block ``[b/(px·pz), s, V'/py]`` of ``model(idx)``, or the list
            ``model(idx, lm_head_chunk_size=n)`` returns (chunks of the sequence).
        targets: ``[b, s]``, the full batch on every cube rank.

    Returns:
        A scalar, the same on every cube rank.
    """
    if isinstance(logits, (list, tuple)):
        logits = torch.cat(list(logits), 1)
    return vocab_parallel_cross_entropy(
        logits,
        targets,
        ignore_index,
        grid_of(model),
        model.config.padded_vocab_size,
        compiled=runtime_of(model).options.compile,
    )
