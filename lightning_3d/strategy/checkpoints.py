"""The sharded checkpoint as both Lightning strategies write and read it (no Lightning import).

The Trainer strategy saves Lightning's checkpoint dict, Fabric's the user's ``state``; both go
through :func:`save_sharded` and :func:`load_sharded`, so either reads what the other wrote
(:mod:`lightning_3d.checkpoint`: DCP shards, ``layout.json``, ``rng/``, ``meta.pt``, manifest):

- the module's state under ``state_dict``, optimizer ``i``'s under ``optimizer_i`` (keys of a
  model saved inside a LightningModule and of the bare model differ by its dense root's prefix:
  :func:`lightning_3d.checkpoint.store.saved_key` maps them);
- everything else in ``meta.pt`` (weights-only unpickling on load, allowing :data:`META_CLASSES`),
  with each optimizer's param groups (parameters by name; with pipeline stages, every stage's
  parameters: :func:`lightning_3d.checkpoint.stages.whole_param_groups`) under :data:`PARAM_GROUPS_KEY`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import checkpoint as ckpt
from ..checkpoint.stages import whole_param_groups
from ..checkpoint.store import saved_key
from ..grid import Grid
from ..models.config import GPTConfig

PARAM_GROUPS_KEY = "tensor3d_param_groups"
FABRIC_STATE_KEY = (
    "tensor3d_fabric_state"  # in the meta of a checkpoint Fabric wrote: which state entries were saved how
)
META_CLASSES = (GPTConfig,)
"""The classes ``meta.pt`` may hold besides plain data: the library's model config (a LightningModule's
hyper-parameter)."""


def save_sharded(
    path: str | Path,
    module: nn.Module,
    grid: Grid,
    model_state: dict[str, Any],
    optimizer_states: list[dict[str, Any]],
    meta: dict[str, Any],
) -> None:
    """Write checkpoint ``path``. Collective over the world.

    Args:
        model_state: :func:`lightning_3d.checkpoint.model_state` of ``module``.
        optimizer_states: :func:`lightning_3d.checkpoint.optimizer_state` of each optimizer, in order.
        meta: the rest (plain values, tensors, containers); the param groups are added to it.
    """
    tensors = {ckpt.MODEL_KEY: model_state}
    for i, state in enumerate(optimizer_states):
        tensors[ckpt.optimizer_key(i)] = {"state": state["state"]}
    groups = [whole_param_groups(state["param_groups"], grid) for state in optimizer_states]
    ckpt.save(path, tensors, grid, module, meta={**meta, PARAM_GROUPS_KEY: groups}, allowed=META_CLASSES)


def load_meta(path: str | Path, trusted: bool) -> dict[str, Any]:
    """The checkpoint's ``meta.pt``, read weights-only allowing :data:`META_CLASSES` unless ``trusted``."""
    return ckpt.load_meta(path, trusted=trusted, allowed=META_CLASSES)


def load_sharded(
    path: str | Path,
    module: nn.Module,
    grid: Grid,
    optimizers: dict[int, torch.optim.Optimizer],
    holds_state: Callable[[torch.optim.Optimizer], Callable[[torch.Tensor], bool]],
    meta: dict[str, Any],
    strict: bool = True,
) -> None:
    """Load checkpoint ``path`` (written on any grid and dp) into ``module`` and ``optimizers``. Collective
    over the world.

    Args:
        optimizers: ``{index in the checkpoint: optimizer}``.
        holds_state: ``holds_state(optimizer)(param)``: whether this rank keeps the parameter's state (ZeRO-1).
        meta: the checkpoint's :func:`lightning_3d.checkpoint.load_meta`.
        strict: every tensor of the module must be in the checkpoint and the reverse.

    Raises:
        CheckpointError: an incomplete or altered checkpoint, another model's, or fewer optimizers than asked for.
    """
    ckpt.load_model_(module, grid, path, strict=strict)
    groups = meta.get(PARAM_GROUPS_KEY, [])
    key = saved_key(path, module)
    names = {i: key(name) for i, name in ckpt.parameter_names(module).items()}
    for index, optimizer in optimizers.items():
        if index >= len(groups):
            raise ckpt.CheckpointError(
                f"{path} holds the state of {len(groups)} optimizer(s); optimizer {index} was asked for"
            )
        ckpt.load_optimizer_(optimizer, index, names, grid, path, groups[index], holds_state(optimizer))
