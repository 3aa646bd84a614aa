"""The load-balanced 3-D matrix multiplications (paper Alg. 1–6), for any px×py×pz grid.

Each form gathers A over one axis and B over another (both on dim 0, both in flight together),
multiplies the gathered blocks locally, and reduce-scatters the partial product C over the third
axis, on dim 0. The ``directions`` triple names those axes, as the paper does: ``(a, b, c)``.

==========  ==============  =====================  ====================  ================
form        local product   backward dA            backward dB           used by
==========  ==============  =====================  ====================  ================
``"ab"``    ``A @ B``       ``abt(dC, B)``         ``atb(A, dC)``        ``C = AB``
``"abt"``   ``A @ Bᵀ``      ``ab(dC, B)``          ``atb(dC, A)``        Linear3D
``"atb"``   ``Aᵀ @ B``      ``abt(B, dC)``         ``ab(A, dC)``         weight gradients
==========  ==============  =====================  ====================  ================

Backward all-gathers dC over the C axis, reduce-scatters dA over the A axis (overlapping the dB
product) and dB over the B axis. Since every operand was gathered on dim 0, every gradient lands
back in its operand's own layout, and the sums over the replicated dimension are done by the
reduce-scatters: no gradient needs any further reduction.

Example, Linear3D ``z → y`` with ``directions=("y", "x", "z")``: ``A`` ``[b/(px·py), s, N/pz]``
is gathered over y to ``[b/px, s, N/pz]``; ``W`` ``[K/(px·py), N/pz]`` over x to ``[K/py, N/pz]``;
``A @ Wᵀ`` ``[b/px, s, K/py]`` is reduce-scattered over z to ``[b/(px·pz), s, K/py]``: y-layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import comm
from ..grid import Grid, resolve_grid


def _mm(form: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Local product. ``a`` may carry leading dims; ``b`` is 2-D except in ``"atb"``."""
    if form == "ab":
        return torch.matmul(a, b)
    if form == "abt":
        return torch.matmul(a, b.t())
    return torch.matmul(a.reshape(-1, a.shape[-1]).t(), b.reshape(-1, b.shape[-1]))


# form -> ((form, operands) of dA, (form, operands) of dB); operands index (A, B, dC).
_BACKWARD = {
    "ab": (("abt", (2, 1)), ("atb", (0, 2))),
    "abt": (("ab", (2, 1)), ("atb", (2, 0))),
    "atb": (("abt", (1, 2)), ("ab", (0, 2))),
}


class MatmulPlan(NamedTuple):
    """What one 3-D matmul does: its form, its three groups, and whether it saves gathered operands."""

    form: str
    group_a: object
    group_b: object
    group_c: object
    save_gathered: bool


def _autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a matmul in on ``t``'s device, or None when autocast is off."""
    device = t.device.type
    if torch.is_autocast_enabled(device) and t.is_floating_point():
        return torch.get_autocast_dtype(device)
    return None


class _Matmul3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, plan: MatmulPlan) -> torch.Tensor:
        ctx.plan, ctx.dtypes = plan, (a.dtype, b.dtype)
        cast = _autocast_dtype(a)
        if cast is not None:  # communicate in the dtype autocast would multiply in
            a, b = a.to(cast), b.to(cast)
        a_full, wait_a = comm.all_gather_dim0(a, plan.group_a, async_op=True)
        b_full, wait_b = comm.all_gather_dim0(b, plan.group_b, async_op=True)
        wait_a.wait()
        wait_b.wait()
        c, _ = comm.reduce_scatter_dim0(_mm(plan.form, a_full, b_full), plan.group_c)
        ctx.save_for_backward(*((a_full, b_full) if plan.save_gathered else (a, b)))
        return c

    @staticmethod
    def backward(ctx, grad_c: torch.Tensor):
        plan = ctx.plan
        need_a, need_b = ctx.needs_input_grad[:2]
        a, b = ctx.saved_tensors
        dc_full, wait_c = comm.all_gather_dim0(grad_c, plan.group_c, async_op=True)
        wait_a = wait_b = comm.DONE
        if not plan.save_gathered:
            a, wait_a = comm.all_gather_dim0(a, plan.group_a, async_op=True)
            b, wait_b = comm.all_gather_dim0(b, plan.group_b, async_op=True)
        wait_c.wait()
        operands = [a, b, dc_full.to(a.dtype)]
        (form_a, (x_a, y_a)), (form_b, (x_b, y_b)) = _BACKWARD[plan.form]
        grad_a = grad_b = None
        wait_ga = comm.DONE
        if need_a:  # every dA product reads B, every dB product reads A
            wait_b.wait()
            grad_a, wait_ga = comm.reduce_scatter_dim0(_mm(form_a, operands[x_a], operands[y_a]), plan.group_a, async_op=True)
        if need_b:
            wait_a.wait()
            grad_b, _ = comm.reduce_scatter_dim0(_mm(form_b, operands[x_b], operands[y_b]), plan.group_b)
            grad_b = grad_b.to(ctx.dtypes[1])
        wait_ga.wait()
        if grad_a is not None:
            grad_a = grad_a.to(ctx.dtypes[0])
        return grad_a, grad_b, None


def _matmul(form: str, a, b, directions, grid, save_gathered) -> torch.Tensor:
    grid = resolve_grid(grid)
    ga, gb, gc = (grid.group(axis) for axis in directions)
    return _Matmul3D.apply(a, b, MatmulPlan(form, ga, gb, gc, save_gathered))


def matmul_ab(a, b, directions=("y", "x", "z"), grid: Grid | None = None, save_gathered: bool = True) -> torch.Tensor:
    """``C = A @ B``: gather A over ``directions[0]``, B over ``[1]``, reduce-scatter C over ``[2]``.

    ``a`` ``[m, ..., n]`` and ``b`` ``[n', k]`` are local blocks whose dim 0 is cut by the axis
    that gathers them; ``save_gathered=False`` re-gathers A and B in backward instead of keeping
    them (less memory, more communication).
    """
    return _matmul("ab", a, b, directions, grid, save_gathered)


def matmul_abt(a, b, directions=("y", "x", "z"), grid: Grid | None = None, save_gathered: bool = True) -> torch.Tensor:
    """``C = A @ Bᵀ`` with ``b`` ``[k', n]`` (the layout of an ``nn.Linear`` weight); see :func:`matmul_ab`."""
    return _matmul("abt", a, b, directions, grid, save_gathered)


def matmul_atb(a, b, directions=("z", "y", "x"), grid: Grid | None = None, save_gathered: bool = True) -> torch.Tensor:
    """``C = Aᵀ @ B`` with ``a`` ``[m', ..., n]``, ``b`` ``[m'', ..., k]`` → ``[n/|c|, k]``; see :func:`matmul_ab`."""
    return _matmul("atb", a, b, directions, grid, save_gathered)
