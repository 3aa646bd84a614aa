"""Autoregressive sampling shared by both models (nanoGPT's ``generate``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


@torch.no_grad()
def generate_tokens(
    next_logits: Callable[[torch.Tensor], torch.Tensor],
    idx: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Append ``max_new_tokens`` sampled tokens to ``idx`` ``[b, s]``.

    ``next_logits(idx_cond)`` returns the full last-position logits ``[b, V]`` (padded entries
    already masked) for the last ``block_size`` tokens; ``agree(tokens)`` ``[b, 1]`` may replace the
    draw with one every rank shares. ``top_k=1`` is greedy decoding.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use top_k=1 for greedy decoding")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    for _ in range(max_new_tokens):
        logits = next_logits(idx[:, -block_size:])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        tokens = torch.multinomial(torch.softmax(logits, -1), 1)
        if agree is not None:
            tokens = agree(tokens)
        idx = torch.cat([idx, tokens.to(idx.device)], 1)
    return idx
