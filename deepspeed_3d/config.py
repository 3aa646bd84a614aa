"""The ``"tensor3d"`` section of a DeepSpeed config and the checks that tie the config to the grid.

.. code-block:: json

    {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
     "tensor3d": {"grid": [2, 2, 1], "options": {"async_tp": true}}}

``options`` (optional): fields of the model's ``lightning_3d.RuntimeOptions`` that ``initialize`` sets
on every 3-D layer (``lightning_3d.parallel.set_options``); the others stay as the model was built.
Every rank of one cube sees the same micro-batch, so DeepSpeed's batch arithmetic runs over the
data-parallel size ``dp = world / (px·py·pz)``, not over the world size.
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
_SECTION_KEYS = {"grid", "options"}


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
            f'the "{SECTION}" section must be {{"grid": [px, py, pz]}} with an optional '
            f'"options": {{<RuntimeOptions fields>}}, got {section!r}'
        )
    try:
        return arguments.grid_shape(section["grid"])
    except ValueError as e:
        raise ValueError(f'"{SECTION}": {{"grid": [px, py, pz]}}: {e}') from None


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
    shape = grid_shape(config)
    if not dist.is_initialized():
        deepspeed.init_distributed()
    current = current_grid()
    if current is not None:
        if shape is not None and tuple(current.shape) != shape:
            px, py, pz = current.shape
            raise ValueError(
                f'the config asks for "{SECTION}": {{"grid": {list(shape)}}} but the current grid is {px}×{py}×{pz}; '
                f'build the model on the grid of the config, or set "grid": {[px, py, pz]} (or drop the section)'
            )
        return current
    if shape is None:
        raise ValueError(
            f'no grid: add "{SECTION}": {{"grid": [px, py, pz]}} to the DeepSpeed config '
            f"or call lightning_3d.init_grid((px, py, pz)) before building the model"
        )
    return lightning_3d.init_grid(shape)


def check_batch_size(config: dict[str, Any], grid: Grid) -> None:
    """Raise ``ValueError`` unless ``train_batch_size = micro_batch × accumulation × dp`` can hold."""
    dp = grid.data_parallel_size
    total = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps")
    px, py, pz = grid.shape
    dp_note = f"dp = world {dp * grid.cube_size} / (px·py·pz = {px}·{py}·{pz}) = {dp}"
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
