"""A module's extra state (``get_extra_state``) in a checkpoint: a tensor, or its JSON text.

``nn.Module.state_dict`` holds whatever ``get_extra_state`` returns under ``<prefix>_extra_state``.
A checkpoint must load without unpickling arbitrary classes, so a tensor is saved as it is and plain
data (dicts with string keys, lists, strings, numbers, booleans, None) as its JSON text, an entry
DCP reads back as a ``str``; anything else is refused when saving. Loading hands the decoded value
to the module's ``set_extra_state``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .files import CheckpointError

SUFFIX = "_extra_state"
"""The last part of an extra-state key in ``nn.Module.state_dict``."""


def extra_state_modules(module: nn.Module) -> dict[str, nn.Module]:
    """State-dict key → submodule, for each submodule that defines ``get_extra_state``."""
    return {
        f"{prefix}.{SUFFIX}" if prefix else SUFFIX: sub
        for prefix, sub in module.named_modules()
        if type(sub).get_extra_state is not nn.Module.get_extra_state
    }


def encode(key: str, value: Any, owner: nn.Module) -> torch.Tensor | str:
    """``value`` (from ``owner.get_extra_state()``, under ``key``) as a checkpoint holds it."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        text = json.dumps(value, allow_nan=False)
        kept = json.loads(text) == value
    except (TypeError, ValueError):
        kept = False
    if not kept:
        raise CheckpointError(
            f"{key}: {type(owner).__name__}.get_extra_state() returned {_shown(value)}, which a checkpoint cannot hold "
            f"safely (loading must not unpickle arbitrary objects). Return a tensor or plain JSON data from "
            f"get_extra_state (dicts with str keys, lists, str, int, float, bool, None; no tuples, NaN or objects) "
            f"and rebuild the rest in set_extra_state"
        )
    return text


def decode(key: str, saved: Any) -> Any:
    """The value for ``set_extra_state`` of what a checkpoint held under ``key``."""
    if isinstance(saved, torch.Tensor):
        return saved
    if isinstance(saved, str):
        try:
            return json.loads(saved)
        except ValueError as e:
            raise CheckpointError(
                f"the checkpoint's {key} is not the JSON text of an extra state: {e}"
            ) from None
    raise CheckpointError(
        f"the checkpoint's {key} holds {_shown(saved)}, not a tensor or the JSON text of an extra state"
    )


def restore_(
    module: nn.Module, loaded: dict[str, Any], saved_key: Callable[[str], str] = lambda key: key
) -> None:
    """Give every submodule with extra state its value from ``loaded`` (keys mapped by ``saved_key``), where present."""
    for key, sub in extra_state_modules(module).items():
        if saved_key(key) in loaded:
            sub.set_extra_state(decode(saved_key(key), loaded[saved_key(key)]))


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{text[:60] + '...' if len(text) > 60 else text} (a {type(value).__name__})"
