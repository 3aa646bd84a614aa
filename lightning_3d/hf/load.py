"""``from_pretrained``: a Hugging Face folder straight onto the grid, one tensor at a time.

The model is built on ``meta`` from the folder's ``config.json``; ``parallelize`` then fills each
module's full tensors, in state-dict order, from the folder's safetensors files (read lazily, one
tensor at a time), keeps this rank's shards and frees them: no rank ever holds the whole model.
Only ``config.json``, ``generation_config.json`` and ``*.safetensors`` are read; nothing read runs code.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from ..grid import Grid
from ..options import RuntimeOptions
from ..parallel import Plan, find_plan, parallelize

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class FolderTensors:
    """The tensors of a Hugging Face folder's safetensors files, by key, read one at a time."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if (self.path / INDEX_FILE).is_file():
            self.files = json.loads((self.path / INDEX_FILE).read_text())["weight_map"]
        elif (self.path / SINGLE_FILE).is_file():
            from safetensors import safe_open

            with safe_open(self.path / SINGLE_FILE, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(f"{self.path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.path / self.files[key], framework="pt") as f:
            return f.get_tensor(key)


def _computed_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Non-persistent buffers that no file holds, computed on the CPU: the rotary tables of Llama-like models."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return {}
    fresh = type(rotary)(config=model.config)
    return {f"model.rotary_emb.{name}": b for name, b in fresh.named_buffers()}


def folder_init(model: nn.Module, tensors: FolderTensors):
    """A plan ``init(name, tensor)`` that fills each full tensor from the folder (or computes a rotary table)."""
    computed = _computed_buffers(model)

    def init(name: str, tensor: torch.Tensor) -> None:
        if name in tensors:
            full = tensors.read(name)
        elif name in computed:
            full = computed[name]
        else:
            raise ValueError(f"{tensors.path} holds no tensor {name!r} of {type(model).__name__}")
        if tuple(full.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{name}: {tensors.path} holds shape {list(full.shape)}, {type(model).__name__} expects "
                f"{list(tensor.shape)}"
            )
        with torch.no_grad():
            tensor.copy_(full)

    return init


def from_pretrained(
    path: str | os.PathLike,
    *,
    grid: Grid | None = None,
    plan: Plan | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    options: RuntimeOptions | None = None,
) -> nn.Module:
    """A ``transformers`` causal LM from a local folder, parallelized without ever being whole on a rank.

    Call it on every rank. Like ``AutoModelForCausalLM.from_pretrained(path)`` followed by
    :func:`lightning_3d.parallelize`, but each rank reads one tensor at a time and keeps its shards
    only (peak: the shards plus the largest tensor).

    Args:
        path: a folder with ``config.json`` and ``model.safetensors`` (or its sharded index).
        grid: defaults to the current grid.
        plan: defaults to the built-in plan of the config's model class.
        dtype: of the parameters (the file's are cast); default ``torch.get_default_dtype()``.
        device: where the shards go; default torch's default device.
        options: the run-time options; default the plan's.

    Returns:
        The parallelized model, in training mode.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    tensors = FolderTensors(path)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype if dtype is not None else torch.get_default_dtype()
        )
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    plan = dataclasses.replace(
        plan if plan is not None else find_plan(model), init=folder_init(model, tensors)
    )
    return parallelize(model, plan, grid=grid, device=device, options=options)
