"""Raw dim-0 collectives over one group, with a free path for groups of one rank.

All-gather and reduce-scatter run on dim 0 of a contiguous tensor, so they need no copy or
transpose around them. Each returns ``(tensor, handle)``; ``handle.wait()`` finishes an async
call (``handle`` is a no-op when nothing was sent).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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
    """In-place all-reduce of ``t`` over the group; returns ``(t, handle)``."""
    if dist.get_world_size(group) == 1:
        return t, DONE
    work = dist.all_reduce(t, op=op, group=group, async_op=async_op)
    return t, (work if async_op else DONE)
