"""Raw dim-0 collectives over one group, with a free path for groups of one rank.

All-gather and reduce-scatter run on dim 0 of a contiguous tensor, so they need no copy or
transpose around them. Each returns ``(tensor, handle)``; ``handle.wait()`` finishes an async
call (``handle`` is a no-op when nothing was sent).

Under ``torch.compile`` the 3-D layers communicate through custom ops, which take a group by its
name (:func:`group_named`) and which the compiler keeps whole, as opaque nodes of its graph:
:func:`all_reduce` here, the 3-D products in :mod:`~lightning_3d.ops.matmul`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

# Private: the only way from a group's name (what a custom op can take) back to the group.
from torch.distributed.distributed_c10d import _resolve_process_group

# torch 2.13 renamed the tensor variants; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Done:
    """Handle of a collective that needed no communication."""

    def wait(self) -> None:
        pass


DONE = _Done()


def all_gather_dim0(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Concatenate the group's ``t`` ``[n, ...]`` along dim 0 → ``[n·g, ...]`` in group-rank order."""
    g = dist.get_world_size(group)
    if g == 1:
        return t, DONE
    t = t.contiguous()
    out = t.new_empty((t.shape[0] * g,) + t.shape[1:])
    work = _all_gather(out, t, group=group, async_op=async_op)
    return out, (work if async_op else DONE)


def all_gather_dim0_together(
    ts: list[torch.Tensor],
    group: dist.ProcessGroup,
    dtype: torch.dtype | None = None,
    *,
    streams: SideStreams,
) -> tuple[list[torch.Tensor], object]:
    """:func:`all_gather_dim0` of each of ``ts`` (cast to ``dtype``, default each one's own) over
    ``group``, asynchronously, as one collective; returns ``(outputs, handle)``.

    The tensors are cast into one flat buffer ``[Σ numel]``, which is gathered at once into
    ``[g·Σ numel]`` (rank r's buffer r-th), as FSDP gathers a block's parameters; each output
    ``[g·n_i, ...]`` is then copied out of its columns. On CUDA the cast and the gather's launch
    run on one of ``streams`` and the copy on another, as soon as the gather lands, so that neither
    takes the caller's stream; ``handle.wait()`` only makes the caller's stream wait for the copy.
    On CPU ``handle.wait()`` waits and copies. Tensors of different dtypes are gathered one by one.
    """
    g = dist.get_world_size(group)
    cast = [dtype or t.dtype for t in ts]
    if g == 1 or len(ts) == 1 or len(set(cast)) > 1:
        outs, handles = zip(*(all_gather_dim0(t.to(d), group, async_op=True) for t, d in zip(ts, cast)))
        return list(outs), _AllOf(handles)
    sizes = [t.numel() for t in ts]
    flat = torch.empty(sum(sizes), dtype=cast[0], device=ts[0].device)
    gathered = flat.new_empty(g * flat.numel())
    outs = [flat.new_empty((g * t.shape[0],) + t.shape[1:]) for t in ts]
    # a parameter's copy records no autograd history
    with streams.beside("weight casts", flat), torch.no_grad():
        for part, t in zip(flat.split(sizes), ts):
            part.view(t.shape).copy_(t)
        work = _all_gather(gathered, flat, group=group, async_op=True)  # NCCL waits for this stream only
    return outs, _CopiedOut(work, flat, gathered, outs, sizes, streams)


