"""The ``"tensor3d"`` section of a DeepSpeed config and the checks that tie the config to the grid.

.. code-block:: json

    {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
     "tensor3d": {"grid": [2, 2, 1], "pipeline_size": 1, "options": {"async_tp": true}}}

``options`` (optional): fields of the model's ``lightning_3d.RuntimeOptions`` that ``initialize`` sets
on every 3-D layer (``lightning_3d.parallel.set_options``); the others stay as the model was built.
``pipeline_size`` (optional, default 1): the grid's pipeline stages (``lightning_3d.init_grid(...,
pipeline_size=pp)``), with ZeRO stage 0 or 1 only, as DeepSpeed's pipeline engine allows; above 1,
:func:`~deepspeed_3d.initialize` splits the model into a DeepSpeed ``PipelineModule`` of that many
stages (:mod:`deepspeed_3d.pipeline`, which reads DeepSpeed's own ``"pipeline"`` section). Every rank
of one cube sees the same micro-batch, so DeepSpeed's batch arithmetic runs over the data-parallel size
``dp = world / (pp·px·py·pz)``, not over the world size.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

import deepspeed
import torch.distributed as dist

import lightning_3d
from lightning_3d import arguments
from lightning_3d.grid import Grid
from lightning_3d.options import RuntimeOptions

SECTION = "tensor3d"
_SECTION_KEYS = {"grid", "pipeline_size", "options"}


def load_config(config: dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A private copy of a DeepSpeed config given as a dict or as the path of a JSON file."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        if not os.path.isfile(config):
            raise ValueError(
                f"DeepSpeed config {os.fspath(config)!r} is not a file; pass a dict or the path of a JSON file"
            )
        with open(config) as f:
            return json.load(f)
    raise ValueError(f"config must be a dict or the path of a JSON file, got {type(config).__name__}")


def grid_shape(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """``(px, py, pz)`` from the ``"tensor3d"`` section, or None when the config has none."""
    section = config.get(SECTION)
    if section is None:
        return None
    if not isinstance(section, dict) or set(section) - _SECTION_KEYS or "grid" not in section:
        raise ValueError(
            f'the "{SECTION}" section must be {{"grid": [px, py, pz]}} with an optional "pipeline_size": pp '
            f'and "options": {{<RuntimeOptions fields>}}, got {section!r}'
        )
    try:
        return arguments.grid_shape(section["grid"])
    except ValueError as e:
        raise ValueError(f'"{SECTION}": {{"grid": [px, py, pz]}}: {e}') from None


def pipeline_size(config: dict[str, Any]) -> int:
    """The ``"tensor3d"`` section's ``"pipeline_size"`` (1 when absent), a positive int."""
    try:
        return arguments.positive_int((config.get(SECTION) or {}).get("pipeline_size", 1), "pipeline_size")
    except ValueError as e:
        raise ValueError(f'"{SECTION}": {{"pipeline_size": ...}}: {e}') from None


