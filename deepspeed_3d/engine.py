"""``deepspeed_3d.initialize``: ``deepspeed.initialize`` with the 3-D grid as the model-parallel unit."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import deepspeed
from torch import nn

from .checkpoint import read_layout, tag_dir
from .config import (
    SECTION,
    check_batch_size,
    init_grid_from_config,
    keep_torch_linear,
    load_config,
)
from .grad_norm_tags import tag_grad_norm_params
from .layout import LAYOUT_KEY, check_same_grid, model_layout
from .mpu import GridMPU
from .precision import check_precision


def initialize(*, model: nn.Module, config: dict[str, Any] | str | os.PathLike, **kwargs) -> tuple:
    """Set up the grid and its mpu, then call ``deepspeed.initialize(model=model, config=..., mpu=..., **kwargs)``.

    The grid is the current one (``lightning_3d.init_grid`` or :func:`init_grid_from_config`, the
    usual order, since the model's 3-D layers are built against it); the config's
    ``"tensor3d": {"grid": [px, py, pz]}`` section must then agree or be absent. Without a current
    grid the section builds it (the model must then be built on that grid already, so this suits
    models without 3-D layers). The section is removed before DeepSpeed sees the config.

    ZeRO partitions and gradient averaging run over the data-parallel group; parameters are
    tagged for DeepSpeed's gradient norm (:mod:`deepspeed_3d.grad_norm_tags`); checkpoints carry
    the grid layout (:mod:`deepspeed_3d.layout`); ZeRO-3 leaves ``torch.nn.functional.linear``
    alone unless the config asks otherwise (:func:`~deepspeed_3d.config.keep_torch_linear`).

    Returns:
        What ``deepspeed.initialize`` returns: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Raises:
        ValueError: ``mpu`` passed, the section disagrees with the grid, the batch sizes do not
            satisfy ``train_batch_size = micro × accumulation × dp``, or training in mixed precision
            without ZeRO.
    """
    if "mpu" in kwargs:
        raise ValueError("deepspeed_3d.initialize builds the mpu from the grid; do not pass mpu=")
    config = load_config(config)
    grid = init_grid_from_config(config)
    config.pop(SECTION, None)
    check_batch_size(config, grid)
    if "optimizer" in config or kwargs.get("optimizer") is not None:  # the gradient norm matters only when training
        check_precision(config, grid)
    keep_torch_linear(config)
    tag_grad_norm_params(model, grid)
    engine, optimizer, dataloader, scheduler = deepspeed.initialize(model=model, config=config, mpu=GridMPU(grid), **kwargs)
    engine.__class__ = _grid_engine_class(type(engine))
    engine.tensor3d_layout = model_layout(model, grid)
    return engine, optimizer, dataloader, scheduler


class _GridEngine:
    """Mixed into the engine class: checkpoints carry the grid layout and refuse another grid."""

    tensor3d_layout: dict[str, Any]

    def save_checkpoint(self, save_dir, tag=None, client_state=None, *args, **kwargs):
        client_state = {**(client_state or {}), LAYOUT_KEY: self.tensor3d_layout}
        return super().save_checkpoint(save_dir, tag, client_state, *args, **kwargs)

    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        if tag is not None or (Path(load_dir) / "latest").is_file():  # else DeepSpeed finds nothing to load
            saved = read_layout(tag_dir(load_dir, tag))
            if saved is not None:  # before DeepSpeed reads shards of another grid into this one's
                check_same_grid(saved, self.tensor3d_layout)
        path, client_state = super().load_checkpoint(load_dir, tag, *args, **kwargs)
        if client_state is not None:
            client_state.pop(LAYOUT_KEY, None)
        return path, client_state


@functools.cache
def _grid_engine_class(engine_class: type) -> type:
    return type(f"Grid{engine_class.__name__}", (_GridEngine, engine_class), {"__module__": __name__})
