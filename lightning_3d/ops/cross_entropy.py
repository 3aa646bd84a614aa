"""Vocabulary-parallel cross-entropy on y-layout logits.

Logits ``[b/(px·pz), s, V/py]`` hold batch block ``(i, l)`` and vocab block ``j``. The row max, the
sum of exponentials and the target logit are reduced over y (in at least fp32), so every y rank
holds the same per-token losses; the mean over the non-ignored tokens of the cube's whole batch
then sums over x and z only. Every cube rank returns the same scalar, and backward is the local
gradient of that one scalar: ``(softmax − onehot) / n_tokens``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..grid import Grid, resolve_grid
from ..layout import Layout
from .token_ids import check_token_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, ignore_index, group_vocab, group_rows):
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        row_max = x.max(-1, keepdim=True).values
        comm.all_reduce(row_max, group_vocab, op=dist.ReduceOp.MAX)
        exp = torch.exp(x - row_max)
        local = targets - vocab_start
        hit = (local >= 0) & (local < x.shape[-1])
        local = torch.where(hit, local, torch.zeros_like(local))
        target_logit = torch.gather(x, -1, local.unsqueeze(-1)).squeeze(-1) * hit
        sums = torch.stack([exp.sum(-1), target_logit], 0)
        comm.all_reduce(sums, group_vocab)
        sum_exp, target_logit = sums
        valid = targets != ignore_index
        token_loss = (torch.log(sum_exp) + row_max.squeeze(-1) - target_logit) * valid
        totals = torch.stack([token_loss.sum(), valid.sum().to(x.dtype)])
        comm.all_reduce(totals, group_rows)
        ctx.save_for_backward(exp, sum_exp, local, hit & valid, valid, totals[1])
        ctx.logits_dtype = logits.dtype
        return totals[0] / totals[1]

    @staticmethod
    def backward(ctx, grad):
        exp, sum_exp, local, onehot_rows, valid, count = ctx.saved_tensors
        g = exp / sum_exp.unsqueeze(-1)
        g.scatter_add_(-1, local.unsqueeze(-1), -onehot_rows.unsqueeze(-1).to(g.dtype))
        g = g * (valid.unsqueeze(-1) * (grad / count))
        return g.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, grid: Grid | None = None,
    vocab_size: int | None = None, check_targets: bool = True,
) -> torch.Tensor:
    """Mean cross-entropy over the cube's whole batch from y-layout logits and full targets.

    Args:
        logits: ``[b/(px·pz), ..., V/py]``, y-layout (vocab block ``j``).
        targets: ``[b, ...]`` token ids, the same on every cube rank, each in ``[0, vocab_size)``
            or ``ignore_index``; any other value raises ``ValueError`` (as ``F.cross_entropy``).
        vocab_size: the true vocabulary when the logits' ``V`` is padded (GPT3D's); defaults to ``V``.
        check_targets: False skips the range check (and its host sync): a target out of range
            then adds a wrong, finite loss.

    Returns:
        A scalar, the same on every cube rank (fp32, or float64 for float64 logits).
    """
    grid = resolve_grid(grid)
    layout = Layout("y")
    rows = "x" + layout.row_axis
    b_local = logits.shape[0]
    if targets.shape[0] != b_local * grid.size(rows) or targets.shape[1:] != logits.shape[1:-1]:
        raise ValueError(
            f"targets {list(targets.shape)} do not match y-layout logits {list(logits.shape)} on grid {grid.shape}: "
            f"expected [{b_local * grid.size(rows)}, {', '.join(map(str, logits.shape[1:-1]))}] (batch = {b_local}·px·pz)"
        )
    padded = logits.shape[-1] * grid.size(layout.feature_axis)
    if check_targets:
        check_token_range(targets, padded if vocab_size is None else vocab_size, "vocab_parallel_cross_entropy", "target", ignore_index)
    block = grid.rank_in(rows)
    targets = targets[block * b_local : (block + 1) * b_local]
    vocab_start = grid.coord(layout.feature_axis) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(
        logits, targets, vocab_start, ignore_index, grid.group(layout.feature_axis), grid.group(rows)
    )
