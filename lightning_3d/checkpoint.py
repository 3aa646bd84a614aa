"""Sharded checkpoints of 3-D models (``torch.distributed.checkpoint``) and their dense export.

A checkpoint is a directory:

- ``.metadata`` and ``*.distcp`` (DCP): ``state_dict.<name>`` for every entry of the module's
  state dict, ``optimizer_<i>.state.<param name>.<key>`` for optimizer state. Each rank writes
  only its own shards, and any grid can read any part back.
- ``layout.json``: the grid it was written on and the dense shapes for export (see below).
- ``rng/<rank>.pt``: each rank's RNG states.
- whatever else the caller adds (the Lightning strategy writes ``meta.pt``: loop state, param
  groups, hyper-parameters).

Every sharded tensor is saved as a DTensor view whose global shape and chunks come from its
:class:`~lightning_3d.sharding.ShardSpec`. (DCP keeps one copy of a key that several ranks save,
so plain tensors under one name would silently lose all shards but one.) A ShardSpec cuts a dim
by several axes outer to inner (a z→y weight's rows: y blocks, each cut by x), while DTensor cuts
a dim by its ``Shard`` placements in mesh-dim order. So each view lives on a DeviceMesh over the
same ranks with the dims permuted: dp, then the spec's cutting axes outer to inner, then the
replicating axes. Replicated copies (dp, replicating axes) are the same chunk and written once.

Dense export: the global tensor of a key is usually the dense model's tensor. A module whose
global tensors differ (GPT3D pads the vocabulary rows and views fused weights as groups) declares
``dense_shapes = {key: dense shape}``; export keeps the leading rows that fit and reshapes.

Command line: ``python -m lightning_3d.checkpoint to-dense CKPT OUT.pt [--prefix model.]``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    FileSystemReader,
    TensorStorageMetadata,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .grid import MESH_AXES, Grid
from .sharding import ShardSpec, get_spec

MODEL_KEY = "state_dict"
LAYOUT_FILE = "layout.json"
RNG_DIR = "rng"

_meshes: weakref.WeakKeyDictionary[Grid, dict[tuple[str, ...], DeviceMesh]] = weakref.WeakKeyDictionary()


def optimizer_key(index: int) -> str:
    """Top-level key of optimizer ``index``'s state."""
    return f"optimizer_{index}"


# ----- DTensor views -----


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
        raise ValueError(f"a shard of {spec.describe(grid)} must have shape {list(spec.local_shape(grid))}, got {list(local.shape)}")
    cutting = tuple(a for axes in spec.dims for a in axes)
    order = ("dp",) + cutting + tuple(spec.replicated_axes)
    placements = [Replicate()] + [Shard(d) for d, axes in enumerate(spec.dims) for _ in axes] + [Replicate()] * len(spec.replicated_axes)
    stride = tuple(math.prod(spec.global_shape[d + 1:]) for d in range(len(spec.global_shape)))
    return DTensor.from_local(local.detach(), _permuted_mesh(grid, order), placements, run_check=False,
                              shape=torch.Size(spec.global_shape), stride=stride)


def _view(t: torch.Tensor, grid: Grid) -> torch.Tensor:
    spec = get_spec(t)
    return t.detach() if spec is None else sharded_view(t, spec, grid)


def model_state(module: nn.Module, grid: Grid) -> dict[str, torch.Tensor]:
    """The module's state dict with every 3-D tensor as a DTensor view (no copies, no communication)."""
    return {k: _view(v, grid) for k, v in module.state_dict(keep_vars=True).items()}


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(param)`` → its (first) name in ``module``."""
    return {id(p): name for name, p in module.named_parameters()}


def _state_view(value, param: torch.Tensor, grid: Grid, what: str):
    spec = get_spec(param)
    if not isinstance(value, torch.Tensor) or spec is None or value.dim() == 0:
        return value
    if value.shape != param.shape:
        raise ValueError(f"{what}: shape {list(value.shape)} is neither a scalar nor the parameter's shard shape "
                         f"{list(param.shape)}, so it cannot be resharded; use an optimizer with elementwise state (SGD, Adam, AdamW)")
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
                state[name] = {k: _state_view(v, p, grid, f"optimizer state {k!r} of {name}") for k, v in optimizer.state[p].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


# ----- RNG -----


def rng_state() -> dict:
    """This process's Python, torch (CPU and its current CUDA device) and NumPy RNG states."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy
    except ImportError:
        return state
    state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


# ----- save / load -----


def dense_shapes(module: nn.Module) -> dict[str, list[int]]:
    """Dense shapes declared by submodules (``dense_shapes`` attribute), under the module's state-dict keys."""
    out = {}
    for prefix, sub in module.named_modules():
        declared = getattr(sub, "dense_shapes", None)
        if isinstance(declared, dict):
            out.update({(f"{prefix}.{k}" if prefix else k): list(shape) for k, shape in declared.items()})
    return out


def save(path: str | Path, tensors: dict, grid: Grid, module: nn.Module) -> None:
    """Write ``tensors`` (``{"state_dict": model_state(...), "optimizer_0": ...}``) as a sharded checkpoint.

    Collective over the world. Also writes ``layout.json`` (global rank 0) and this rank's RNG state.
    """
    path = Path(path)
    dcp.save(tensors, checkpoint_id=path)
    rank = dist.get_rank()
    (path / RNG_DIR).mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path / RNG_DIR / f"{rank}.pt")
    if rank == 0:
        layout = {"grid": list(grid.shape), "data_parallel_size": grid.data_parallel_size,
                  "world_size": dist.get_world_size(), "dense_shapes": dense_shapes(module)}
        (path / LAYOUT_FILE).write_text(json.dumps(layout, indent=1))


