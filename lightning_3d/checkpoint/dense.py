"""Dense export: a sharded checkpoint's model as one state dict of the dense twin, with its config.

The global tensor of a key is usually the dense model's tensor. A module whose global tensors
differ (GPT3D pads the vocabulary rows and views fused weights as groups) declares
``dense_shapes = {key: dense shape}``; export keeps the leading rows that fit and reshapes. A
weight the dense twin stores transposed (``[in, out]``: Hugging Face's ``Conv1D``) is listed in
``dense_transposed`` and exported so. The result is exactly the dense twin's ``state_dict()``.
Keys are those of the dense twin: the checkpoint's ``dense_root`` prefix (``"model."`` for a
LightningModule holding its model as ``self.model``) is dropped.

Output files: ``*.safetensors`` carries the config in its metadata (key ``lightning_3d``); any
other name is ``torch.save`` of the state dict with the config in ``<file>.json`` beside it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import TensorStorageMetadata

from ..dense_twin import global_to_dense
from .files import MODEL_KEY, RECORD_FILE, CheckpointError
from .store import verified_metadata
from .untrusted import load_dcp, load_weights_only

DENSE_FORMAT = "lightning_3d.dense/1"
INFO_KEY = "lightning_3d"


def dense_info(path: str | Path, prefix: str | None = None) -> dict[str, Any]:
    """``{"format", "prefix", "model", "config_class", "config"}`` of checkpoint ``path``'s dense twin.

    ``prefix=None`` takes the recorded dense root's; the rest is None unless ``prefix`` is its.
    """
    return root_info(json.loads((Path(path) / RECORD_FILE).read_text()).get("dense_root"), prefix)


def root_info(root: dict[str, Any] | None, prefix: str | None = None) -> dict[str, Any]:
    """:func:`dense_info` from a recorded dense root (:func:`~lightning_3d.checkpoint.dense_root`; None: the
    whole module)."""
    root = root or {"prefix": ""}
    if prefix is None:
        prefix = root["prefix"]
    same = prefix == root["prefix"]
    return {
        "format": DENSE_FORMAT,
        "prefix": prefix,
        **{k: root.get(k) if same else None for k in ("model", "config_class", "config")},
    }


def to_dense(path: str | Path, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The dense state dict of a sharded checkpoint, in one process (no process group needed).

    Every file is first checked against the manifest.

    Args:
        prefix: keep the keys that start with it and drop it; default: the recorded dense root's
            (``"model."`` for a LightningModule whose model is ``self.model``); ``""`` keeps every key.
    """
    path = Path(path)
    metadata = verified_metadata(path, collective=False)
    prefix = dense_info(path, prefix)["prefix"]
    record = json.loads((path / RECORD_FILE).read_text())
    shapes, transposed, orders = (
        record["dense_shapes"],
        set(record.get("dense_transposed", ())),
        record.get("dense_row_orders", {}),
    )
    head = f"{MODEL_KEY}."
    full = {
        fqn[len(head) :]: torch.empty(md.size, dtype=md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(head + prefix) and isinstance(md, TensorStorageMetadata)
    }
    if not full:
        raise CheckpointError(f"{path} holds no model tensors under the prefix {prefix!r}")
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        load_dcp({MODEL_KEY: full}, path, no_dist=True)
    return {
        k[len(prefix) :]: global_to_dense(t, shapes.get(k), k in transposed, orders.get(k))
        for k, t in full.items()
    }


def save_dense(
    state: dict[str, torch.Tensor], output: str | Path, info: dict[str, Any] | None = None
) -> None:
    """Write a dense state dict with ``info`` (:func:`dense_info`) beside it, and say what was written."""
    output = Path(output)
    text = json.dumps(info or {"format": DENSE_FORMAT, "config": None})
    if output.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: t.contiguous() for k, t in state.items()}, output, metadata={INFO_KEY: text})
    else:
        torch.save(state, output)
        Path(f"{output}.json").write_text(text)
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({numel:,} values) to {output}")


def read_dense(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The state dict and info :func:`save_dense` wrote (info None when there is none); runs no code."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            info = (f.metadata() or {}).get(INFO_KEY)
            state = {k: f.get_tensor(k) for k in f.keys()}
        return state, json.loads(info) if info else None
    side = Path(f"{path}.json")
    return load_weights_only(path), json.loads(side.read_text()) if side.is_file() else None
