"""Model and optimizer state as DTensor views whose global shape and chunks come from each ShardSpec.

DCP keeps one copy of a key that several ranks save, so plain tensors under one name would
silently lose all shards but one. A ShardSpec cuts a dim by several axes outer to inner (a z→y
weight's rows: y blocks, each cut by x), while DTensor cuts a dim by its ``Shard`` placements in
mesh-dim order. So each view lives on a DeviceMesh over the same ranks with the dims permuted: dp,
then the spec's cutting axes outer to inner, then the replicating axes. Replicated copies (dp,
replicating axes) are the same chunk and written once.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..grid import MESH_AXES, Grid
from ..sharding import ShardSpec, get_spec
from . import extra_state

_meshes: weakref.WeakKeyDictionary[Grid, dict[tuple[str, ...], DeviceMesh]] = weakref.WeakKeyDictionary()


def _permuted_mesh(grid: Grid, order: tuple[str, ...]) -> DeviceMesh:
    """The grid's ranks as a DeviceMesh with its dims in ``order`` (no process groups are created)."""
    cache = _meshes.setdefault(grid, {})
    if order not in cache:
        ranks = grid.mesh.mesh.permute([MESH_AXES.index(a) for a in order]).contiguous()
        cache[order] = DeviceMesh(grid.mesh.device_type, ranks, mesh_dim_names=order, _init_backend=False)
    return cache[order]


def sharded_view(local: torch.Tensor, spec: ShardSpec, grid: Grid) -> DTensor:
    """A DTensor sharing ``local``'s storage, placed on the grid as ``spec`` says."""
    if tuple(local.shape) != spec.local_shape(grid):
        raise ValueError(
            f"a shard of {spec.describe(grid)} must have shape {list(spec.local_shape(grid))}, got {list(local.shape)}"
        )
    cutting = tuple(a for axes in spec.dims for a in axes)
    order = ("dp",) + cutting + tuple(spec.replicated_axes)
    placements = (
        [Replicate()]
        + [Shard(d) for d, axes in enumerate(spec.dims) for _ in axes]
        + [Replicate()] * len(spec.replicated_axes)
    )
    stride = tuple(math.prod(spec.global_shape[d + 1 :]) for d in range(len(spec.global_shape)))
    return DTensor.from_local(
        local.detach(),
        _permuted_mesh(grid, order),
        placements,
        run_check=False,
        shape=torch.Size(spec.global_shape),
        stride=stride,
    )


def _view(t: torch.Tensor, grid: Grid) -> torch.Tensor:
    spec = get_spec(t)
    return t.detach() if spec is None else sharded_view(t, spec, grid)


def model_state(module: nn.Module, grid: Grid) -> dict[str, torch.Tensor | str]:
    """The module's state dict with every 3-D tensor as a DTensor view (no copies, no communication);
    extra state (``get_extra_state``) as :func:`.extra_state.encode` keeps it, or :class:`CheckpointError`."""
    extra = extra_state.extra_state_modules(module)
    return {
        k: extra_state.encode(k, v, extra[k]) if k in extra else _view(v, grid)
        for k, v in module.state_dict(keep_vars=True).items()
    }


def global_shapes(module: nn.Module) -> dict[str, list[int]]:
    """Every state-dict key's global shape (a 3-D tensor's from its spec)."""
    return {
        k: list(get_spec(v).global_shape if get_spec(v) is not None else v.shape)
        for k, v in module.state_dict(keep_vars=True).items()
        if isinstance(v, torch.Tensor)
    }


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(param)`` → its (first) name in ``module``; a pipeline stage's copy of another stage's
    parameter (``ShardSpec.copy_of``) goes by that parameter's name, whose optimizer state it shares."""
    names = {}
    for name, p in module.named_parameters():
        spec = get_spec(p)
        names[id(p)] = name if spec is None else spec.held_as(name)
    return names


def _state_view(value, param: torch.Tensor, grid: Grid, what: str):
    spec = get_spec(param)
    if not isinstance(value, torch.Tensor) or spec is None or value.dim() == 0:
        return value
    if value.shape != param.shape:
        raise ValueError(
            f"{what}: shape {list(value.shape)} is neither a scalar nor the parameter's shard shape "
            f"{list(param.shape)}, so it cannot be resharded; use an optimizer with elementwise state (SGD, "
            "Adam, AdamW)"
        )
    return sharded_view(value, spec, grid)


def optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str], grid: Grid) -> dict:
    """``{"state": {param name: {key: value}}, "param_groups": [... "params": [names]]}``.

    State tensors shaped like their 3-D parameter become DTensor views of the parameter's layout;
    scalars (``step``) and state of plain parameters stay as they are.
    """
    state = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer.state:
                name = names[id(p)]
                state[name] = {
                    k: _state_view(v, p, grid, f"optimizer state {k!r} of {name}")
                    for k, v in optimizer.state[p].items()
                }
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}
