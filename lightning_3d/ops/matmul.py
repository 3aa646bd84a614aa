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

A product runs with its model's :class:`~lightning_3d.runtime.Runtime`, passed by the layer that
calls it: its options, the weight prefetch that gathers B, and the weight gradients left for the
end of backward (or for a zero-bubble pipeline schedule's weight pass). :func:`_matmul` fixes
how the product runs in a :class:`~lightning_3d.runtime.MatmulSchedule`. Eagerly a product is
one autograd function (:class:`_Matmul3D`); under ``torch.compile`` the same forward and backward
run as the custom ops ``lightning_3d::matmul3d`` and ``lightning_3d::matmul3d_backward``, opaque
nodes of the compiled graph, which take the schedule as typed arguments and the runtime by name.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..grid import Grid, resolve_grid
from ..options import RuntimeOptions
from ..runtime import MatmulSchedule, Runtime, WeightGradsAtEnd, runtime_named
from . import async_tp


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


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def _fused(schedule: MatmulSchedule, form: str, k: int) -> bool:
    """Whether the gather or scatter over group ``k`` (0: A's, 1: B's, 2: C's) next to a product of
    ``form`` runs as a collective matmul (:mod:`~lightning_3d.ops.async_tp`)."""
    return schedule.async_tp and form in async_tp.FORMS and schedule.sizes[k] > 1


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a matmul in on ``t``'s device, or None when autocast is off."""
    device = t.device.type
    if torch.is_autocast_enabled(device) and t.is_floating_point():
        return torch.get_autocast_dtype(device)
    return None


def _prefetched(schedule: MatmulSchedule, runtime: Runtime, forward: bool):
    """The gather of B through the model's prefetch (forward's, or backward's re-gather), or None."""
    if not schedule.b_is_parameter or runtime.prefetch is None:
        return None
    return runtime.prefetch.gather_in(forward)


def _forward(
    schedule: MatmulSchedule, runtime: Runtime, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None
):
    """``(C, A kept for backward, B kept for backward)``. Gathers A and B together (B through the
    model's prefetch when it is a parameter), multiplies, reduce-scatters C; the bias joins the
    partial product of one rank of C's group, since the reduce-scatter sums over that group.
    A comes in the product's dtype already (:func:`_matmul` casts it)."""
    group_a, _, group_c = schedule.groups
    fuse_gather = _fused(schedule, schedule.form, 0)
    a_full, wait_a = (None, comm.DONE) if fuse_gather else comm.all_gather_dim0(a, group_a, async_op=True)
    b_full, wait_b = _gather_b(schedule, b, _prefetched(schedule, runtime, forward=True))
    wait_a.wait()
    wait_b.wait()
    bias = bias.to(b_full.dtype) if bias is not None and dist.get_rank(group_c) == 0 else None
    if fuse_gather:
        a_full, c = async_tp.all_gather_matmul(schedule.form, a, b_full, bias, group_a)
        c, _ = comm.reduce_scatter_dim0(c, group_c)
    else:
        c, _ = _product_scatter(schedule, schedule.form, a_full, b_full, bias, 2)
    kept_b = b if schedule.recasts_b else b_full if schedule.save_gathered else _cast(b, schedule.cast)
    return c, a_full if schedule.save_gathered else a, kept_b


def _backward(
    schedule: MatmulSchedule,
    runtime: Runtime,
    grad_c: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    needs: tuple[bool, bool, bool],
    weight: torch.Tensor | None = None,
    deferrable: bool = False,
):
    """``(dA, dB, dbias)`` in the layouts of A, B and the bias (None where ``needs`` is false),
    from A and B as :func:`_forward` kept them. Gradients come in the dtype products run in.
    With ``schedule.grads_at_end``, dB is left for ``weight``'s node (the model's
    :meth:`~lightning_3d.runtime.WeightGradsAtEnd.scatter_at_end`) and None; ``deferrable`` (the
    eager product: its operands stay its own), its product may be deferred to a zero-bubble
    schedule's weight pass instead (:meth:`~lightning_3d.runtime.WeightGradsAtEnd.weight_gradient`).
    A compiled product's backward makes it at once: the compiler may reuse its operands' memory
    once the op returns."""
    group_a, _, group_c = schedule.groups
    # dA's first operand is dC in forms "ab" and "abt": its gather can be fused into dA's product
    form_a, (first_a, _) = _BACKWARD[schedule.form][0]
    fuse_gather = needs[0] and first_a == 2 and _fused(schedule, form_a, 2)
    dc_full, wait_c = (
        (None, comm.DONE) if fuse_gather else comm.all_gather_dim0(grad_c, group_c, async_op=True)
    )
    waits = [comm.DONE, comm.DONE]
    if schedule.save_gathered:
        b = _cast(b, schedule.cast)  # a no-op unless B is kept as the parameter
    else:
        a, waits[0] = comm.all_gather_dim0(a, group_a, async_op=True)
        b, waits[1] = _gather_b(schedule, b, _prefetched(schedule, runtime, forward=False))
    wait_c.wait()
    operands = [a, b, None if fuse_gather else dc_full.to(a.dtype)]
    # the reduce-scatter of gradient k sends (|group_k| - 1)/|group_k| of its product: run the
    # larger first; a fused gather of dC runs first, since the other product reads dC
    moved = [
        a.numel() * (schedule.sizes[0] - 1) if needs[0] else -1,
        b.numel() * (schedule.sizes[1] - 1) if needs[1] else -1,
    ]
    if fuse_gather:
        moved[0] = float("inf")
    grads, scatters = [None, None], []
    for k in sorted((k for k in (0, 1) if moved[k] >= 0), key=lambda k: -moved[k]):
        form, (x, y) = _BACKWARD[schedule.form][k]
        waits[1 - k].wait()  # dA reads B, dB reads A
        if k == 0 and fuse_gather:
            operands[2], product = async_tp.all_gather_matmul(
                form, grad_c.to(a.dtype), operands[y], None, group_c
            )
            grads[0], done = comm.reduce_scatter_dim0(product, group_a, async_op=True)
        elif k == 1 and schedule.grads_at_end:
            product = functools.partial(_mm, form, operands[x], operands[y])
            late = runtime.late_grads
            if deferrable:
                late.weight_gradient(product, schedule.groups[1], weight, schedule.grads_together)
            else:
                late.scatter_at_end(product(), schedule.groups[1], weight, schedule.grads_together)
            continue
        else:
            grads[k], done = _product_scatter(
                schedule, form, operands[x], operands[y], None, k, async_op=True
            )
        scatters.append(done)
    dc_full = operands[2]  # the bias's gradient sums C's whole group: dC as gathered over it
    grad_bias = dc_full.sum(tuple(range(dc_full.dim() - 1))) if needs[2] else None
    for done in scatters:
        done.wait()
    return grads[0], grads[1], grad_bias


def _gather_b(schedule: MatmulSchedule, b: torch.Tensor, prefetched) -> tuple:
    """B cast to the product's dtype and all-gathered over its group, asynchronously: through
    ``prefetched`` (a :class:`~lightning_3d.runtime.WeightPrefetch`'s ``gather`` or ``regather``) when given."""
    if prefetched is None:
        return comm.all_gather_dim0(_cast(b, schedule.cast), schedule.groups[1], async_op=True)
    return prefetched(b, schedule.groups[1], schedule.cast)


def _product_scatter(schedule: MatmulSchedule, form: str, a, b, bias, k: int, async_op: bool = False):
    """``reduce_scatter_dim0(a ⊗ b + bias, group k)`` and its handle; a collective matmul (done on
    return) when the schedule fuses it."""
    group = schedule.groups[k]
    if _fused(schedule, form, k):
        return async_tp.matmul_reduce_scatter(form, a, b, bias, group), comm.DONE
    return comm.reduce_scatter_dim0(_mm(form, a, b, bias), group, async_op=async_op)


def _as_dtypes(grads, dtypes) -> tuple:
    return tuple(None if g is None else g.to(dtype) for g, dtype in zip(grads, dtypes))


class _Matmul3D(torch.autograd.Function):
    """The eager 3-D product: :func:`_forward` and :func:`_backward` under autograd."""

    @staticmethod
    def forward(
        ctx,
        a: torch.Tensor,
        b: torch.Tensor,
        bias: torch.Tensor | None,
        schedule: MatmulSchedule,
        runtime: Runtime,
    ) -> torch.Tensor:
        ctx.schedule, ctx.runtime = schedule, runtime
        ctx.dtypes = (a.dtype, b.dtype, None if bias is None else bias.dtype)
        c, kept_a, kept_b = _forward(schedule, runtime, a, b, bias)
        ctx.save_for_backward(kept_a, kept_b, b if schedule.b_is_parameter else None)  # see _setup_context
        return c

    @staticmethod
    def backward(ctx, grad_c: torch.Tensor):
        kept_a, kept_b, weight = ctx.saved_tensors  # unpacked once: checkpointing allows no second time
        needs = ctx.needs_input_grad[:3]
        grads = _backward(ctx.schedule, ctx.runtime, grad_c, kept_a, kept_b, needs, weight, deferrable=True)
        return _as_dtypes(grads, ctx.dtypes) + (None, None)


# Under torch.compile the same product runs as two custom ops (forward, backward), which the
# compiler keeps whole while it fuses the work around them. Ops take groups by name, return no
# None and alias no input: what the forward keeps of A or B unchanged is an empty tensor there,
# and the autograd context keeps the input instead. Each op takes the schedule as typed arguments
# (_SCHEDULE) and the model's runtime by name. They are defined on a Library (torch.library.custom_op
# adds checks and wrappers to every call, which the host pays twice per product and step). The
# backward op has no derivative of its own: there is no double backward.

_SCHEDULE = (
    "str form, str[] groups, int[] sizes, bool save_gathered, ScalarType? cast, bool b_is_parameter, "
    "bool grads_at_end, int grads_together, bool async_tp, str runtime"
)
_LIBRARY = torch.library.Library("lightning_3d", "FRAGMENT")
_LIBRARY.define(f"matmul3d(Tensor a, Tensor b, Tensor? bias, {_SCHEDULE}) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(f"gathered_weight(Tensor b, {_SCHEDULE}) -> Tensor")
_LIBRARY.define(
    f"gathered_product_backward(Tensor grad_c, Tensor a, Tensor b_full, Tensor weight, bool need_b, {_SCHEDULE}) "
    "-> (Tensor, Tensor)"
)
_LIBRARY.define(
    "matmul3d_backward(Tensor grad_c, Tensor kept_a, Tensor kept_b, Tensor weight, SymInt[] shapes, "
    f"ScalarType dtype_a, ScalarType dtype_b, ScalarType dtype_bias, bool[] needs, {_SCHEDULE}) "
    "-> (Tensor, Tensor, Tensor)"
)


def _op_args(schedule: MatmulSchedule, runtime: Runtime) -> tuple:
    """The schedule and the runtime as the custom ops take them (``_SCHEDULE``): groups by name."""
    form, groups, sizes, *rest = schedule
    return (form, [group.group_name for group in groups], list(sizes), *rest, runtime.name)


def _schedule_of(form: str, groups: list, sizes: list, *rest, resolve: bool = True) -> MatmulSchedule:
    """The schedule of :func:`_op_args` (less the runtime); its groups found from their names if
    ``resolve`` (each call: a name may be given to a new group once its group is destroyed)."""
    found = tuple(comm.group_named(name) for name in groups) if resolve else (None,) * 3
    return MatmulSchedule(form, found, tuple(sizes), *rest)


def _kept_as_given(schedule: MatmulSchedule, k: int, dtype: torch.dtype) -> bool:
    """Whether what :func:`_forward` keeps of operand ``k`` (0: A, 1: B) is the operand itself."""
    if k == 1 and schedule.recasts_b:
        return True
    unchanged = schedule.cast is None or schedule.cast == dtype
    return unchanged and (not schedule.save_gathered or schedule.sizes[k] == 1)


def _matmul3d_kernel(a, b, bias, *args):
    schedule = _schedule_of(*args[:-1])
    c, kept_a, kept_b = _forward(schedule, runtime_named(args[-1]), a, b, bias)
    return (
        c,
        c.new_empty(0) if _kept_as_given(schedule, 0, a.dtype) else kept_a,
        c.new_empty(0) if _kept_as_given(schedule, 1, b.dtype) else kept_b,
    )


def _matmul3d_fake(a, b, bias, *args):
    schedule = _schedule_of(*args[:-1], resolve=False)
    local = [t.new_empty(t.shape, dtype=schedule.cast or t.dtype) for t in (a, b)]
    full = [t.new_empty([t.shape[0] * size, *t.shape[1:]]) for t, size in zip(local, schedule.sizes)]
    c_full = _mm(schedule.form, *full)
    c = c_full.new_empty([c_full.shape[0] // schedule.sizes[2], *c_full.shape[1:]])
    kept = full if schedule.save_gathered else local
    return (
        c,
        *(c.new_empty(0) if _kept_as_given(schedule, k, t.dtype) else kept[k] for k, t in enumerate((a, b))),
    )


def _matmul3d_backward_kernel(
    grad_c, kept_a, kept_b, weight, shapes, dtype_a, dtype_b, dtype_bias, needs, *args
):
    grads = _backward(
        _schedule_of(*args[:-1]), runtime_named(args[-1]), grad_c, kept_a, kept_b, tuple(needs), weight
    )
    return tuple(
        g if g is not None else grad_c.new_empty(0) for g in _as_dtypes(grads, (dtype_a, dtype_b, dtype_bias))
    )


def _matmul3d_backward_fake(
    grad_c, kept_a, kept_b, weight, shapes, dtype_a, dtype_b, dtype_bias, needs, *args
):
    a_shape, b_shape = _split_shapes(shapes)
    needs = [needs[0], needs[1] and not _schedule_of(*args[:-1], resolve=False).grads_at_end, needs[2]]
    return tuple(
        grad_c.new_empty(shape if need else [0], dtype=dtype)
        for shape, dtype, need in zip(
            (a_shape, b_shape, [grad_c.shape[-1]]), (dtype_a, dtype_b, dtype_bias), needs
        )
    )


def _split_shapes(shapes: list) -> tuple[list, list]:
    """``[rank of A, *A's shape, *B's shape]`` → (A's shape, B's shape): one integer list, as ops take."""
    rank = shapes[0]
    return list(shapes[1 : rank + 1]), list(shapes[rank + 1 :])


def _setup_context(ctx, inputs, output) -> None:
    a, b, bias, *args = inputs
    schedule = _schedule_of(*args[:-1], resolve=False)
    kept = [
        given if _kept_as_given(schedule, k, given.dtype) else made
        for k, (given, made) in enumerate(zip((a, b), output[1:]))
    ]
    # the weight itself (no memory: a parameter's view) for a gradient left for the end; saved for
    # every parameter, so that a checkpointed block, recomputed outside the forward's hand-out,
    # saves as many tensors
    ctx.save_for_backward(*kept, b if schedule.b_is_parameter else None)
    ctx.grads_at_end = schedule.grads_at_end
    ctx.shapes = [a.dim(), *a.shape, *b.shape]
    ctx.dtypes = (
        a.dtype,
        b.dtype,
        a.dtype if bias is None else bias.dtype,
    )  # the bias's is unused without one
    ctx.args = args


def _op_backward(ctx, grad_c, _grad_kept_a, _grad_kept_b):
    needs = list(ctx.needs_input_grad[:3])
    kept_a, kept_b, weight = ctx.saved_tensors
    grads = torch.ops.lightning_3d.matmul3d_backward(
        grad_c,
        kept_a,
        kept_b,
        grad_c.new_empty(0) if weight is None else weight,
        ctx.shapes,
        *ctx.dtypes,
        needs,
        *ctx.args,
    )
    given = [
        needs[0],
        needs[1] and not ctx.grads_at_end,
        needs[2],
    ]  # a gradient left for the end is given there
    return (*(g if give else None for g, give in zip(grads, given)), *(None for _ in ctx.args))


# A product that gathers B alone (A's and C's groups of one, as every product of a grid cut over
# x only) runs, compiled, as FSDP2's compiled blocks do: B gathered by one op, C the compiler's
# GEMM, dA and dB made by one op that reduce-scatters dB. Neither op runs the collectives of the
# groups of one, so the host's two calls a product are lighter.


def _gathers_b_only(schedule: MatmulSchedule) -> bool:
    """Whether the compiled product is :class:`_GatheredProduct`: form ``abt``, only B's group larger
    than one, B a parameter kept gathered, no collective matmuls."""
    return (
        schedule.form == "abt"
        and schedule.sizes[0] == schedule.sizes[2] == 1 < schedule.sizes[1]
        and schedule.b_is_parameter
        and schedule.save_gathered
        and not schedule.async_tp
    )


class _GatheredProduct(torch.autograd.Function):
    """``C = A @ B_fullᵀ + bias`` with ``B_full`` B gathered over its group (``A``, ``C`` whole): traced,
    the forward GEMM and the bias's gradient are the compiler's, the gather and the backward GEMMs the ops'.
    ``args``: the schedule and the runtime as the ops take them (:func:`_op_args`)."""

    @staticmethod
    def forward(
        ctx, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, grads_at_end: bool, *args
    ) -> torch.Tensor:
        b_full = torch.ops.lightning_3d.gathered_weight(b, *args)
        ctx.save_for_backward(a, b_full, b)  # b: the weight itself, a parameter's view (no memory)
        ctx.args, ctx.grads_at_end, ctx.has_bias = args, grads_at_end, bias is not None
        return F.linear(a, b_full, bias)

    @staticmethod
    def backward(ctx, grad_c: torch.Tensor):
        a, b_full, weight = ctx.saved_tensors
        grad_a, grad_b = torch.ops.lightning_3d.gathered_product_backward(
            grad_c, a, b_full, weight, ctx.needs_input_grad[1], *ctx.args
        )
        grad_bias = grad_c.sum(tuple(range(grad_c.dim() - 1))) if ctx.has_bias else None
        grad_b = None if ctx.grads_at_end or not ctx.needs_input_grad[1] else grad_b
        return (grad_a, grad_b, grad_bias, None, *(None for _ in ctx.args))


def _gathered_weight_kernel(b, *args):
    schedule = _schedule_of(*args[:-1])
    b_full, wait = _gather_b(schedule, b, _prefetched(schedule, runtime_named(args[-1]), forward=True))
    wait.wait()
    return b_full


def _gathered_weight_fake(b, *args):
    schedule = _schedule_of(*args[:-1], resolve=False)
    return b.new_empty([b.shape[0] * schedule.sizes[1], *b.shape[1:]], dtype=schedule.cast or b.dtype)


def _gathered_product_backward_kernel(grad_c, a, b_full, weight, need_b, *args):
    """``(dA, dB)``: dB (if ``need_b``) reduce-scattered over B's group, in B's dtype, or left for the
    end of backward when the schedule says so; an empty tensor where none is returned."""
    schedule = _schedule_of(*args[:-1])
    grad_b = grad_c.new_empty(0)
    if need_b:
        grad_full = _mm("atb", grad_c, a)  # dB of form "abt" (_BACKWARD)
        if schedule.grads_at_end:
            runtime_named(args[-1]).late_grads.scatter_at_end(
                grad_full, schedule.groups[1], weight, schedule.grads_together
            )
        else:
            grad_b = comm.reduce_scatter_dim0(grad_full, schedule.groups[1])[0].to(weight.dtype)
    return _mm("ab", grad_c, b_full), grad_b


def _gathered_product_backward_fake(grad_c, a, b_full, weight, need_b, *args):
    returned = need_b and not _schedule_of(*args[:-1], resolve=False).grads_at_end
    return a.new_empty(a.shape), weight.new_empty(weight.shape) if returned else grad_c.new_empty(0)


# the kernels run eagerly even inside compiled code: Dynamo must not trace into them
for name, kernel, fake in (
    ("matmul3d", _matmul3d_kernel, _matmul3d_fake),
    ("matmul3d_backward", _matmul3d_backward_kernel, _matmul3d_backward_fake),
    ("gathered_weight", _gathered_weight_kernel, _gathered_weight_fake),
    ("gathered_product_backward", _gathered_product_backward_kernel, _gathered_product_backward_fake),
):
    _LIBRARY.impl(name, torch.compiler.disable(kernel), "CompositeExplicitAutograd")
    torch.library.register_fake(f"lightning_3d::{name}", fake, lib=_LIBRARY)
del name, kernel, fake
torch.library.register_autograd(
    "lightning_3d::matmul3d", _op_backward, setup_context=_setup_context, lib=_LIBRARY
)


def _matmul(
    form: str, a, b, directions, grid, runtime: Runtime | None, options: RuntimeOptions | None, bias=None
) -> torch.Tensor:
    grid = resolve_grid(grid)
    if grid.cube_size == 1:  # nothing to gather or scatter: the plain product, under plain autograd
        return _mm(form, a, _rows(form, b), bias)
    if (
        isinstance(runtime, RuntimeOptions) and options is None
    ):  # options in the runtime's place: the former spelling
        runtime, options = None, runtime
    if runtime is None:
        runtime = Runtime(options)
    elif options is not None:
        raise TypeError("pass a product either its model's runtime or options, not both")
    groups = tuple(grid.group(axis) for axis in directions)
    sizes = tuple(grid.size(axis) for axis in directions)
    landed = WeightGradsAtEnd.landed(b) if sizes[1] > 1 else None
    cast = autocast_dtype(a)
    options = runtime.options
    schedule = MatmulSchedule(
        form,
        groups,
        sizes,
        options.save_gathered,
        cast,
        _is_parameter(b),
        landed is not None,
        options.gathered_together,
        options.async_tp,
    )
    b = _rows(form, b if landed is None else landed)
    # A in the product's dtype before the product: compiled, the cast joins the kernel that makes A
    # (a norm), and its gradient's cast back joins the one that reads dA, instead of a pass of their own
    a = _cast(a, cast)
    if torch.compiler.is_compiling():
        args = _op_args(schedule, runtime)
        if _gathers_b_only(schedule):
            return _GatheredProduct.apply(a, b, bias, schedule.grads_at_end, *args)
        return torch.ops.lightning_3d.matmul3d(a, b, bias, *args)[0]
    return _Matmul3D.apply(a, b, bias, schedule, runtime)


def _rows(form: str, b: torch.Tensor) -> torch.Tensor:
    """B of ``"abt"`` given as a stack ``[g, k', n]`` read as its rows ``[g·k', n]`` (a view)."""
    return b.flatten(0, -2) if form == "abt" and b.dim() > 2 else b


def matmul_ab(
    a,
    b,
    directions=("y", "x", "z"),
    grid: Grid | None = None,
    runtime: Runtime | None = None,
    *,
    options: RuntimeOptions | None = None,
) -> torch.Tensor:
    """``C = A @ B``: gather A over ``directions[0]``, B over ``[1]``, reduce-scatter C over ``[2]``.

    ``a`` ``[m, ..., n]`` and ``b`` ``[n', k]`` are local blocks whose dim 0 is cut by the axis
    that gathers them. ``runtime``: the :class:`~lightning_3d.runtime.Runtime` of the model the
    product belongs to (a 3-D layer passes its own): its options, its weight prefetch (a parameter
    B is gathered its depth of products ahead, and, with ``save_gathered=False``, re-gathered as far
    ahead in backward) and its weight gradients left for the end of backward. A product outside
    any model takes ``options`` instead (default :class:`~lightning_3d.options.RuntimeOptions`):
    ``save_gathered=False`` re-gathers A and B in backward instead of keeping them (less memory,
    more communication); ``async_tp`` runs the gathers and scatters next to the product as
    collective matmuls. A :class:`~lightning_3d.options.RuntimeOptions` given in ``runtime``'s
    place is taken as ``options``.
    """
    return _matmul("ab", a, b, directions, grid, runtime, options)


def matmul_abt(
    a,
    b,
    directions=("y", "x", "z"),
    grid: Grid | None = None,
    runtime: Runtime | None = None,
    bias: torch.Tensor | None = None,
    *,
    options: RuntimeOptions | None = None,
) -> torch.Tensor:
    """``C = A @ Bᵀ (+ bias)`` with ``b`` ``[k', n]`` (the layout of an ``nn.Linear`` weight); see :func:`matmul_ab`.

    ``b`` may be a stack ``[g, k', n]``, multiplied as its rows ``[g·k', n]``: pass a stacked
    parameter whole rather than a view of it, so that its gradient is handed on at the end of
    backward as a parameter's (:class:`~lightning_3d.runtime.WeightGradsAtEnd` finds a parameter
    only).

    ``bias`` ``[k]`` (C's local last dim) is added inside the GEMM of one rank of C's group,
    before the reduce-scatter, so it is counted once and costs no extra pass over C. Its
    gradient, on every rank of C's group, is the sum of ``dC`` over the rows of the whole group
    (the gathered ``dC`` of backward): the caller sums it over the bias's other replicas only
    (``use_replicated(bias, grid, grad_summed_over=directions[2])``).
    """
    return _matmul("abt", a, b, directions, grid, runtime, options, bias)


def matmul_atb(
    a,
    b,
    directions=("z", "y", "x"),
    grid: Grid | None = None,
    runtime: Runtime | None = None,
    *,
    options: RuntimeOptions | None = None,
) -> torch.Tensor:
    """``C = Aᵀ @ B`` with ``a`` ``[m', ..., n]``, ``b`` ``[m'', ..., k]`` → ``[n/|c|, k]``; see :func:`matmul_ab`."""
    return _matmul("atb", a, b, directions, grid, runtime, options)
