"""What both 3-D strategies share: the grid, and data, reductions and gathers over dp.

Every rank of a cube holds one model replica's value (the same batch, the same loss), so a
sampler, a ``self.log(sync_dist=True)`` or an ``all_gather`` over the whole world would count each
replica ``px·py·pz`` times: they run over the dp group instead.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from ..grid import Grid


def replicas_mixin(fabric: str) -> type:
    """The mixin for a strategy of the Lightning namespace whose Fabric package is ``fabric``."""
    distributed = importlib.import_module(f"{fabric}.utilities.distributed")

    class GridReplicas:
        _grid: Grid | None = None

        @property
        def grid(self) -> Grid:
            """The process grid (exists once the processes are set up, before ``configure_model``)."""
            if self._grid is None:
                raise RuntimeError(f"{type(self).__name__}.grid exists once Trainer.fit/validate/test/predict has set up the processes")
            return self._grid

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return {"num_replicas": self.grid.data_parallel_size, "rank": self.grid.coord("dp")}

        def _replicas(self, group):
            """The dp group in place of the default (None or the world, which LightningModule.all_gather passes)."""
            return self.grid.group("dp") if group is None or group is dist.group.WORLD else group

        def reduce(self, tensor, group: Any | None = None, reduce_op="mean"):
            """Reduce over the dp group by default: a value logged on a cube rank stands for its whole replica."""
            if not isinstance(tensor, torch.Tensor):
                return tensor
            return distributed._sync_ddp_if_available(tensor, self._replicas(group), reduce_op=reduce_op)

        def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
            """Gather over the dp group by default: ``[dp, ...]``, one entry per replica."""
            return distributed._all_gather_ddp_if_available(tensor, group=self._replicas(group), sync_grads=sync_grads)

    return GridReplicas
