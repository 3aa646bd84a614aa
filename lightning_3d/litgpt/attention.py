"""LitGPT's causal self-attention on the grid: the heads of this rank's y block.

LitGPT's ``CausalSelfAttention`` reads its sizes from the model's config (all heads) and the batch
from its input; on the grid its projection's output holds ``n_head/py`` query heads of
``b/(px·pz)`` rows while its input is z-layout. :class:`GridSelfAttention` takes its place in each
block (the plan's ``prepare``), holding the same ``qkv`` and ``proj`` modules under the same keys,
and computes what LitGPT's computes on whatever heads and rows it is given.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.dense import packed_attention


class GridSelfAttention(nn.Module):
    """LitGPT's attention over the heads of this rank: partial rotary, grouped queries, causal SDPA.

    ``qkv``: a z→y :class:`~lightning_3d.layers.FusedLinear3D` of ``queries_per_kv + 2`` groups
    (query slots, k, v; :class:`~lightning_3d.litgpt.plan.QueryGroupedQKV`); ``proj``: the y→z
    output projection. ``forward(x, cos, sin, ...)`` has LitGPT's signature: ``x`` z-layout
    ``[b/(px·py), s, h/pz]``, ``cos``, ``sin`` ``[1, s, rope_n_elem]`` (the first ``rope_n_elem``
    features of every head turn); returns z-layout ``[b/(px·py), s, h/pz]``. On token rows ``x`` is
    ``[b·C/(px·py), s/C, h/pz]``, the tables each y row's own ``[b·C/(px·pz), s/C, rope_n_elem]``
    and the causal SDPA call runs over the split sequences (the plan's
    :class:`~lightning_3d.parallel.Attention` entry).
    """

    def __init__(self, qkv: nn.Module, proj: nn.Module, queries_per_kv: int, head_size: int):
        super().__init__()
        self.qkv, self.proj = qkv, proj
        self.queries_per_kv, self.head_size = queries_per_kv, head_size

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        input_pos_maxp1: int | None = None,
    ) -> torch.Tensor:
        if mask is not None or input_pos is not None:
            raise ValueError("the parallelized LitGPT model keeps no KV cache: call it without input_pos")
        # [1, s, n]: the same positions in every row (one table); [rows, s/C, n]: each row its own
        rope = None if not cos.shape[-1] else (cos[0], sin[0]) if cos.shape[0] == 1 else (cos, sin)
        return self.proj(packed_attention(self.qkv, x, self.queries_per_kv, self.head_size, rope))

    def build_kv_cache(self, *args, **kwargs):
        raise ValueError(
            "the parallelized LitGPT model keeps no KV cache (GPT.set_kv_cache): generate with the "
            "unparallelized model, loaded from lightning_3d.dense_state_dict(model)"
        )
