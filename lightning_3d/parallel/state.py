"""What a parallelized model holds: its grid, its runtime and options, its tensors as dense ones."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..agreement import agree
from ..grid import Grid
from ..layers.base import Module3D
from ..layers.base import dense_state_dict as _dense_state_dict
from ..layers.base import load_dense_state_dict as _load_dense_state_dict
from ..ops.async_tp import check_available
from ..options import RuntimeOptions
from ..runtime import Runtime


def _layers(model: nn.Module) -> list[Module3D]:
    layers = [m for m in model.modules() if isinstance(m, Module3D)]
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no 3-D layers: call lightning_3d.parallelize(model) first")
    return layers


def grid_of(model: nn.Module) -> Grid:
    """The grid the 3-D layers of ``model`` live on."""
    grids = {id(m.grid): m.grid for m in _layers(model)}
    if len(grids) > 1:
        raise ValueError(f"{type(model).__name__} has 3-D layers on {len(grids)} different grids: {list(grids.values())}")
    return next(iter(grids.values()))


def _runtimes(model: nn.Module) -> list[Runtime]:
    return list({id(m.runtime): m.runtime for m in _layers(model)}.values())


def runtime_of(model: nn.Module) -> Runtime:
    """The :class:`~lightning_3d.runtime.Runtime` the 3-D layers of ``model`` share (``parallelize`` made it)."""
    found = _runtimes(model)
    if len(found) > 1:
        raise ValueError(f"the 3-D layers of {type(model).__name__} hold {len(found)} different runtimes: "
                         "layers built alone each run with their own; parallelize the model to give them one")
    return found[0]


def options_of(model: nn.Module) -> RuntimeOptions:
    """The :class:`RuntimeOptions` the 3-D layers of ``model`` run with (fixed: :func:`set_options` changes them)."""
    found = {id(r.options): r.options for r in _runtimes(model)}
    if len(found) > 1:
        raise ValueError(f"the 3-D layers of {type(model).__name__} hold {len(found)} different RuntimeOptions; "
                         "use lightning_3d.parallel.set_options(model, ...) to change them all")
    return next(iter(found.values()))


def check_options(options: RuntimeOptions, grid: Grid) -> None:
    """``ValueError`` on every rank of the cube unless all of them pass equal ``options`` (ranks that ran different
    collectives would hang); then naming the fix when ``options`` cannot run on ``grid`` (collective matmuls that
    this device or torch lacks). Collective over the cube."""
    agree(dataclasses.asdict(options), grid.group("cube"), "RuntimeOptions",
          "every rank must run with the same options: set them alike on all ranks (parallelize(options=...), "
          "set_options(model, ...), Tensor3DStrategy(async_tp=...))")
    if options.async_tp:
        check_available(grid.mesh.device_type, grid.cube_size, grid.axes_across_nodes)


def set_options(model: nn.Module, **changes) -> None:
    """Change how the 3-D layers of ``model`` run (``set_options(model, async_tp=True)``): the runtime
    of every layer applies its options with ``changes`` (the model's weight prefetch follows them),
    from the next call on.

    Collective over the cube: every rank calls it with the same changes (checked)."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(RuntimeOptions)}
    if unknown:
        raise ValueError(f"unknown RuntimeOptions fields {sorted(unknown)}; fields: {[f.name for f in dataclasses.fields(RuntimeOptions)]}")
    check_options(RuntimeOptions(**changes), grid_of(model))
    for runtime in _runtimes(model):
        runtime.apply(dataclasses.replace(runtime.options, **changes))


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full dense state dict of a parallelized model under its original keys (vocabulary padding
    dropped, packed weights flattened), on every cube rank. Collective over the cube."""
    return _dense_state_dict(model, grid_of(model))


def load_dense_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load a dense state dict (the unparallelized model's, or :func:`dense_state_dict`'s from any grid)."""
    _load_dense_state_dict(model, state_dict, grid_of(model), strict)
