"""The bytes each rank sends, counted from the collectives a step calls.

:class:`SentBytes` is a ``TorchDispatchMode``: every collective reaches the dispatcher as an op,
whether called through ``torch.distributed`` (``c10d._allgather_base_``, ``allreduce_``, ... as
FSDP2, DDP's reducer and the 3-D layers call them) or through the functional collectives
(``_c10d_functional.all_gather_into_tensor``, ... as DTensor redistributes), so the mode sees ours
and every peer's alike, in forward and in backward (autograd carries the mode to the thread that
runs backward). A collective of ``g`` ranks over a tensor of ``B`` bytes (the gathered tensor, or
the one reduced) counts as a ring moves it: all-gather and reduce-scatter ``B·(g−1)/g`` sent by
each rank, all-reduce ``2·B·(g−1)/g``, all-to-all ``B·(g−1)/g``, broadcast ``B`` (each rank
forwards it once, as a ring does).
Groups of one rank send nothing.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _ring(kind: str, nbytes: int, g: int) -> float:
    return 0.0 if g == 1 else nbytes * (g - 1) / g * (2 if kind == "all_reduce" else 1)


def _group_size(group) -> int:
    """The ranks of a group given by name (functional collectives) or as the op's boxed ``ProcessGroup``."""
    return (
        _resolve_process_group(group).size()
        if isinstance(group, str)
        else dist.ProcessGroup.unbox(group).size()
    )


# op → (kind, where the full tensor is: "out" the first argument (gathered), "in" the second, or "arg0"),
# and the argument holding the group
_C10D = {
    c10d._allgather_base_.default: ("all_gather", "out", 2),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", "out", 2),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", "in", 2),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", "in", 2),
    c10d.allreduce_.default: ("all_reduce", "arg0", 1),
    c10d.allreduce_coalesced_.default: ("all_reduce", "arg0", 1),
    c10d.alltoall_base_.default: ("all_to_all", "in", 2),
    c10d.broadcast_.default: ("broadcast", "arg0", 1),
    c10d.allgather_.default: ("all_gather", "out", 2),
    c10d.reduce_scatter_.default: ("reduce_scatter", "in", 2),
}
_FUNCOL = {  # (kind, the group's size argument or None, the group's name argument)
    funcol.all_gather_into_tensor.default: ("all_gather", 1, 2),
    funcol.all_gather_into_tensor_coalesced.default: ("all_gather", 1, 2),
    funcol.reduce_scatter_tensor.default: ("reduce_scatter", 2, 3),
    funcol.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", 2, 3),
    funcol.all_reduce.default: ("all_reduce", None, 2),
    funcol.all_reduce_coalesced.default: ("all_reduce", None, 2),
    funcol.all_to_all_single.default: ("all_to_all", None, 3),
    funcol.broadcast.default: ("broadcast", None, 2),
}


class SentBytes(TorchDispatchMode):
    """Counts the bytes this rank sends while active: :attr:`by_kind` ``{(kind, group size): bytes}``,
    :attr:`calls` the number of collectives, :attr:`total` their sum."""

    def __init__(self):
        super().__init__()
        self.by_kind: dict[tuple[str, int], float] = defaultdict(float)
        self.calls = 0

    @property
    def total(self) -> float:
        return sum(self.by_kind.values())

    def count(self, kind: str, nbytes: int, g: int) -> None:
        if g > 1:
            self.by_kind[(kind, g)] += nbytes if kind == "broadcast" else _ring(kind, nbytes, g)
            self.calls += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _C10D:
            kind, where, group_arg = _C10D[func]
            full = args[0] if where in ("out", "arg0") else args[1]
            if func in (c10d.allgather_.default,):  # [[out per rank]], [in]
                full = [t for ts in args[0] for t in ts]
            elif func is c10d.reduce_scatter_.default:  # [out], [[in per rank]]
                full = [t for ts in args[1] for t in ts]
            self.count(kind, _nbytes(full), _group_size(args[group_arg]))
        elif func in _FUNCOL:
            kind, size_arg, name_arg = _FUNCOL[func]
            g = args[size_arg] if size_arg is not None else _group_size(args[name_arg])
            full = args[0]
            nbytes = _nbytes(full) * (g if kind == "all_gather" else 1)  # the input is one rank's block
            self.count(kind, nbytes, g)
        return func(*args, **kwargs)

    def summary(self) -> dict:
        """JSON: the total, the calls, and the bytes by ``"kind/group size"``."""
        return {
            "total": self.total,
            "calls": self.calls,
            "by_kind": {f"{kind}/{g}": b for (kind, g), b in sorted(self.by_kind.items())},
        }
