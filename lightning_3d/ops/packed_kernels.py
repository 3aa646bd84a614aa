"""Triton kernels for :mod:`~lightning_3d.ops.packed_elementwise`'s backward on CUDA: each writes a
packed product's gradient ``dC`` in one pass, every element once. Importing this module needs
Triton; the arithmetic is the PyTorch backward's there, in float32, stored in ``dC``'s dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SWIGLU_BLOCK = 1024


@triton.jit
def _swiglu_backward_kernel(gate_up, grad, out, n, BLOCK: tl.constexpr):
    """One program: ``BLOCK`` columns of one row; ``gate_up, out [rows, 2, n]``, ``grad [rows, n]``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up + row * 2 * n + cols, mask=mask).to(tl.float32)
    up = tl.load(gate_up + row * 2 * n + n + cols, mask=mask).to(tl.float32)
    g = tl.load(grad + row * n + cols, mask=mask).to(tl.float32)
    sig = tl.sigmoid(gate)
    tl.store(
        out + row * 2 * n + cols, (g * up * sig * (1 + gate * (1 - sig))).to(out.dtype.element_ty), mask=mask
    )
    tl.store(out + row * 2 * n + n + cols, (g * gate * sig).to(out.dtype.element_ty), mask=mask)


def swiglu_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``d gate_up [..., 2, n]`` of ``silu(gate) · up`` from ``grad [..., n]``."""
    gate_up, grad = gate_up.contiguous(), grad.contiguous()
    n = gate_up.shape[-1]
    out = torch.empty_like(gate_up)
    _swiglu_backward_kernel[(grad.numel() // n, triton.cdiv(n, SWIGLU_BLOCK))](
        gate_up, grad, out, n, BLOCK=SWIGLU_BLOCK
    )
    return out


@triton.jit
def _rope_backward_kernel(
    dq,
    dk,
    dv,
    cos,
    sin,
    out,
    seq,
    blocks,
    q_sb,
    q_ss,
    q_sh,
    k_sb,
    k_ss,
    k_sh,
    v_sb,
    v_ss,
    v_sh,
    table_s,
    R: tl.constexpr,
    T: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One program: the ``(R + 2)·T`` rows of ``d`` of one ``(b, s, p)`` of ``out [b, s, P, R + 2, T, D]``,
    each the un-rotated gradient of its q or k head (``dq [b, s, (p·T + t)·R + g, D]``,
    ``dk [b, s, p·T + t, D]``) or ``dv``'s as it is."""
    pid = tl.program_id(0).to(tl.int64)
    p, s, b = pid % blocks, pid // blocks % seq, pid // blocks // seq
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, DP)[None, :]
    slot, t = rows // T, rows % T
    inside = (rows < (R + 2) * T) & (cols < D)
    is_q, is_k, is_v = inside & (slot < R), inside & (slot == R), inside & (slot == R + 1)
    q = dq + b * q_sb + s * q_ss + ((p * T + t) * R + slot) * q_sh
    k = dk + b * k_sb + s * k_ss + (p * T + t) * k_sh
    v = dv + b * v_sb + s * v_ss + (p * T + t) * v_sh
    partner = tl.where(cols < D // 2, cols + D // 2, cols - D // 2)
    g = (
        tl.load(q + cols, mask=is_q, other=0.0).to(tl.float32)
        + tl.load(k + cols, mask=is_k, other=0.0).to(tl.float32)
        + tl.load(v + cols, mask=is_v, other=0.0).to(tl.float32)
    )
    g_partner = tl.load(q + partner, mask=is_q, other=0.0).to(tl.float32) + tl.load(
        k + partner, mask=is_k, other=0.0
    ).to(tl.float32)
    dtype = out.dtype.element_ty
    c = tl.load(cos + s * table_s + cols, mask=cols < D, other=0.0).to(dtype).to(tl.float32)
    sn = tl.load(sin + s * table_s + cols, mask=cols < D, other=0.0).to(dtype).to(tl.float32)
    unrotated = g * c + tl.where(cols < D // 2, g_partner, -g_partner) * sn
    tl.store(
        out + pid * (R + 2) * T * D + rows * D + cols, tl.where(is_v, g, unrotated).to(dtype), mask=inside
    )


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rope_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    r: int,
    blocks: tuple[int, int],
) -> torch.Tensor:
    """``d qkv [b, s, P, r + 2, T, d]`` from ``dq [b, s, P·T·r, d]``, ``dk, dv [b, s, P·T, d]`` and the
    tables ``cos, sin [≥ s, d]`` (rotate-half, equal halves); ``blocks = (P, T)``."""
    dq, dk, dv = (x if x.stride(-1) == 1 else x.contiguous() for x in (dq, dk, dv))
    cos, sin = cos.contiguous(), sin.contiguous()
    (p, t), (b, seq, _, d) = blocks, dk.shape
    out = torch.empty((b, seq, p, r + 2, t, d), dtype=dq.dtype, device=dq.device)
    _rope_backward_kernel[(b * seq * p,)](
        dq,
        dk,
        dv,
        cos,
        sin,
        out,
        seq,
        p,
        *dq.stride()[:3],
        *dk.stride()[:3],
        *dv.stride()[:3],
        cos.stride(0),
        R=r,
        T=t,
        D=d,
        DP=_next_power_of_2(d),
        ROWS=_next_power_of_2((r + 2) * t),
    )
    return out
