"""Vocabulary-parallel cross-entropy on y-layout logits.

Logits ``[b/(px·pz), s, V/py]`` hold batch block ``(i, l)`` and vocab block ``j``. The row max, the
sum of exponentials and the target logit are reduced over y (in at least fp32), so every y rank
holds the same per-token losses; the mean over the non-ignored tokens of the cube's whole batch
then sums over x and z only. Every cube rank returns the same scalar, and backward is the local
gradient of that one scalar: ``(softmax − onehot) / n_tokens``. Eagerly the fp32 exponentials are
kept for it; compiled, the logits are kept (half the bytes in bf16) and the softmax recomputed, in
one kernel that writes the logits' gradient in their dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import comm
from ..grid import Grid, resolve_grid
from ..layout import Layout
from ..runtime import DeferredTokenChecks, check_token_range


class _LocalMath(NamedTuple):
    """The rank-local passes over the logits block; the collectives run between them."""

    row_max: Callable
    sums: Callable
    grad: Callable


def _row_max(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V/py]`` → the row max ``[..., 1]`` in at least fp32 (a max is exact in any dtype)."""
    return logits.amax(-1, keepdim=True).to(torch.promote_types(logits.dtype, torch.float32))


def _sums_keep_exp(logits: torch.Tensor, row_max: torch.Tensor, local: torch.Tensor, hit: torch.Tensor):
    """``([2, ...], kept)``: the sum of ``exp(x − max)`` over this vocab block and the target's logit
    (0 where the target lies in another block); ``kept`` = ``exp(x − max)`` in fp32 for backward."""
    x = logits.to(row_max.dtype)
    target = torch.gather(x, -1, local.unsqueeze(-1)).squeeze(-1) * hit
    exp = (
        x - row_max if x is logits else x.sub_(row_max)
    ).exp_()  # the cast's copy reused: one fp32 block, not three
    return torch.stack([exp.sum(-1), target]), exp


def _sums_keep_logits(logits: torch.Tensor, row_max: torch.Tensor, local: torch.Tensor, hit: torch.Tensor):
    """As :func:`_sums_keep_exp`, keeping the logits themselves (backward recomputes the exponentials)."""
    return _sums_keep_exp(logits, row_max, local, hit)[0], logits


def _grad_from_exp(exp, row_max, sum_exp, local, onehot_rows, scale, dtype) -> torch.Tensor:
    """``(softmax − onehot) · scale`` in ``dtype`` from the kept ``exp(x − max)``."""
    g = exp / sum_exp.unsqueeze(-1)
    g.scatter_add_(-1, local.unsqueeze(-1), -onehot_rows.unsqueeze(-1).to(g.dtype))
    return g.mul_(scale.unsqueeze(-1)).to(dtype)


def _grad_from_logits(logits, row_max, sum_exp, local, onehot_rows, scale, dtype) -> torch.Tensor:
    """As :func:`_grad_from_exp`, the exponentials recomputed from the kept logits, and the one-hot
    subtracted elementwise (a comparison with the column index, not a scatter), so that compiled it
    is one kernel writing the gradient in ``dtype``: a scatter would make it keep the fp32
    gradient ``[..., V/py]`` beside the logits and their gradient."""
    g = torch.exp(logits.to(row_max.dtype) - row_max) / sum_exp.unsqueeze(-1)
    column = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (column == local.unsqueeze(-1)) & onehot_rows.unsqueeze(-1)
    return ((g - onehot.to(g.dtype)) * scale.unsqueeze(-1)).to(dtype)


# Eager: keep the fp32 exponentials (fewest passes over memory). Compiled: keep the logits and
# recompute, each function fusing into a kernel or two that read the logits in their own dtype.
_EAGER = _LocalMath(_row_max, _sums_keep_exp, _grad_from_exp)


@functools.cache
def _compiled() -> _LocalMath:
    """The local passes through ``torch.compile``, keeping the logits rather than fp32 exponentials."""
    return _LocalMath(*(torch.compile(f) for f in (_row_max, _sums_keep_logits, _grad_from_logits)))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, ignore_index, group_vocab, group_rows, math):
        local = targets - vocab_start
        hit = (local >= 0) & (local < logits.shape[-1])
        local = torch.where(hit, local, torch.zeros_like(local))
        row_max = math.row_max(logits)
        comm.all_reduce(row_max, group_vocab, op=dist.ReduceOp.MAX)
        sums, kept = math.sums(logits, row_max, local, hit)
        comm.all_reduce(sums, group_vocab)
        sum_exp, target_logit = sums
        valid = targets != ignore_index
        token_loss = (torch.log(sum_exp) + row_max.squeeze(-1) - target_logit) * valid
        totals = torch.stack([token_loss.sum(), valid.sum().to(sums.dtype)])
        comm.all_reduce(totals, group_rows)
        ctx.save_for_backward(kept, row_max, sum_exp, local, hit & valid, valid, totals[1])
        ctx.math, ctx.logits_dtype = math, logits.dtype
        return totals[0] / totals[1]

    @staticmethod
    def backward(ctx, grad):
        kept, row_max, sum_exp, local, onehot_rows, valid, count = ctx.saved_tensors
        g = ctx.math.grad(
            kept, row_max, sum_exp, local, onehot_rows, valid * (grad / count), ctx.logits_dtype
        )
        return g, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    grid: Grid | None = None,
    vocab_size: int | None = None,
    check_targets: bool = True,
    compiled: bool = False,
    deferred: DeferredTokenChecks | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over the cube's whole batch from y-layout logits and full targets.

    Args:
        logits: ``[b/(px·pz), ..., V/py]``, y-layout (vocab block ``j``).
        targets: ``[b, ...]`` token ids, the same on every cube rank, each in ``[0, vocab_size)``
            or ``ignore_index``; any other value raises ``ValueError`` (as ``F.cross_entropy``).
        vocab_size: the true vocabulary when the logits' ``V`` is padded (GPT3D's); defaults to ``V``.
        check_targets: False skips the range check (and its host sync): a target out of range
            then adds a wrong, finite loss.
        compiled: run the local passes over the logits through ``torch.compile`` (fused, no
            fp32 copy of the logits; :attr:`RuntimeOptions.compile`).
        deferred: the model's open :class:`~lightning_3d.runtime.DeferredTokenChecks`, which reads
            the targets' range check as the model's forward ends (default: read at once).

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
            f"expected [{b_local * grid.size(rows)}, {', '.join(map(str, logits.shape[1:-1]))}] (batch = "
            f"{b_local}·px·pz)"
        )
    padded = logits.shape[-1] * grid.size(layout.feature_axis)
    if check_targets:
        check_token_range(
            targets,
            padded if vocab_size is None else vocab_size,
            "vocab_parallel_cross_entropy",
            "target",
            ignore_index,
            deferred,
        )
    block = grid.rank_in(rows)
    targets = targets[block * b_local : (block + 1) * b_local]
    vocab_start = grid.coord(layout.feature_axis) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(
        logits,
        targets,
        vocab_start,
        ignore_index,
        grid.group(layout.feature_axis),
        grid.group(rows),
        _compiled() if compiled else _EAGER,
    )
