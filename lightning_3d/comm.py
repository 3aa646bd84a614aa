"""Raw dim-0 collectives over one group, with a free path for groups of one rank.

All-gather and reduce-scatter run on dim 0 of a contiguous tensor, so they need no copy or
transpose around them. Each returns ``(tensor, handle)``; ``handle.wait()`` finishes an async
call (``handle`` is a no-op when nothing was sent).

Under ``torch.compile`` the 3-D layers communicate through custom ops, which take a group by its
name (:func:`group_named`) and which the compiler keeps whole, as opaque nodes of its graph:
:func:`all_reduce` here, the 3-D products in :mod:`~lightning_3d.ops.matmul`.
"""

from __future__ import annotations

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


def all_gather_dim0_together(ts: list[torch.Tensor], group: dist.ProcessGroup) -> tuple[list[torch.Tensor], object]:
    """:func:`all_gather_dim0` of each of ``ts`` over ``group``, asynchronously, as one collective
    call (one NCCL group: the ranks meet once for all of them); returns ``(outputs, handle)``."""
    if dist.get_world_size(group) == 1 or len(ts) == 1:
        outs, handles = zip(*(all_gather_dim0(t, group, async_op=True) for t in ts))
        return list(outs), handles[0]
    # Private: the only public way to launch several all-gathers as one NCCL group call.
    with dist._coalescing_manager(group, async_ops=True) as together:
        outs = [all_gather_dim0(t, group, async_op=True)[0] for t in ts]
    return outs, together


def reduce_scatter_dim0(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Sum ``t`` ``[n·g, ...]`` over the group and keep this rank's dim-0 chunk ``[n, ...]``."""
    g = dist.get_world_size(group)
    if g == 1:
        return t, DONE
    if t.shape[0] % g:
        raise ValueError(f"cannot reduce-scatter dim 0 of size {t.shape[0]} over {g} ranks: {t.shape[0]} % {g} != 0")
    t = t.contiguous()
    out = t.new_empty((t.shape[0] // g,) + t.shape[1:])
    work = _reduce_scatter(out, t, group=group, async_op=async_op)
    return out, (work if async_op else DONE)


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
