"""What a Lightning precision plugin must do differently on a grid (no Lightning import).

- Clipping by norm uses the model's global norm (:mod:`lightning_3d.grad_norm`), not the norm
  of this rank's shards: :class:`GlobalNormClipping`, mixed into a subclass of each of Lightning's
  plugins that the Trainer strategy supports (defined beside the strategy class of each
  namespace). Fabric's strategy clips itself and takes Fabric's own plugins (:func:`fabric_precision`).
- An fp16 loss scaler decides "overflow, skip this step" for all ranks together: each rank sees
  only its shards' gradients, and a rank that steps while another skips leaves the model torn
  (:func:`agreed_scaler`).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..grad_norm import clip_grad_norm_
from ..grid import Grid

SUPPORTED = "'32-true', '64-true', '16-true', 'bf16-true', '16-mixed' and 'bf16-mixed'"
FABRIC_SUPPORTED = "'32-true', '64-true', '16-true', 'bf16-true', 'bf16-mixed', and '16-mixed' on CUDA"


class GlobalNormClipping:
    """Precision-plugin mixin: ``gradient_clip_val`` clips by the 3-D model's global norm on :attr:`grid`."""

    grid: Grid | None = None  # set by the strategy once the grid exists

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        if self.grid is None:
            raise RuntimeError("the tensor3d precision plugin clips once the strategy has set up its grid")
        clip_grad_norm_(self.main_params(optimizer), clip_val, self.grid)


def agreed_scaler(scaler: torch.amp.GradScaler, device: str) -> ShardedGradScaler:
    """A scaler with ``scaler``'s settings and state whose overflow check is all-reduced over the world."""
    if isinstance(scaler, ShardedGradScaler):
        return scaler
    agreed = ShardedGradScaler(device, enabled=scaler.is_enabled(), process_group=dist.group.WORLD)
    if scaler.is_enabled():
        agreed.load_state_dict(scaler.state_dict())
    return agreed


def on_grid(plugin, classes: dict[type, type]):
    """``plugin`` as the grid-aware subclass ``classes[type(plugin)]``, built with the same constructor arguments.

    The arguments are read from the plugin's attributes of the same names (``precision``,
    ``device``, ``scaler``: Lightning's plugins keep them so). A plugin already grid-aware, or
    ``None``, comes back as it is.

    Raises:
        ValueError: a plugin of a type the strategy has no grid-aware subclass for.
    """
    if plugin is None or isinstance(plugin, GlobalNormClipping):
        return plugin
    cls = classes.get(type(plugin))
    if cls is None:
        raise ValueError(
            f"the tensor3d strategy supports the precisions {SUPPORTED} (it clips gradients by the global 3-D "
            f"norm through its own plugins); got the plugin {type(plugin).__qualname__}: pass "
            "Trainer(precision=...) instead"
        )
    return cls(**{name: getattr(plugin, name) for name in inspect.signature(cls).parameters})


def fabric_precision(plugin, supported: tuple[type, ...]):
    """``plugin`` (a Fabric precision plugin) if its type is one of ``supported``, its fp16 scaler made
    :func:`agreed_scaler`'s.

    Fabric's strategy clips by the global norm itself (``clip_gradients_norm``), so Fabric's own
    plugins serve as they are; ``None`` comes back as it is.

    Raises:
        ValueError: any other plugin: Transformer Engine's and bitsandbytes' replace the model's
            ``Linear`` layers, which the 3-D plan replaces itself; FSDP's, DeepSpeed's and XLA's
            belong to those strategies.
    """
    if plugin is None:
        return plugin
    if type(plugin) not in supported:
        raise ValueError(
            f"the tensor3d Fabric strategy supports the precisions {FABRIC_SUPPORTED}; got the plugin "
            f"{type(plugin).__qualname__}, which replaces the model's layers (Transformer Engine, "
            "bitsandbytes: the 3-D layers replace them themselves) or belongs to another strategy: "
            "pass Fabric(precision=...) with one of those"
        )
    if getattr(plugin, "scaler", None) is not None:
        plugin.scaler = agreed_scaler(plugin.scaler, plugin.device)
    return plugin


class AgreedOverflow:
    """Mixed into a subclass of Lightning's ``MixedPrecision``: its fp16 scaler is :func:`agreed_scaler`'s."""

    def __init__(self, precision: str, device: str, scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(precision, device, scaler)
        if self.scaler is not None:
            self.scaler = agreed_scaler(self.scaler, device)
