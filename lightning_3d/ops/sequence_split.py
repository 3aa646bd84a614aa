"""The zig-zag token split: one sequence's tokens cut over a row group of ``R`` ranks.

A sequence of ``s`` tokens is cut into ``2R`` chunks of ``L = s / (2R)`` tokens; rank ``r`` holds
chunks ``r`` and ``2R-1-r``, in that order, as its ``2L`` local tokens. Under a causal mask a
query in chunk ``c`` attends to ``(c+1)·L`` keys, so every rank's two chunks attend to
``(r+1) + (2R-r) = 2R+1`` chunks of keys: the causal work is the same on every rank (a plain cut
into ``R`` pieces would give the last rank ``2R-1`` times the first's).

Everything that reads a token's position follows the tokens: :func:`token_positions` gives each
local token's true position (for RoPE and position tables), :func:`split_sequence` cuts any
``[b, s, ...]`` tensor (hidden states, position ids, padding masks), :func:`unsplit_sequence`
reassembles the ranks' pieces, and :func:`split_targets` gives each local token the target it
predicts (the next token of the whole sequence: the last token of a chunk predicts the first of
the next chunk, wherever that lives). Pure index math; no communication (every rank of a row group
holds its sequences' full token ids).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def check_split(seq_len: int, ranks: int) -> int:
    """The chunk length ``L = seq_len / (2·ranks)``; ``ValueError`` naming the numbers unless it is whole."""
    if ranks < 1:
        raise ValueError(f"a sequence is split over at least 1 rank, got {ranks}")
    if seq_len < 1 or seq_len % (2 * ranks):
        multiple = 2 * ranks
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be cut into 2·{ranks} = {multiple} equal chunks for {ranks} ranks; "
            f"pad it to a multiple of {multiple} (e.g. {max(multiple, -(-seq_len // multiple) * multiple)} tokens)"
        )
    return seq_len // (2 * ranks)


def chunks_of(rank: int, ranks: int) -> tuple[int, int]:
    """The two chunks (of ``2·ranks``) that ``rank`` holds, in local order: ``(rank, 2·ranks-1-rank)``."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not in a row group of {ranks} ranks")
    return rank, 2 * ranks - 1 - rank


def token_positions(
    seq_len: int, rank: int, ranks: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The true positions ``[2L]`` (int64) of ``rank``'s local tokens, in local order."""
    length = check_split(seq_len, ranks)
    first, second = chunks_of(rank, ranks)
    local = torch.arange(2 * length, device=device)
    return torch.where(local < length, first * length + local, second * length + local - length)


def split_sequence(x: torch.Tensor, rank: int, ranks: int, dim: int = 1) -> torch.Tensor:
    """``rank``'s local tokens of ``x`` ``[..., s, ...]`` (sequence on ``dim``) → ``[..., 2L, ...]``, a new tensor."""
    length = check_split(x.shape[dim], ranks)
    first, second = chunks_of(rank, ranks)
    return torch.cat([x.narrow(dim, first * length, length), x.narrow(dim, second * length, length)], dim)


def unsplit_sequence(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence ``[..., s, ...]`` from every rank's local tokens ``parts[r]`` ``[..., 2L, ...]``, in
    rank order."""
    ranks = len(parts)
    if ranks == 0 or len({p.shape[dim] for p in parts}) != 1 or parts[0].shape[dim] % 2:
        raise ValueError(
            f"expected one piece of 2L tokens per rank on dim {dim}, got sizes {[p.shape[dim] for p in parts]}"
        )
    length = parts[0].shape[dim] // 2
    halves = [p.split(length, dim) for p in parts]
    return torch.cat(
        [halves[r][0] for r in range(ranks)] + [halves[r][1] for r in reversed(range(ranks))], dim
    )


def split_targets(labels: torch.Tensor, rank: int, ranks: int, ignore_index: int = -100) -> torch.Tensor:
    """The targets ``[b, 2L]`` of ``rank``'s local tokens for a causal-LM loss, from ``labels`` ``[b, s]``.

    The token at true position ``p`` predicts ``labels[:, p + 1]``; the sequence's last token
    predicts nothing (``ignore_index``). This is the shift a dense model applies before its loss
    (``logits[:, :-1]`` against ``labels[:, 1:]``), done before the split, so the last token of
    each chunk predicts the first of the next chunk even when another rank holds it.
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, seq_len], got shape {list(labels.shape)}")
    return split_sequence(shift_labels(labels, ignore_index), rank, ranks)


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """A causal LM's targets ``[..., s]`` from its labels ``[..., s]``: position ``t`` predicts label ``t+1``,
    the last position nothing (``ignore_index``). The shift a dense model applies before its loss
    (``logits[..., :-1]`` against ``labels[..., 1:]``), done on whole sequences, so that each target
    goes with its token wherever the sequence is cut."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
