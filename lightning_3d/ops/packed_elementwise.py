"""SwiGLU and RoPE read from a packed product's output, with a backward that writes the packed gradient.

A fused product (gate and up; q, k and v) leaves its groups in one tensor, and the work after it
reads each group as a view. Autograd then assembles the product's gradient ``dC`` by concatenating
the groups' gradients, which Inductor (torch 2.11) lowers as a pointwise concatenation: each
element of ``dC`` computes and loads what either group needs, about twice the time of separate
kernels per group. Here the backward writes ``dC`` directly: one Triton kernel on CUDA
(:mod:`~lightning_3d.ops.packed_kernels`, where Triton is installed), the same arithmetic in
PyTorch elsewhere.

Layouts (``P`` blocks per group, as :meth:`~lightning_3d.layers.FusedLinear3D.forward_groups` and
a dense ``nn.Linear`` leave them, ``P = 1``):

- SwiGLU: ``gate_up [..., P, 2, n]`` → ``silu(gate) · up [..., P, n]``.
- RoPE: ``qkv [b, s, P, r + 2, T, d]`` (``r`` query slots, then k and v; ``T`` key/value heads per
  block) → ``q [b, s, P·T·r, d]`` (head ``(p, t, g)`` at ``(p·T + t)·r + g``), ``k, v [b, s, P·T, d]``,
  q and k rotated by position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from . import packed_kernels
except ImportError:  # no Triton: the PyTorch backward everywhere
    packed_kernels = None


def _on_kernel_device(*tensors: torch.Tensor) -> bool:
    return packed_kernels is not None and all(t.is_cuda for t in tensors)


class _PackedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.unbind(-2)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        if _on_kernel_device(gate_up, grad):
            return packed_kernels.swiglu_backward(gate_up, grad)
        gate, up = gate_up.unbind(-2)
        sig = torch.sigmoid(gate)
        return torch.stack([grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig], -2)


def packed_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of ``gate_up [..., 2, n]`` → ``[..., n]``; its gradient one ``[..., 2, n]`` tensor."""
    if gate_up.shape[-2] != 2:
        raise ValueError(f"packed_swiglu takes [..., 2, n] (gate, up); got shape {tuple(gate_up.shape)}")
    return _PackedSwiGLU.apply(gate_up)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [..., d]`` by ``cos, sin`` broadcast to it; ``rotate(x, cos, -sin)`` undoes it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _tables(
    rope: tuple[torch.Tensor, torch.Tensor], seq: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[s, 1, 1, 1, d]``: broadcast over ``[b, s, P, ·, ·, d]``."""
    return tuple(t[:seq].to(dtype).view(seq, 1, 1, 1, -1) for t in rope)


class _PackedRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int):
        ctx.save_for_backward(cos, sin)
        ctx.r, ctx.blocks = r, (qkv.shape[2], qkv.shape[4])
        c, s = _tables((cos, sin), qkv.shape[1], qkv.dtype)
        q, k, v = qkv.split([r, 1, 1], 3)
        q, k = (
            rotate(q.transpose(3, 4), c, s),
            rotate(k, c, s),
        )  # q [b, s, P, T, r, d]: attention's head order
        return tuple(t.flatten(2, 4) for t in (q, k, v.clone(memory_format=torch.contiguous_format)))

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        r, blocks = ctx.r, ctx.blocks
        if _on_kernel_device(dq, dk, dv, cos):
            return packed_kernels.rope_backward(dq, dk, dv, cos, sin, r, blocks), None, None, None
        c, s = _tables((cos, sin), dq.shape[1], dq.dtype)
        dq = rotate(dq.unflatten(2, (*blocks, r)), c, -s).transpose(3, 4)  # [b, s, P, r, T, d]
        dk = rotate(dk.unflatten(2, blocks).unsqueeze(3), c, -s)
        return torch.cat([dq, dk, dv.unflatten(2, blocks).unsqueeze(3)], 3), None, None, None


def packed_rope(
    qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], queries_per_kv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE of the q and k in ``qkv [b, s, P, r + 2, T, d]`` → ``q [b, s, P·T·r, d]``, ``k, v [b, s, P·T, d]``
    (contiguous), with ``rope = (cos, sin)``, each ``[≥ s, d]`` with equal halves (the rotate-half
    convention, as :func:`~lightning_3d.models.attention.rope_tables` makes them); the gradient one
    tensor of ``qkv``'s shape."""
    if qkv.dim() != 6 or qkv.shape[3] != queries_per_kv + 2:
        raise ValueError(
            f"packed_rope takes [b, s, P, {queries_per_kv} + 2, T, d]; got shape {tuple(qkv.shape)}"
        )
    return _PackedRoPE.apply(qkv, *rope, queries_per_kv)