def check_zero_stage(config: dict[str, Any], grid: Grid) -> None:
    """Raise ``ValueError`` for ZeRO stage 2 or 3 on a grid of pipeline stages, which DeepSpeed's pipeline
    engine refuses too (each stage's gradients reduce once after the schedule, where ZeRO-2/3 partition them
    during every backward)."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if grid.pipeline_size > 1 and stage >= 2:
        raise ValueError(
            f'"zero_optimization": {{"stage": {stage}}} on a grid of {grid.pipeline_size} pipeline stages: ZeRO-2 '
            'and ZeRO-3 do not run with pipeline stages (DeepSpeed refuses them for pipelines too); set "stage": 1 '
            f'or 0, or "{SECTION}": {{"pipeline_size": 1}}'
        )


def runtime_options(config: dict[str, Any]) -> dict[str, Any]:
    """The ``"tensor3d"`` section's ``"options"``: the ``RuntimeOptions`` fields it changes (none when absent),
    checked as ``RuntimeOptions`` checks them."""
    options = (config.get(SECTION) or {}).get("options", {})
    fields = [f.name for f in dataclasses.fields(RuntimeOptions)]
    if not isinstance(options, dict):
        raise ValueError(
            f'"{SECTION}": {{"options": ...}} must map RuntimeOptions fields to values, e.g. '
            f'{{"async_tp": true}}; got {options!r}'
        )
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(
            f'"{SECTION}": {{"options": ...}}: {unknown} are not RuntimeOptions fields; fields: {fields}'
        )
    try:
        RuntimeOptions(**options)
    except ValueError as e:
        raise ValueError(f'"{SECTION}": {{"options": ...}}: {e}') from None
    return options


def current_grid() -> Grid | None:
    """The current grid (``lightning_3d.get_grid()``), or None when there is none."""
    try:
        return lightning_3d.get_grid()
    except RuntimeError:
        return None


def init_grid_from_config(config: dict[str, Any] | str | os.PathLike) -> Grid:
    """The grid the config asks for: the current grid when one exists (it must agree), else a new one.

    Initialises the default process group first when needed (``deepspeed.init_distributed()``:
    NCCL on CUDA, gloo on CPU). Raises ``ValueError`` when the section disagrees with the current
    grid, or when there is neither a section nor a current grid.
    """
    config = load_config(config)
    shape, pp = grid_shape(config), pipeline_size(config)
    if not dist.is_initialized():
        deepspeed.init_distributed()
    current = current_grid()
    if current is not None:
        if shape is not None and (tuple(current.shape), current.pipeline_size) != (shape, pp):
            px, py, pz = current.shape
            raise ValueError(
                f'the config asks for "{SECTION}": {{"grid": {list(shape)}, "pipeline_size": {pp}}} but the current '
                f"grid is {px}×{py}×{pz} in {current.pipeline_size} stage(s); build the model on the grid of the "
                f'config, or set "grid": {[px, py, pz]}, "pipeline_size": {current.pipeline_size} '
                "(or drop the section)"
            )
        return current
    if shape is None:
        raise ValueError(
            f'no grid: add "{SECTION}": {{"grid": [px, py, pz]}} to the DeepSpeed config '
            f"or call lightning_3d.init_grid((px, py, pz)) before building the model"
        )
    return lightning_3d.init_grid(shape, pipeline_size=pp)


def check_batch_size(config: dict[str, Any], grid: Grid) -> None:
    """Raise ``ValueError`` unless ``train_batch_size = micro_batch × accumulation × dp`` can hold."""
    dp = grid.data_parallel_size
    total = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps")
    px, py, pz = grid.shape
    pp = grid.pipeline_size
    stages = ("pp·", f"{pp}·") if pp > 1 else ("", "")
    dp_note = (
        f"dp = world {pp * dp * grid.cube_size} / ({stages[0]}px·py·pz = {stages[1]}{px}·{py}·{pz}) = {dp}"
    )
    if total is None:
        if micro is None:
            raise ValueError("the DeepSpeed config needs train_batch_size or train_micro_batch_size_per_gpu")
        return
    per_step = (micro or 1) * (accumulation or 1) * dp
    if micro is not None and accumulation is not None:
        if total != per_step:
            raise ValueError(
                f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} × gradient_accumulation_steps "
                f"{accumulation} × {dp_note} = {per_step}; set train_batch_size to {per_step} "
                f"(the ranks of one cube share a micro-batch, so only dp multiplies it)"
            )
    elif total % per_step:
        known = " × ".join(
            f"{k} {v}"
            for k, v in (
                ("train_micro_batch_size_per_gpu", micro),
                ("gradient_accumulation_steps", accumulation),
            )
            if v is not None
        )
        raise ValueError(
            f"train_batch_size {total} is not a multiple of {known + ' × ' if known else ''}{dp_note}, "
            f"so no whole number of micro-batches fills it; make train_batch_size a multiple of {per_step}"
        )


def keep_torch_linear(config: dict[str, Any]) -> None:
    """ZeRO-3: default ``"memory_efficient_linear"`` to false.

    With it on, DeepSpeed replaces ``torch.nn.functional.linear`` process-wide, for good, when the
    engine is made. The 3-D layers never call it (their products are ``lightning_3d.ops``), so
    the replacement would only change other code in the process. An explicit setting is kept.
    """
    zero = config.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("stage") == 3:
        zero.setdefault("memory_efficient_linear", False)
