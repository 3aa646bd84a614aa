"""Token ids out of range raise, as ``nn.Embedding`` and ``F.cross_entropy`` do.

Without the check an id outside the vocabulary looks up nothing (an all-zero row) or targets no
logit, and training goes on with a finite, wrong loss. Every rank of a cube holds the same full
ids, so the local check raises identically on all of them, with no communication. Cost: one
elementwise comparison over ``[batch, seq]`` ints and one host sync per call.
"""

from __future__ import annotations

import torch


def check_token_range(ids: torch.Tensor, size: int, who: str, what: str, ignore_index: int | None = None) -> None:
    """Raise ``ValueError`` naming the first id of ``ids`` outside ``[0, size)`` (other than ``ignore_index``)."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{who}: {what}s must be integer token ids, got {ids.dtype}")
    bad = (ids < 0) | (ids >= size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        allowed = f"[0, {size})" + (f" or ignore_index {ignore_index}" if ignore_index is not None else "")
        raise ValueError(
            f"{who}: {what} {int(ids[where])} at index {where} of {list(ids.shape)} is outside {allowed} "
            f"({int(bad.sum())} such); the vocabulary has {size} tokens: map the {what}s into [0, {size}) "
            "or build the model with the tokenizer's vocabulary size"
        )
