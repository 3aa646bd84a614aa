"""What a parallelized model holds: its grid, its runtime and options, its tensors as dense ones
(:func:`grid_of`, :func:`dense_state_dict` and :func:`load_dense_state_dict` are :mod:`lightning_3d.layers.base`'s)."""

from __future__ import annotations

import dataclasses

from torch import nn

from ..agreement import agree
from ..grid import Grid
from ..layers.base import dense_state_dict, grid_of, load_dense_state_dict, modules_3d
from ..ops.async_tp import check_available
from ..options import RuntimeOptions
from ..runtime import Runtime

__all__ = [
    "check_options",
    "dense_state_dict",
    "grid_of",
    "load_dense_state_dict",
    "options_of",
    "runtime_of",
    "set_options",
]


def _runtimes(model: nn.Module) -> list[Runtime]:
    return list({id(m.runtime): m.runtime for m in modules_3d(model)}.values())


def runtime_of(model: nn.Module) -> Runtime:
    """The :class:`~lightning_3d.runtime.Runtime` the 3-D layers of ``model`` share (``parallelize`` made it)."""
    found = _runtimes(model)
    if len(found) > 1:
        raise ValueError(
            f"the 3-D layers of {type(model).__name__} hold {len(found)} different runtimes: "
            "layers built alone each run with their own; parallelize the model to give them one"
        )
    return found[0]


def options_of(model: nn.Module) -> RuntimeOptions:
    """The :class:`RuntimeOptions` the 3-D layers of ``model`` run with (fixed: :func:`set_options` changes them)."""
    found = {id(r.options): r.options for r in _runtimes(model)}
    if len(found) > 1:
        raise ValueError(
            f"the 3-D layers of {type(model).__name__} hold {len(found)} different RuntimeOptions; "
            "use lightning_3d.parallel.set_options(model, ...) to change them all"
        )
    return next(iter(found.values()))


def check_options(options: RuntimeOptions, grid: Grid) -> None:
    """``ValueError`` on every rank of the cube unless all of them pass equal ``options`` (ranks that ran different
    collectives would hang); then naming the fix when ``options`` cannot run on ``grid`` (collective matmuls that
    this device or torch lacks). Collective over the cube."""
    agree(
        dataclasses.asdict(options),
        grid.group("cube"),
        "RuntimeOptions",
        "every rank must run with the same options: set them alike on all ranks (parallelize(options=...), "
        "set_options(model, ...), Tensor3DStrategy(options=...))",
    )
    if options.async_tp:
        check_available(grid.mesh.device_type, grid.cube_size, grid.axes_across_nodes)


def set_options(model: nn.Module, **changes) -> None:
    """Change how the 3-D layers of ``model`` run (``set_options(model, async_tp=True)``): the runtime
    of every layer applies its options with ``changes`` (the model's weight prefetch follows them),
    from the next call on.

    Collective over the cube: every rank calls it with the same changes (checked)."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(RuntimeOptions)}
    if unknown:
        raise ValueError(
            f"unknown RuntimeOptions fields {sorted(unknown)}; fields: "
            f"{[f.name for f in dataclasses.fields(RuntimeOptions)]}"
        )
    runtimes = _runtimes(model)
    if not runtimes:
        raise ValueError(
            f"set_options: {type(model).__name__} holds no 3-D layers to run with options; build them "
            "(configure_model, GPT3D, ...) or parallelize the model first"
        )
    check_options(RuntimeOptions(**changes), grid_of(model))
    for runtime in runtimes:
        runtime.apply(dataclasses.replace(runtime.options, **changes))
