"""The grid's arguments, checked by type and never coerced: a wrong value is a ``ValueError`` that names the fix.

:func:`~lightning_3d.init_grid` and ``Tensor3DStrategy`` both check with these functions, so they
accept exactly the same values. A grid is a sequence of three ints: strings such as ``"2x2x1"`` or
``"221"`` are refused, not parsed, so that a grid has one spelling everywhere.
"""

from __future__ import annotations

import datetime
import math
import operator
from collections.abc import Sequence

GRID_FORM = "three positive ints (px, py, pz), e.g. (2, 2, 1)"


def _kind(value: object) -> str:
    return type(value).__name__


def _as_int(value: object) -> int | None:
    """``value`` as an int if it is one (any integer type but bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def grid_shape(value: object) -> tuple[int, int, int]:
    """``(px, py, pz)`` from a sequence of three positive ints (a tuple, list or ``torch.Size``)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        hint = ": strings are not parsed, pass a tuple" if isinstance(value, (str, bytes)) else ""
        raise ValueError(f"grid shape must be {GRID_FORM}; got {value!r} (a {_kind(value)}{hint})")
    if len(value) != 3:
        raise ValueError(
            f"grid shape must be (px, py, pz), got {tuple(value)}: {len(value)} entries; pass {GRID_FORM}"
        )
    shape = tuple(_as_int(v) for v in value)
    for axis, (raw, v) in zip("xyz", zip(value, shape)):
        if v is None:
            raise ValueError(
                f"grid shape must be {GRID_FORM}; got {tuple(value)}: p{axis} = {raw!r} is a {_kind(raw)}"
            )
    if min(shape) < 1:
        raise ValueError(f"every grid axis must be >= 1, got (px, py, pz) = {shape}; pass {GRID_FORM}")
    return shape


def positive_int(value: object, name: str) -> int:
    """``value`` if it is an int >= 1 (not a bool)."""
    v = _as_int(value)
    if v is None or v < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r} (a {_kind(value)})")
    return v


def flag(value: object, name: str) -> bool:
    """``value`` if it is ``True`` or ``False``: ``"no"``, ``0`` or ``None`` are refused, not read as truth values."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r} (a {_kind(value)})")
    return value


def choice(value: object, name: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r} (a {_kind(value)})")
    return value


def timeout(value: object) -> datetime.timedelta:
    """A positive, finite collective timeout: a ``timedelta`` or a number of seconds."""
    fix = "pass e.g. timedelta(minutes=10) or 600 (seconds)"
    if isinstance(value, datetime.timedelta):
        if value <= datetime.timedelta(0):
            raise ValueError(
                f"timeout must be positive, got {value!r}: every collective would fail at once; {fix}"
            )
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"timeout must be a timedelta or a number of seconds, got {value!r} (a {_kind(value)}); {fix}"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {value!r}; {fix}")
    try:
        return datetime.timedelta(seconds=value)
    except OverflowError:
        raise ValueError(f"timeout of {value!r} s is longer than a timedelta can hold; {fix}") from None
