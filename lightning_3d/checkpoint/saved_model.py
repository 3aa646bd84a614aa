"""A checkpoint's sharding record, ``layout.json``: the grid it was written on and the model's true
shapes; the check that a checkpoint fits the model it is loaded into.

``layout.json`` holds ``grid``, ``data_parallel_size``, ``pipeline_size``, ``world_size``,
``dense_shapes`` (the true shape of every key whose global tensor differs, of every pipeline stage:
GPT3D's padded vocabulary rows, fused weights viewed as groups), ``dense_transposed`` (the keys the
dense twin stores transposed: Hugging Face ``Conv1D`` weights, ``[in, out]``), ``dense_row_orders``
(the keys whose dense twin orders the rows otherwise: LitGPT's grouped query heads; all three as
:mod:`lightning_3d.dense_twin` collects them) and ``dense_root``: the model inside the saved module
(its state-dict ``prefix``, class and config, see :func:`dense_root`), so the dense twin's keys,
layouts and hyper-parameters are known without the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..sharding import get_spec
from .files import CheckpointError

_SHOWN = 6


def dense_root(module: nn.Module) -> dict[str, Any]:
    """``{"prefix", "model", "config_class", "config"}`` of the model inside ``module`` whose dense twin to export.

    That is the outermost submodule with a ``config`` attribute that holds every 3-D parameter
    (a LightningModule's ``self.model``: a GPT3D, a parallelized Hugging Face model), else
    ``module`` itself. ``config`` is the config as JSON-ready data (a dataclass's fields, or a
    Hugging Face config's ``to_dict()``), or None. A module that stands for another model (pipeline
    stages: ``PipelinedModel``) names that model's class in ``whole_model_class``.
    """
    sharded = [name for name, p in module.named_parameters() if get_spec(p) is not None]
    for name, sub in module.named_modules():  # outermost first
        prefix = f"{name}." if name else ""
        config = getattr(sub, "config", None)
        if config is not None and all(p.startswith(prefix) for p in sharded):
            return {
                "prefix": prefix,
                "model": getattr(sub, "whole_model_class", type(sub).__name__),
                "config_class": type(config).__name__,
                "config": _plain(config),
            }
    return {"prefix": "", "model": type(module).__name__, "config_class": None, "config": None}


def _plain(config: Any) -> dict | None:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else None


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:_SHOWN]) + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def check_fits(
    path: object,
    saved: dict[str, list[int]],
    saved_dense: dict[str, list[int]],
    own: dict[str, list[int]],
    own_dense: dict[str, list[int]],
    strict: bool,
) -> None:
    """Refuse a checkpoint whose tensors do not fit the model, naming both shapes.

    Args:
        saved, own: global shapes by state-dict key, of the checkpoint and of the model.
        saved_dense, own_dense: the true (dense) shapes where they differ from the global ones.
        strict: also refuse keys that only one side has.
    """
    differ = []
    for key in sorted(saved.keys() & own.keys()):
        was, now = saved_dense.get(key, saved[key]), own_dense.get(key, own[key])
        if was != now:
            differ.append(f"checkpoint holds {key} {was}; this model has {now}")
        elif saved[key] != own[key]:
            differ.append(
                f"checkpoint holds {key} as a global tensor of {saved[key]}; this model's is {own[key]} "
                f"(a different padding: GPTConfig.vocab_multiple)"
            )
    if differ:
        raise CheckpointError(
            f"{path} was saved from another model: "
            + "; ".join(differ[:_SHOWN])
            + (f"; and {len(differ) - _SHOWN} more" if len(differ) > _SHOWN else "")
        )
    missing, unexpected = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
    if strict and (missing or unexpected):
        parts = ([f"this model's {_names(missing)} are not in it"] if missing else []) + (
            [f"it holds {_names(unexpected)}, which this model lacks"] if unexpected else []
        )
        raise CheckpointError(
            f"{path} was saved from another model ({len(saved)} tensors, this model has {len(own)}): "
            + "; ".join(parts)
            + ". Load the tensors both have with strict loading off "
            "(LightningModule.strict_loading = False)"
        )
