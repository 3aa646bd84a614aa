"""A resumed run does not rewrite the checkpoint it started from (no Lightning import).

Lightning resuming from a checkpoint saved at an epoch end runs that epoch's end again, and
``ModelCheckpoint`` then saves the same step under the same name: the run would rewrite the one
checkpoint it depends on before taking a step. The strategies note where they resumed from and
skip a save of the same step to the same path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def resume_point(path, checkpoint: dict[str, Any]) -> tuple[Path, Any]:
    """``(path, global step)`` identifying a checkpoint loaded from, or saved to, ``path``."""
    return Path(path).resolve(), checkpoint.get("global_step")


def skip_message(path) -> str:
    return f"tensor3d: not rewriting {path}: this run resumed from it and has not taken a step since"