def read_layout(path: str | Path) -> dict:
    """The ``layout.json`` of a checkpoint; ``ValueError`` when ``path`` is not a sharded checkpoint."""
    path = Path(path)
    if not (path / LAYOUT_FILE).is_file() or not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a lightning_3d sharded checkpoint (a directory with .metadata and {LAYOUT_FILE})")
    return json.loads((path / LAYOUT_FILE).read_text())


def load_rng_state(path: str | Path, grid: Grid) -> dict:
    """This rank's saved RNG state when the checkpoint was written on the same grid, else rank 0's."""
    layout = read_layout(path)
    same = layout["grid"] == list(grid.shape) and layout["data_parallel_size"] == grid.data_parallel_size
    rank = dist.get_rank() if same else 0
    return torch.load(Path(path) / RNG_DIR / f"{rank}.pt", weights_only=False)


def load_model_(module: nn.Module, grid: Grid, path: str | Path, strict: bool = True) -> None:
    """Load the module's state (any grid's checkpoint) in place. Collective over the world."""
    dcp.load({MODEL_KEY: model_state(module, grid)}, checkpoint_id=Path(path),
             planner=DefaultLoadPlanner(allow_partial_load=not strict))


def _placeholder(md, param: torch.Tensor, grid: Grid):
    if not isinstance(md, TensorStorageMetadata):
        return None
    spec = get_spec(param)
    dtype = md.properties.dtype
    if spec is not None and tuple(md.size) == spec.global_shape:
        return sharded_view(torch.empty(spec.local_shape(grid), dtype=dtype, device=param.device), spec, grid)
    return torch.empty(md.size, dtype=dtype, device=param.device if len(md.size) else "cpu")


def load_optimizer_(
    optimizer: torch.optim.Optimizer,
    index: int,
    names: dict[int, str],
    grid: Grid,
    path: str | Path,
    param_groups: list[dict],
    holds_state: Callable[[torch.Tensor], bool] = lambda p: True,
) -> None:
    """Load optimizer ``index``'s state (any grid's checkpoint) into ``optimizer``. Collective over the world.

    Args:
        names: parameter names, as :func:`parameter_names` returns them.
        param_groups: the saved ``param_groups`` of :func:`optimizer_state` (hyper-parameters are
            restored by group position; the groups must hold the same parameter names).
        holds_state: whether this rank keeps the state of a parameter (a ZeRO partition).
    """
    key = optimizer_key(index)
    if len(param_groups) != len(optimizer.param_groups):
        raise ValueError(f"{key}: the checkpoint has {len(param_groups)} param groups, the optimizer {len(optimizer.param_groups)}")
    by_name = {}
    for saved, group in zip(param_groups, optimizer.param_groups):
        own = [names[id(p)] for p in group["params"]]
        if sorted(own) != sorted(saved["params"]):
            raise ValueError(f"{key}: a param group holds {own} but the checkpoint's holds {saved['params']}")
        by_name.update(zip(own, group["params"]))
    prefix = f"{key}.state."
    wanted: dict[str, dict] = {}
    for fqn, md in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        name, _, k = fqn[len(prefix):].rpartition(".")
        if name in by_name and holds_state(by_name[name]):
            wanted.setdefault(name, {})[k] = _placeholder(md, by_name[name], grid)
    dcp.load({key: {"state": wanted}}, checkpoint_id=Path(path))
    for name, values in wanted.items():
        optimizer.state[by_name[name]] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in values.items()}
    for saved, group in zip(param_groups, optimizer.param_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


# ----- dense export -----


def global_to_dense(full: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Keep the leading rows that make up ``shape`` (drops padding), then reshape."""
    row = math.prod(full.shape[1:])
    need = math.prod(shape)
    if need % row or need // row > full.shape[0]:
        raise ValueError(f"cannot make a dense tensor of shape {shape} from a global tensor of shape {list(full.shape)}")
    return full[: need // row].reshape(shape)


def to_dense(path: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The dense state dict of a sharded checkpoint, in one process (no process group needed).

    Args:
        prefix: keep the keys that start with it and drop it (``"model."`` for a LightningModule
            whose 3-D model is ``self.model``); ``""`` keeps every key.
    """
    path = Path(path)
    shapes = read_layout(path)["dense_shapes"]
    reader = FileSystemReader(str(path))
    head = f"{MODEL_KEY}."
    full = {fqn[len(head):]: torch.empty(md.size, dtype=md.properties.dtype)
            for fqn, md in reader.read_metadata().state_dict_metadata.items()
            if fqn.startswith(head + prefix) and isinstance(md, TensorStorageMetadata)}
    if not full:
        raise ValueError(f"{path} holds no model tensors under the prefix {prefix!r}")
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({MODEL_KEY: full}, storage_reader=reader, no_dist=True)
    return {k[len(prefix):]: global_to_dense(t, shapes[k]) if k in shapes else t for k, t in full.items()}


def save_dense(state: dict[str, torch.Tensor], output: str | Path) -> None:
    """Write a dense state dict (``torch.save``) and say what was written."""
    torch.save(state, output)
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({numel:,} values) to {output}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_3d.checkpoint", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dense = commands.add_parser("to-dense", help="write a sharded checkpoint's model as one dense state-dict file")
    dense.add_argument("checkpoint", help="sharded checkpoint directory")
    dense.add_argument("output", help="output file (torch.save of the state dict)")
    dense.add_argument("--prefix", default="", help="keep only keys starting with this and drop it, e.g. 'model.'")
    args = parser.parse_args(argv)
    save_dense(to_dense(args.checkpoint, args.prefix), args.output)


if __name__ == "__main__":
    main()
