"""Vocabulary-parallel embedding lookup: full token ids in, z-layout activation out.

The weight ``[V, h]`` lies as a z→y Linear3D weight: local ``[V/(px·py), h/pz]``, vocab block
``(j, i)``. Forward all-gathers it over x (vocab block ``j`` of ``V/py`` rows), looks up the ids of
batch block ``i`` that fall in that vocab block (zero for the others), and reduce-scatters over y
on the batch dim: rank ``(i, j, l)`` ends with batch block ``(i, j)``, features ``l``.
Backward mirrors it: all-gather dY over y, scatter-add into the vocab block, reduce-scatter over x
(under autocast in its dtype, as the 3-D products reduce their weights' gradients).
With ``padding_idx``, lookups of that id pass no gradient to its row, as in ``nn.Embedding``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from .matmul import autocast_dtype


class _VocabParallelEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, vocab_start, group_x, group_y, padding_idx):
        w_block, _ = comm.all_gather_dim0(weight, group_x)  # [V/py, h/pz]
        local = ids - vocab_start
        hit = (local >= 0) & (local < w_block.shape[0])
        local = torch.where(hit, local, torch.zeros_like(local))
        out = torch.nn.functional.embedding(local, w_block) * hit.unsqueeze(-1).to(w_block.dtype)
        learns = (
            hit if padding_idx is None else hit & (ids != padding_idx)
        )  # the lookups that pass a gradient
        ctx.save_for_backward(local, learns)
        ctx.weight_shape, ctx.group_x, ctx.group_y = w_block.shape, group_x, group_y
        ctx.reduce_dtype = autocast_dtype(weight) or weight.dtype
        out, _ = comm.reduce_scatter_dim0(out, group_y)
        return out

    @staticmethod
    def backward(ctx, grad):
        local, learns = ctx.saved_tensors
        grad_full, _ = comm.all_gather_dim0(grad, ctx.group_y)  # [b/px, s, h/pz]
        grad_full = grad_full * learns.unsqueeze(-1).to(grad_full.dtype)
        w_grad = grad_full.new_zeros(ctx.weight_shape)
        w_grad.index_add_(0, local.reshape(-1), grad_full.reshape(-1, grad_full.shape[-1]))
        if dist.get_world_size(ctx.group_x) > 1:  # reduced in the products' dtype; kept whole on one rank
            w_grad, _ = comm.reduce_scatter_dim0(w_grad.to(ctx.reduce_dtype), ctx.group_x)
        return None, w_grad.to(grad_full.dtype), None, None, None, None


def vocab_parallel_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    vocab_start: int,
    group_x,
    group_y,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """Look up ``ids`` ``[b/px, s]`` (this x block's sequences) in the sharded ``weight``.

    ``vocab_start`` is the first token id of this rank's y vocab block (``j · V/py``); lookups of
    ``padding_idx`` (a global token id) pass no gradient to the weight.
    Returns ``[b/(px·py), s, h/pz]`` in z-layout.
    """
    return _VocabParallelEmbedding.apply(ids, weight, vocab_start, group_x, group_y, padding_idx)
