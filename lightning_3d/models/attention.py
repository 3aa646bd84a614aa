"""The attention core both models share: RoPE and causal SDPA over whole local sequences.

:class:`DenseGPT` calls it on all heads; :class:`GPT3D` on the heads of its y block. Where the rows
are whole sequences attention needs no communication; token rows attend with
:meth:`lightning_3d.token_rows.TokenRows.attend` instead, and rotate each row by its own positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.packed_elementwise import rotate


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device=None, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[seq_len, head_dim]``, for the rotate-half RoPE convention (Llama / HF)."""
    dtype = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=dtype), inv_freq)
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate ``x`` ``[b, s, ..., head_dim]`` by position, each head on its own.

    ``rope``: ``(cos, sin)``, each ``[≥ s, n]`` (positions along dim 1, the same in every row) or
    ``[b, s, n]`` (each row's own positions: token rows). With ``n < head_dim`` (partial rotary, as
    in GPT-NeoX) only the first ``n`` features of each head turn; the others pass unchanged.
    """
    n = rope[0].shape[-1]
    if rope[0].dim() == 2:
        cos, sin = (t[: x.shape[1]].view(x.shape[1], *[1] * (x.dim() - 3), -1).to(x.dtype) for t in rope)
    else:
        cos, sin = (t.view(*t.shape[:2], *[1] * (x.dim() - 3), -1).to(x.dtype) for t in rope)
    if n == x.shape[-1]:
        return rotate(x, cos, sin)
    return torch.cat([rotate(x[..., :n], cos, sin), x[..., n:]], -1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of ``q`` ``[b, s, heads, head_dim]`` and ``k, v`` ``[b, s, kv_heads, head_dim]``
    → ``[b, s, heads·head_dim]``. With fewer key/value heads (grouped-query attention), query head
    ``i`` attends with key/value head ``i // (heads / kv_heads)``."""
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        enable_gqa=q.shape[-2] != k.shape[-2],
    )
    return y.transpose(1, 2).flatten(-2)
