"""What a Lightning precision plugin must do differently on a grid (works on any plugin; no Lightning import).

- Clipping by norm uses the model's global norm (:mod:`lightning_3d.grad_norm`), not the norm
  of this rank's shards.
- An fp16 loss scaler decides "overflow, skip this step" for all ranks together: each rank sees
  only its shards' gradients, and a rank that steps while another skips leaves the model torn.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..grad_norm import clip_grad_norm_
from ..grid import Grid


class GlobalNormClipping:
    """Precision-plugin mixin: ``gradient_clip_val`` clips by the 3-D model's global norm."""

    tensor3d_grid: Grid

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val, self.tensor3d_grid)


_clipping_classes: dict[type, type] = {}


def clip_globally(plugin, grid: Grid) -> None:
    """Give ``plugin`` (any precision plugin) :class:`GlobalNormClipping`, keeping its class's qualname.

    The qualname names the plugin's state in Lightning checkpoints, so it must not change.
    """
    cls = type(plugin)
    if not isinstance(plugin, GlobalNormClipping):
        if cls not in _clipping_classes:
            _clipping_classes[cls] = type(cls.__name__, (GlobalNormClipping, cls), {"__qualname__": cls.__qualname__})
        plugin.__class__ = _clipping_classes[cls]
    plugin.tensor3d_grid = grid


def agreed_scaler(scaler: torch.amp.GradScaler) -> ShardedGradScaler:
    """A scaler with ``scaler``'s settings whose overflow check is all-reduced over the world."""
    if isinstance(scaler, ShardedGradScaler):
        return scaler
    return ShardedGradScaler(
        scaler._device, init_scale=scaler._init_scale, growth_factor=scaler._growth_factor,
        backoff_factor=scaler._backoff_factor, growth_interval=scaler._growth_interval,
        enabled=scaler._enabled, process_group=dist.group.WORLD)


def agree_on_overflow(plugin) -> None:
    """Replace the plugin's loss scaler (fp16 mixed precision only has one) by :func:`agreed_scaler`'s."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        plugin.scaler = agreed_scaler(scaler)