class SideStreams:
    """CUDA streams beside the compute stream, one per purpose and device, made on first use, so that
    work of one kind runs beside the compute stream without queueing behind another kind's. A model's
    :class:`~lightning_3d.runtime.Runtime` owns one and hands it to the code that needs a stream."""

    def __init__(self):
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}

    @contextlib.contextmanager
    def beside(self, purpose: str, *tensors: torch.Tensor):
        """On CUDA, run the block on the stream kept for ``purpose`` (yielded), after the work queued so
        far on the caller's stream, which made ``tensors`` and keeps using them; elsewhere, run it in
        place (yields None)."""
        device = tensors[0].device
        if device.type != "cuda":
            yield None
            return
        side = self._streams.get((purpose, device))
        if side is None:
            side = self._streams[purpose, device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            yield side
        for t in tensors:
            t.record_stream(side)


class _AllOf:
    """Handle of several collectives: waits for each."""

    def __init__(self, handles):
        self._handles = handles

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()


class _CopiedOut:
    """Handle of :func:`all_gather_dim0_together`'s gather: its outputs copied out of the gathered buffer."""

    def __init__(
        self,
        work,
        flat: torch.Tensor,
        gathered: torch.Tensor,
        outs: list[torch.Tensor],
        sizes: list[int],
        streams: SideStreams,
    ):
        self._copy = (gathered, outs, sizes)
        self._work, self._done, self._device = work, None, gathered.device
        if (
            gathered.device.type == "cuda"
        ):  # flat, read by the gather, is not reused before this stream has waited for it
            with streams.beside("gathered outputs", flat, gathered, *outs):
                work.wait()  # the side stream waits for the gather; the host does not (unless TORCH_NCCL_BLOCKING_WAIT)
                self._copy_out()
                self._done = torch.cuda.Event()
                self._done.record()

    def _copy_out(self) -> None:
        gathered, outs, sizes = self._copy
        rows = gathered.view(len(gathered) // sum(sizes), -1)  # [g, Σ numel]: rank r's buffer in row r
        torch.split_with_sizes_copy(rows, sizes, dim=1, out=[o.view(len(rows), -1) for o in outs])
        self._copy = self._work = None

    def wait(self) -> None:
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)
        elif self._work is not None:
            self._work.wait()
            self._copy_out()


def reduce_scatter_dim0(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Sum ``t`` ``[n·g, ...]`` over the group and keep this rank's dim-0 chunk ``[n, ...]``."""
    g = dist.get_world_size(group)
    if g == 1:
        return t, DONE
    _check_divides(t, g)
    t = t.contiguous()
    out = t.new_empty((t.shape[0] // g,) + t.shape[1:])
    work = _reduce_scatter(out, t, group=group, async_op=async_op)
    return out, (work if async_op else DONE)


def reduce_scatter_dim0_together(
    ts: list[torch.Tensor], group: dist.ProcessGroup, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """:func:`reduce_scatter_dim0` of each of ``ts`` over ``group`` as one collective, on the caller's
    stream; each result ``[n_i, ...]`` in ``dtype`` (default its input's).

    The tensors ``[g·n_i, ...]`` are concatenated rank by rank into one buffer ``[g, Σ n_i·…]``
    (rank r's rows of each in row r), as FSDP reduce-scatters a block's gradients; the reduced row
    ``[Σ n_i·…]`` is cast once and the results are views of it. Tensors of different dtypes are
    reduce-scattered one by one."""
    g = dist.get_world_size(group)
    if g == 1 or len(ts) == 1 or len({t.dtype for t in ts}) > 1:
        outs = [reduce_scatter_dim0(t, group)[0] for t in ts]
        return outs if dtype is None else [out.to(dtype) for out in outs]
    for t in ts:
        _check_divides(t, g)
    flat = torch.cat([t.reshape(g, -1) for t in ts], dim=1)
    row = flat.new_empty(flat.shape[1])
    _reduce_scatter(row, flat.view(-1), group=group)
    row = row if dtype is None else row.to(dtype)
    return [
        part.view((t.shape[0] // g,) + t.shape[1:])
        for part, t in zip(row.split([t.numel() // g for t in ts]), ts)
    ]


def _check_divides(t: torch.Tensor, g: int) -> None:
    """Raise ``ValueError`` unless ``t``'s dim 0 splits over ``g`` ranks."""
    if t.shape[0] % g:
        raise ValueError(
            f"cannot reduce-scatter dim 0 of size {t.shape[0]} over {g} ranks: {t.shape[0]} % {g} != 0"
        )


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM, async_op: bool = False):
    """All-reduce ``t`` over the group; returns ``(result, handle)``. Eagerly the result is ``t``,
    reduced in place; under ``torch.compile`` it is a new tensor, made by a custom op the compiler
    keeps whole (not differentiable: for use inside autograd functions)."""
    if dist.get_world_size(group) == 1:
        return t, DONE
    if torch.compiler.is_compiling():
        return _all_reduce(t, op.name, group.group_name), DONE
    work = dist.all_reduce(t, op=op, group=group, async_op=async_op)
    return t, (work if async_op else DONE)


def group_named(name: str) -> dist.ProcessGroup:
    """The process group whose ``group_name`` is ``name``."""
    return _resolve_process_group(name)


@torch.library.custom_op("lightning_3d::all_reduce", mutates_args=())
def _all_reduce(t: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out, op=getattr(dist.ReduceOp, op), group=group_named(group_name))
    return out


@_all_reduce.register_fake
def _(t, op, group_name):
    return torch.empty_like(t)
