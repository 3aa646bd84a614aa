"""A ``DenseGPT`` rebuilt from a ``to-dense`` file alone: the file carries the model's config as data."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import CheckpointError, read_dense
from .config import GPTConfig
from .dense import DenseGPT


def dense_gpt(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> DenseGPT:
    """A ``DenseGPT`` built and loaded from a ``to-dense`` file alone (its config travels with it as JSON)."""
    state, info = read_dense(path)
    info = info or {}
    if info.get("config_class") != GPTConfig.__name__ or info.get("config") is None:
        raise CheckpointError(
            f"{path} carries no GPTConfig (it holds {info.get('model') or 'an unknown model'}, or was "
            f"written by an older to-dense); build the model yourself and load_state_dict the tensors"
        )
    model = DenseGPT(GPTConfig(**info["config"]), device=device, dtype=dtype)
    model.load_state_dict(state)
    return model
