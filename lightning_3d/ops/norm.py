"""Normalisation over features split across one grid axis (LayerNorm and RMSNorm statistics).

Statistics run in at least fp32 (float64 stays float64): one all-reduce of the row sums in
forward for RMSNorm, two for LayerNorm (mean, then centred squares, which stays exact), and one
in backward for either.
"""

from __future__ import annotations

import torch

from .. import comm


def _stats_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _row_sum(t: torch.Tensor, group) -> torch.Tensor:
    return comm.all_reduce(t.sum(-1, keepdim=True), group)[0]


class _Normalize(torch.autograd.Function):
    """``x̂ = (x − mean) / sqrt(var + eps)`` (``center``) or ``x / sqrt(mean(x²) + eps)``."""

    @staticmethod
    def forward(ctx, x, features, eps, center, group):
        xs = x.to(_stats_dtype(x))
        if center:
            xs = xs - _row_sum(xs, group) / features
        rstd = torch.rsqrt(_row_sum(xs * xs, group) / features + eps)
        x_hat = xs * rstd
        ctx.save_for_backward(x_hat, rstd)
        ctx.features, ctx.center, ctx.group = features, center, group
        # x_hat itself where the dtypes agree: on torch 2.11 a compiled forward that returns a no-op
        # cast of a tensor it saved gives its input a zero gradient
        return x_hat if x_hat.dtype == x.dtype else x_hat.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x_hat, rstd = ctx.saved_tensors
        g = grad.to(x_hat.dtype)
        sums = [g * x_hat] + ([g] if ctx.center else [])
        stats = torch.cat([s.sum(-1, keepdim=True) for s in sums], -1)
        stats = comm.all_reduce(stats, ctx.group)[0] / ctx.features
        dx = g - x_hat * stats[..., :1]
        if ctx.center:
            dx = dx - stats[..., 1:]
        return (dx * rstd).to(grad.dtype), None, None, None, None


def normalize(x: torch.Tensor, features: int, eps: float, center: bool, group) -> torch.Tensor:
    """Normalise ``x`` ``[..., features/|group|]`` over its last dim, whose blocks span ``group``."""
    return _Normalize.apply(x, features, eps, center, group)
