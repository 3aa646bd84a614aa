"""The grid and its dp group in the strategies: data, and the Trainer's reductions and gathers over dp.

Every rank of a cube holds one model replica's value (the same batch, the same loss), so a
sampler, a ``self.log(sync_dist=True)`` or an ``all_gather`` over the whole world would count each
replica ``px·py·pz`` times: in the Trainer strategies (``"tensor3d"``, ``"tensor3d_deepspeed"``)
they run over the dp group instead (:class:`GridReplicas`). The Fabric strategy takes the sampler
only (:class:`GridData`): Fabric's ``all_reduce``/``all_gather`` span the world, as in every Fabric
strategy. No Lightning import.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from ..grid import Grid

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def all_reduce(tensor: torch.Tensor, group=None, reduce_op: str | dist.ReduceOp = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (default: the world); ``"mean"``/``"avg"`` divide by its size.

    Args:
        reduce_op: ``"sum"``, ``"mean"`` (``"avg"``), ``"max"``, ``"min"``, ``"product"`` or a ``ReduceOp``.
    """
    if not dist.is_initialized():
        return tensor
    name = reduce_op.lower() if isinstance(reduce_op, str) else None
    mean = name in ("mean", "avg")
    if name is not None and not mean and name not in _OPS:
        raise ValueError(
            f"reduce_op must be one of 'sum', 'mean', 'avg', 'max', 'min', 'product' or a ReduceOp, got {reduce_op!r}"
        )
    op = reduce_op if name is None else dist.ReduceOp.SUM if mean else _OPS[name]
    dist.all_reduce(tensor, op=op, group=group)
    if mean:
        size = dist.get_world_size(group)
        return tensor.div_(size) if tensor.is_floating_point() else tensor.copy_(tensor / size)
    return tensor


class GridData:
    """Strategy mixin: the grid, and a sampler over its dp group (the cube ranks share a batch)."""

    _grid: Grid | None = None

    @property
    def grid(self) -> Grid:
        """The process grid (exists once the processes are set up: before ``configure_model``, or at
        ``Fabric.launch``)."""
        if self._grid is None:
            raise RuntimeError(
                f"{type(self).__name__}.grid exists once the processes are set up "
                "(Trainer.fit/validate/test/predict, or Fabric.launch)"
            )
        return self._grid

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.grid.data_parallel_size, "rank": self.grid.coord("dp")}


class GridReplicas(GridData):
    """Strategy mixin (the Trainer's): the grid, and the sampler, ``reduce`` and ``all_gather`` over its dp group."""

    def _replicas(self, group):
        """The dp group in place of the default (None or the world, which LightningModule.all_gather passes)."""
        return self.grid.group("dp") if group is None or group is dist.group.WORLD else group

    def reduce(self, tensor, group: Any | None = None, reduce_op="mean"):
        """Reduce over the dp group by default: a value logged on a cube rank stands for its whole replica."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return all_reduce(tensor, self._replicas(group), reduce_op)

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """Gather over the dp group by default: ``[dp, ...]``, one entry per replica."""
        if not dist.is_initialized():
            return tensor
        with contextlib.nullcontext() if sync_grads else torch.no_grad():
            return torch.stack(dist_fn.all_gather(tensor.contiguous(), group=self._replicas(group)))

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank's vote counts (each holds different shards), over the world."""
        votes = all_reduce(torch.tensor(int(decision), device=self.root_device))
        return bool(votes == self.world_size) if all else bool(votes)
