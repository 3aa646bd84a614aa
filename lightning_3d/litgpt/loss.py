"""LitGPT's training loss on the grid: the vocabulary-parallel cross-entropy of y-layout logits."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.cross_entropy import vocab_parallel_cross_entropy
from ..ops.sequence_split import shift_labels
from ..parallel import grid_of, runtime_of
from ..token_rows import cached_token_rows, chunks_per_sequence


def cross_entropy(
    model: nn.Module,
    logits: torch.Tensor | list[torch.Tensor],
    targets: torch.Tensor,
    ignore_index: int = -100,
    shift: bool = False,
) -> torch.Tensor:
    """What ``litgpt.utils.chunked_cross_entropy(logits, targets)`` computes on the unparallelized
    model: the mean cross-entropy over the targets that are not ``ignore_index``, softmax over
    LitGPT's padded vocabulary (``config.padded_vocab_size``); its local passes over the logits
    compiled while the model's options say ``compile``.

    Args:
        model: the parallelized ``litgpt.model.GPT`` that made ``logits``.
        logits: this rank's y-layout block of ``model(idx)``, ``[b/(px·pz), s, V'/py]`` or on token
            rows ``[b·C/(px·pz), s/C, V'/py]``, or the list ``model(idx, lm_head_chunk_size=n)``
            returns (chunks of the rows).
        targets: ``[b, s]``, the full batch on every cube rank: the target of each position of
            ``idx``, or with ``shift`` its labels (position ``t`` predicts ``targets[:, t + 1]``,
            the last position nothing: ``chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])``
            of LitGPT's fine-tuning, whose slice of the logits token rows cannot take).

    Returns:
        A scalar, the same on every cube rank.
    """
    if isinstance(logits, (list, tuple)):
        logits = torch.cat(list(logits), 1)
    grid = grid_of(model)
    if targets.dim() != 2:
        raise ValueError(f"targets {list(targets.shape)}: expected the full batch [b, s] on every cube rank")
    if shift:
        targets = shift_labels(targets, ignore_index)
    (b, s), chunks = targets.shape, chunks_per_sequence(grid)
    on_rows = logits.shape[0] * grid.size("xz") == b * chunks  # token rows: b·C rows of s/C tokens
    if logits.dim() != 3 or logits.shape[1] * (chunks if on_rows else 1) != s:
        raise ValueError(
            f"logits {list(logits.shape)} are not the rows of targets {list(targets.shape)} on grid {grid.shape} "
            f"(whole sequences [b/(px·pz), s, ·] or token rows [b·{chunks}/(px·pz), s/{chunks}, ·]): pass the logits "
            "as the model returns them and the targets of whole sequences (shift=True for labels: slice neither)"
        )
    if on_rows:
        targets = cached_token_rows(model, b, s, grid, targets.device).arrange(targets)
    return vocab_parallel_cross_entropy(
        logits,
        targets,
        ignore_index,
        grid,
        model.config.padded_vocab_size,
        compiled=runtime_of(model).options.compile,
    )
