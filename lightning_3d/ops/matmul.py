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

Backward all-gathers dC over the C axis, reduce-scatters dA over the A axis and dB over the B
axis; the product whose reduce-scatter moves more bytes runs first, so that its communication
hides behind the other product. Since every operand was gathered on dim 0, every gradient lands
back in its operand's own layout, and the sums over the replicated dimension are done by the
reduce-scatters: no gradient needs any further reduction.

Example, Linear3D ``z → y`` with ``directions=("y", "x", "z")``: ``A`` ``[b/(px·py), s, N/pz]``
is gathered over y to ``[b/px, s, N/pz]``; ``W`` ``[K/(px·py), N/pz]`` over x to ``[K/py, N/pz]``;
``A @ Wᵀ`` ``[b/px, s, K/py]`` is reduce-scattered over z to ``[b/(px·pz), s, K/py]``: y-layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from . import async_tp
from ..grid import Grid, resolve_grid
from ..options import RuntimeOptions, resolve_options


def _mm(form: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Local product (plus ``bias``, ``"abt"`` only, inside the GEMM). ``a`` may carry leading
    dims; ``b`` is 2-D except in ``"atb"``."""
    if form == "ab":
        return torch.matmul(a, b)
    if form == "abt":
        return F.linear(a, b, bias)
    return torch.matmul(a.reshape(-1, a.shape[-1]).t(), b.reshape(-1, b.shape[-1]))


# form -> ((form, operands) of dA, (form, operands) of dB); operands index (A, B, dC).
_BACKWARD = {
    "ab": (("abt", (2, 1)), ("atb", (0, 2))),
    "abt": (("ab", (2, 1)), ("atb", (2, 0))),
    "atb": (("abt", (1, 2)), ("ab", (0, 2))),
}


class WeightPrefetch:
    """While active, starts the all-gather of the next weight as soon as the current one is gathered.

    Use it as a context manager around forward passes (``with prefetch: loss = model(x)``), or
    :meth:`attach` it to a model to enter it around every forward. The first forward
    records the order in which the 3-D products gather their operand B when it is a parameter
    (or a view of one); from then on, gathering weight k also starts the gather of weight k+1,
    so that its communication hides behind product k instead of delaying product k+1. A
    prefetched weight is used only while it is the same version of the same storage in the same
    dtype (an in-place change in between, as an optimizer step makes, discards it; a change
    through ``.data`` bumps no version and would go unseen). One is held at a time, costing one
    gathered weight of memory; results are bit-identical.
    """

    def __init__(self):
        self._order: list[tuple[torch.Tensor, object]] = []
        self._position: dict[tuple, int] = {}
        self._ahead: tuple | None = None  # (key, version, dtype, gathered, handle)
        self._outer: list[WeightPrefetch | None] = []

    def __enter__(self) -> WeightPrefetch:
        global _active_prefetch
        self._outer.append(_active_prefetch)
        _active_prefetch = self
        return self

    def __exit__(self, *exc) -> None:
        global _active_prefetch
        _active_prefetch = self._outer.pop()
        self._drop()

    def attach(self, module: torch.nn.Module) -> WeightPrefetch:
        """Be active during every forward of ``module`` (forward hooks); returns ``self``."""
        def enter(mod, args) -> None:
            self.__enter__()

        def leave(mod, args, out) -> None:
            self.__exit__()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return self

    def _drop(self) -> None:
        if self._ahead is not None:  # unused: let the stream finish with its buffer first
            self._ahead[4].wait()
            self._ahead = None

    def gather(self, w: torch.Tensor, group, dtype: torch.dtype | None):
        """``all_gather_dim0(w.to(dtype), group, async_op=True)``, served from the prefetch when it matches."""
        key = _storage_key(w)
        ahead = self._ahead
        if ahead is not None and ahead[:3] == (key, w._version, dtype):
            self._ahead = None
            gathered = ahead[3:]
        else:
            self._drop()
            gathered = comm.all_gather_dim0(_cast(w, dtype), group, async_op=True)
        if key not in self._position:
            self._position[key] = len(self._order)
            self._order.append((w, group))
        following = self._position[key] + 1
        if following < len(self._order):
            w_next, group_next = self._order[following]
            gathered_next = comm.all_gather_dim0(_cast(w_next, dtype), group_next, async_op=True)
            self._ahead = (_storage_key(w_next), w_next._version, dtype) + gathered_next
        return gathered


_active_prefetch: WeightPrefetch | None = None


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class MatmulPlan(NamedTuple):
    """What one 3-D matmul does: its form, its three groups, whether it saves gathered operands,
    the active :class:`WeightPrefetch` that gathers operand B (None: gather it here), and whether
    gathers and scatters next to a product run as collective matmuls (``RuntimeOptions.async_tp``)."""

    form: str
    group_a: object
    group_b: object
    group_c: object
    save_gathered: bool
    prefetch: WeightPrefetch | None = None
    async_tp: bool = False

    def fused(self, form: str, group) -> bool:
        """Whether the gather or scatter over ``group`` next to a product of ``form`` runs as a
        collective matmul (:mod:`~lightning_3d.ops.async_tp`)."""
        return self.async_tp and form in async_tp.FORMS and dist.get_world_size(group) > 1


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def _autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a matmul in on ``t``'s device, or None when autocast is off."""
    device = t.device.type
    if torch.is_autocast_enabled(device) and t.is_floating_point():
        return torch.get_autocast_dtype(device)
    return None


class _Matmul3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, plan: MatmulPlan) -> torch.Tensor:
        ctx.plan, ctx.dtypes = plan, (a.dtype, b.dtype, None if bias is None else bias.dtype)
        cast = _autocast_dtype(a)  # communicate in the dtype autocast would multiply in
        a, weight = _cast(a, cast), b
        fuse_gather = plan.fused(plan.form, plan.group_a)
        a_full, wait_a = (None, comm.DONE) if fuse_gather else comm.all_gather_dim0(a, plan.group_a, async_op=True)
        if plan.prefetch is None:
            b = _cast(b, cast)
            b_full, wait_b = comm.all_gather_dim0(b, plan.group_b, async_op=True)
        else:
            b_full, wait_b = plan.prefetch.gather(b, plan.group_b, cast)
        wait_a.wait()
        wait_b.wait()
        # the reduce-scatter sums over C's group: the bias joins the partial product of one rank
        bias = bias.to(b_full.dtype) if bias is not None and dist.get_rank(plan.group_c) == 0 else None
        if fuse_gather:
            a_full, c = async_tp.all_gather_matmul(plan.form, a, b_full, bias, plan.group_a)
            c, _ = comm.reduce_scatter_dim0(c, plan.group_c)
        else:
            c, _ = _product_scatter(plan, plan.form, a_full, b_full, bias, plan.group_c)
        # B gathered over a group of one is a cast copy of B: a parameter is kept alive anyway, so
        # backward casts it again (a fraction of a millisecond) instead of holding the copy
        ctx.recast_b = cast if _is_parameter(weight) and (not plan.save_gathered or dist.get_world_size(plan.group_b) == 1) else None
        saved_b = weight if ctx.recast_b is not None else b_full if plan.save_gathered else _cast(weight, cast)
        ctx.save_for_backward(a_full if plan.save_gathered else a, saved_b)
        return c

    @staticmethod
    def backward(ctx, grad_c: torch.Tensor):
        plan = ctx.plan
        a, b = ctx.saved_tensors
        if ctx.recast_b is not None:
            b = _cast(b, ctx.recast_b)
        # dA's first operand is dC in forms "ab" and "abt": its gather can be fused into dA's product
        form_a, (first_a, _) = _BACKWARD[plan.form][0]
        fuse_gather = ctx.needs_input_grad[0] and first_a == 2 and plan.fused(form_a, plan.group_c)
        dc_full, wait_c = (None, comm.DONE) if fuse_gather else comm.all_gather_dim0(grad_c, plan.group_c, async_op=True)
        waits = [comm.DONE, comm.DONE]
        if not plan.save_gathered:
            a, waits[0] = comm.all_gather_dim0(a, plan.group_a, async_op=True)
            b, waits[1] = comm.all_gather_dim0(b, plan.group_b, async_op=True)
        wait_c.wait()
        operands = [a, b, None if fuse_gather else dc_full.to(a.dtype)]
        groups = (plan.group_a, plan.group_b)
        # the reduce-scatter of gradient k sends (|group_k| - 1)/|group_k| of its product: run the
        # larger first; a fused gather of dC runs first, since the other product reads dC
        moved = [a.numel() * (dist.get_world_size(groups[0]) - 1) if ctx.needs_input_grad[0] else -1,
                 b.numel() * (dist.get_world_size(groups[1]) - 1) if ctx.needs_input_grad[1] else -1]
        if fuse_gather:
            moved[0] = float("inf")
        grads, scatters = [None, None], []
        for k in sorted((k for k in (0, 1) if moved[k] >= 0), key=lambda k: -moved[k]):
            form, (x, y) = _BACKWARD[plan.form][k]
            waits[1 - k].wait()  # dA reads B, dB reads A
            if k == 0 and fuse_gather:
                operands[2], product = async_tp.all_gather_matmul(form, grad_c.to(a.dtype), operands[y], None, plan.group_c)
                grads[0], done = comm.reduce_scatter_dim0(product, groups[0], async_op=True)
            else:
                grads[k], done = _product_scatter(plan, form, operands[x], operands[y], None, groups[k], async_op=True)
            scatters.append(done)
        dc_full = operands[2]  # the bias's gradient sums C's whole group: dC as gathered over it
        grad_bias = dc_full.sum(tuple(range(dc_full.dim() - 1))) if ctx.needs_input_grad[2] else None
        for done in scatters:
            done.wait()
        return tuple(None if g is None else g.to(dtype) for g, dtype in zip(grads + [grad_bias], ctx.dtypes)) + (None,)


