"""``deepspeed_3d.initialize``: ``deepspeed.initialize`` with the 3-D grid as the model-parallel unit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import deepspeed
import torch
from torch import nn

from lightning_3d.grid import Grid
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
from .pipeline import StagePipelineModule, pipeline_module, take_pipeline_section
from .precision import check_precision
from .sharding_record import RECORD_KEY, check_same_grid, sharding_record


def initialize(*, model: nn.Module, config: dict[str, Any] | str | os.PathLike, **kwargs) -> tuple:
    """Set up the grid and its mpu, then call ``deepspeed.initialize(model=model, config=..., mpu=..., **kwargs)``.

    The grid is the current one (``lightning_3d.init_grid`` or :func:`init_grid_from_config`, the
    usual order, since the model's 3-D layers are built against it); the config's
    ``"tensor3d": {"grid": [px, py, pz], "pipeline_size": pp}`` section must then agree or be absent.
    Without a current grid the section builds it (the model must then be built on that grid already,
    so this suits models without 3-D layers, and plain models split into pipeline stages). The section
    is removed before DeepSpeed sees the config.

    ZeRO partitions and gradient averaging run over the data-parallel group; parameters are
    tagged for DeepSpeed's gradient norm (:mod:`deepspeed_3d.grad_norm_tags`); ZeRO-3 leaves
    ``torch.nn.functional.linear`` alone unless the config asks otherwise
    (:func:`~deepspeed_3d.config.keep_torch_linear`).

    The section's optional ``"options"`` change the model's run-time choices, each field given for
    every 3-D layer (``"options": {"async_tp": true}``: ``lightning_3d.parallel.set_options(model,
    async_tp=True)``).

    With pipeline stages (``pp > 1``) ``model`` is the plain model (not parallelized; built on ``meta``,
    only this rank's stage is materialised), consumed: this rank's stage of it becomes a DeepSpeed
    ``PipelineModule`` (:class:`~deepspeed_3d.pipeline.StagePipelineModule`, configured by DeepSpeed's
    ``"pipeline"`` section, :func:`~deepspeed_3d.pipeline.take_pipeline_section`) and the engine is
    DeepSpeed's ``PipelineEngine``: train with ``engine.train_batch(data_iter)``, whose iterator yields
    ``gradient_accumulation_steps`` micro-batches ``(ids, targets)`` of ``train_micro_batch_size_per_gpu``
    sequences each, the same on every rank of a replica. Its mpu is DeepSpeed's own grid of the same
    topology; the optimizer comes from the config or a callable of the parameters.

    Save and load its checkpoints with :func:`save_checkpoint` / :func:`load_checkpoint`, which
    add the model's sharding record and check it.

    Returns:
        What ``deepspeed.initialize`` returns: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Raises:
        ValueError: ``mpu`` passed, the section disagrees with the grid or its ``"options"`` are
            not ``RuntimeOptions`` fields and values, ZeRO-2/3 on a grid of pipeline stages, the batch
            sizes do not satisfy ``train_batch_size = micro × accumulation × dp``, or training in mixed
            precision without ZeRO; with pipeline stages, what
            :func:`~deepspeed_3d.pipeline.take_pipeline_section` and ``split_stages`` refuse,
            ``model_parameters=`` or an optimizer object (made before the split).
    """
    if "mpu" in kwargs:
        raise ValueError("deepspeed_3d.initialize builds the mpu from the grid; do not pass mpu=")
    config = load_config(config)
    grid = init_grid_from_config(config)
    options = runtime_options(config)
    config.pop(SECTION, None)
    check_zero_stage(config, grid)
    check_batch_size(config, grid)
    if (
        "optimizer" in config or kwargs.get("optimizer") is not None
    ):  # the gradient norm matters only when training
        check_precision(config, grid)
    keep_torch_linear(config)
    if grid.pipeline_size > 1:
        return _initialize_pipeline(model, config, grid, options, kwargs)
    if options:
        set_options(model, **options)
    tag_grad_norm_params(model, grid)
    engine, optimizer, dataloader, scheduler = deepspeed.initialize(
        model=model, config=config, mpu=GridMPU(grid), **kwargs
    )
    return engine, optimizer, dataloader, scheduler


def _initialize_pipeline(
    model: nn.Module, config: dict[str, Any], grid: Grid, options: dict[str, Any], kwargs: dict[str, Any]
) -> tuple:
    """``deepspeed.initialize`` of this rank's stage of ``model`` as a :class:`StagePipelineModule`
    (DeepSpeed's ``PipelineEngine``, whose ``PipelineParallelGrid`` of the same topology is the mpu)."""
    if kwargs.get("model_parameters") is not None or isinstance(
        kwargs.get("optimizer"), torch.optim.Optimizer
    ):
        raise ValueError(
            "with pipeline stages initialize splits the model, so its parameters exist only after the split: "
            'leave out model_parameters= and give the optimizer in the config ("optimizer": {...}) or as a '
            "callable (optimizer=lambda params: torch.optim.AdamW(params, ...))"
        )
    split_points = take_pipeline_section(config, grid)
    module = pipeline_module(model, grid, split_points=split_points, options=options)
    tag_grad_norm_params(module, grid)
    engine, optimizer, dataloader, scheduler = deepspeed.initialize(model=module, config=config, **kwargs)
    module.bind_micro_batches(engine.train_micro_batch_size_per_gpu())
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
    """The sharding record of the model of ``engine`` (made by :func:`initialize`; with pipeline stages,
    of this rank's stage)."""
    if isinstance(engine.mpu, GridMPU):
        return sharding_record(engine.module, engine.mpu.grid)
    if isinstance(engine.module, StagePipelineModule):
        return sharding_record(engine.module, engine.module.grid)
    raise ValueError(
        "the engine was not made by deepspeed_3d.initialize (its mpu is not a GridMPU, nor its module "
        "a StagePipelineModule)"
    )


def check_checkpoint_grid(engine, load_dir: str | os.PathLike, tag: str | None = None) -> None:
    """Raise ``ValueError`` when checkpoint ``tag`` of ``load_dir`` (default: ``latest``) was saved on another grid."""
    if tag is not None or (Path(load_dir) / "latest").is_file():  # else DeepSpeed finds nothing to load
        saved = read_record(tag_dir(load_dir, tag))
        if saved is not None:
            check_same_grid(saved, engine_record(engine))
