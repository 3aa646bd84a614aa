"""``deepspeed_3d.initialize``: ``deepspeed.initialize`` with the 3-D grid as the model-parallel unit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import deepspeed
from torch import nn

from lightning_3d.parallel import set_options

from .checkpoint import read_record, tag_dir
from .config import (
    SECTION,
    check_batch_size,
    check_zero_stage,
    init_grid_from_config,
    keep_torch_linear,
    load_config,
    runtime_options,
)
from .grad_norm_tags import tag_grad_norm_params
from .mpu import GridMPU
from .precision import check_precision
from .sharding_record import RECORD_KEY, check_same_grid, sharding_record


def initialize(*, model: nn.Module, config: dict[str, Any] | str | os.PathLike, **kwargs) -> tuple:
    """Set up the grid and its mpu, then call ``deepspeed.initialize(model=model, config=..., mpu=..., **kwargs)``.

    The grid is the current one (``lightning_3d.init_grid`` or :func:`init_grid_from_config`, the
    usual order, since the model's 3-D layers are built against it); the config's
    ``"tensor3d": {"grid": [px, py, pz], "pipeline_size": pp}`` section must then agree or be absent.
    With pipeline stages this sets up their topology only: DeepSpeed's ``PipelineModule`` and
    pipeline engine are not used, so running a schedule over the stages is the caller's. Without a current
    grid the section builds it (the model must then be built on that grid already, so this suits
    models without 3-D layers). The section is removed before DeepSpeed sees the config.

    ZeRO partitions and gradient averaging run over the data-parallel group; parameters are
    tagged for DeepSpeed's gradient norm (:mod:`deepspeed_3d.grad_norm_tags`); ZeRO-3 leaves
    ``torch.nn.functional.linear`` alone unless the config asks otherwise
    (:func:`~deepspeed_3d.config.keep_torch_linear`).

    The section's optional ``"options"`` change the model's run-time choices, each field given for
    every 3-D layer (``"options": {"async_tp": true}``: ``lightning_3d.parallel.set_options(model,
    async_tp=True)``).

    Save and load its checkpoints with :func:`save_checkpoint` / :func:`load_checkpoint`, which
    add the model's sharding record and check it.

    Returns:
        What ``deepspeed.initialize`` returns: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Raises:
        ValueError: ``mpu`` passed, the section disagrees with the grid or its ``"options"`` are
            not ``RuntimeOptions`` fields and values, ZeRO-2/3 on a grid of pipeline stages, the batch
            sizes do not satisfy ``train_batch_size = micro × accumulation × dp``, or training in mixed
            precision without ZeRO.
    """
    if "mpu" in kwargs:
        raise ValueError("deepspeed_3d.initialize builds the mpu from the grid; do not pass mpu=")
    config = load_config(config)
    grid = init_grid_from_config(config)
    options = runtime_options(config)
    if options:
        set_options(model, **options)
    config.pop(SECTION, None)
    check_zero_stage(config, grid)
    check_batch_size(config, grid)
    if (
        "optimizer" in config or kwargs.get("optimizer") is not None
    ):  # the gradient norm matters only when training
        check_precision(config, grid)
    keep_torch_linear(config)
    tag_grad_norm_params(model, grid)
    engine, optimizer, dataloader, scheduler = deepspeed.initialize(
        model=model, config=config, mpu=GridMPU(grid), **kwargs
    )
    return engine, optimizer, dataloader, scheduler


def save_checkpoint(
    engine, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None, **kwargs
):
    """``engine.save_checkpoint`` with the model's sharding record in the client state
    (:mod:`deepspeed_3d.sharding_record`).

    The record lets :func:`~deepspeed_3d.checkpoint.to_dense` assemble the checkpoint without the
    model, and :func:`load_checkpoint` refuse it on another grid. ``engine`` is one that
    :func:`initialize` made; the other arguments are ``engine.save_checkpoint``'s.
    """
    client_state = {**(client_state or {}), RECORD_KEY: engine_record(engine)}
    return engine.save_checkpoint(save_dir, tag, client_state, **kwargs)


def load_checkpoint(engine, load_dir: str | os.PathLike, tag: str | None = None, **kwargs) -> tuple:
    """``engine.load_checkpoint``, refusing a checkpoint saved on another grid before DeepSpeed reads its shards.

    Returns what ``engine.load_checkpoint`` returns, ``(path, client_state)``, without the record.

    Raises:
        ValueError: the checkpoint's grid differs from the engine's (DeepSpeed matches shards by rank).
    """
    check_checkpoint_grid(engine, load_dir, tag)
    path, client_state = engine.load_checkpoint(load_dir, tag, **kwargs)
    if client_state is not None:
        client_state.pop(RECORD_KEY, None)
    return path, client_state


def engine_record(engine) -> dict[str, Any]:
    """The sharding record of the model of ``engine`` (made by :func:`initialize`)."""
    if not isinstance(engine.mpu, GridMPU):
        raise ValueError("the engine was not made by deepspeed_3d.initialize (its mpu is not a GridMPU)")
    return sharding_record(engine.module, engine.mpu.grid)


def check_checkpoint_grid(engine, load_dir: str | os.PathLike, tag: str | None = None) -> None:
    """Raise ``ValueError`` when checkpoint ``tag`` of ``load_dir`` (default: ``latest``) was saved on another grid."""
    if tag is not None or (Path(load_dir) / "latest").is_file():  # else DeepSpeed finds nothing to load
        saved = read_record(tag_dir(load_dir, tag))
        if saved is not None:
            check_same_grid(saved, engine_record(engine))