def _product_scatter(plan: MatmulPlan, form: str, a, b, bias, group, async_op: bool = False):
    """``reduce_scatter_dim0(a ⊗ b + bias, group)`` and its handle; a collective matmul (done on
    return) when the plan fuses it."""
    if plan.fused(form, group):
        return async_tp.matmul_reduce_scatter(form, a, b, bias, group), comm.DONE
    return comm.reduce_scatter_dim0(_mm(form, a, b, bias), group, async_op=async_op)


def _matmul(form: str, a, b, directions, grid, options, bias=None) -> torch.Tensor:
    grid, options = resolve_grid(grid), resolve_options(options)
    if grid.cube_size == 1:  # nothing to gather or scatter: the plain product, under plain autograd
        return _mm(form, a, b, bias)
    ga, gb, gc = (grid.group(axis) for axis in directions)
    prefetch = _active_prefetch if _is_parameter(b) else None
    return _Matmul3D.apply(a, b, bias, MatmulPlan(form, ga, gb, gc, options.save_gathered, prefetch, options.async_tp))


def matmul_ab(a, b, directions=("y", "x", "z"), grid: Grid | None = None, options: RuntimeOptions | None = None) -> torch.Tensor:
    """``C = A @ B``: gather A over ``directions[0]``, B over ``[1]``, reduce-scatter C over ``[2]``.

    ``a`` ``[m, ..., n]`` and ``b`` ``[n', k]`` are local blocks whose dim 0 is cut by the axis
    that gathers them. ``options`` (default :class:`~lightning_3d.options.RuntimeOptions`):
    ``save_gathered=False`` re-gathers A and B in backward instead of keeping them (less memory,
    more communication); ``async_tp`` runs the gathers and scatters next to the product as
    collective matmuls. Inside an active :class:`WeightPrefetch`, a parameter B is gathered one
    product ahead.
    """
    return _matmul("ab", a, b, directions, grid, options)


def matmul_abt(a, b, directions=("y", "x", "z"), grid: Grid | None = None, options: RuntimeOptions | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``C = A @ Bᵀ (+ bias)`` with ``b`` ``[k', n]`` (the layout of an ``nn.Linear`` weight); see :func:`matmul_ab`.

    ``bias`` ``[k]`` (C's local last dim) is added inside the GEMM of one rank of C's group,
    before the reduce-scatter, so it is counted once and costs no extra pass over C. Its
    gradient, on every rank of C's group, is the sum of ``dC`` over the rows of the whole group
    (the gathered ``dC`` of backward): the caller sums it over the bias's other replicas only
    (``use_replicated(bias, grid, grad_summed_over=directions[2])``).
    """
    return _matmul("abt", a, b, directions, grid, options, bias)


def matmul_atb(a, b, directions=("z", "y", "x"), grid: Grid | None = None, options: RuntimeOptions | None = None) -> torch.Tensor:
    """``C = Aᵀ @ B`` with ``a`` ``[m', ..., n]``, ``b`` ``[m'', ..., k]`` → ``[n/|c|, k]``; see :func:`matmul_ab`."""
    return _matmul("atb", a, b, directions, grid, options)
