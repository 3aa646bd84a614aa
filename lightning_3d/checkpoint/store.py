"""Writing a sharded checkpoint atomically, and reading it back on any grid after checking it."""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ..dense_twin import dense_row_orders, dense_shapes, dense_transposed
from ..grid import Grid
from ..sharding import get_spec
from . import extra_state, manifest
from .files import (
    DCP_METADATA,
    FORMAT,
    META_FILE,
    MODEL_KEY,
    RECORD_FILE,
    RNG_DIR,
    CheckpointError,
    optimizer_key,
    rng_file,
)
from .publish import publish, remove, staging_path
from .rng import rng_state
from .saved_model import check_fits, dense_root
from .stages import whole_model, whole_param_groups
from .untrusted import SafeReader, load_dcp, load_weights_only, read_dcp_metadata
from .views import global_shapes, model_state, sharded_view


def _gather(value, failure: str | None, what: str) -> list:
    """Every rank's ``value``; the same :class:`CheckpointError` on every rank if any rank reports a failure."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (value, failure))
    reported = [f"rank {r}: {f}" for r, (_, f) in enumerate(gathered) if f]
    if reported:
        raise CheckpointError(f"{what}: " + "; ".join(reported))
    return [v for v, _ in gathered]


def _dense_layouts(module: nn.Module, grid: Grid) -> dict:
    """The sharding record's true shapes and layouts of the whole model (every stage's keys). Collective over
    the ``"pipe"`` group."""
    own = {
        "dense_shapes": dense_shapes(module),
        "dense_transposed": dense_transposed(module),
        "dense_row_orders": dense_row_orders(module),
    }
    return whole_model(own, grid)


def _local_files(
    staging: Path, grid: Grid, module: nn.Module, layouts: dict, meta: dict | None, allowed: Sequence[type]
) -> None:
    """Write this rank's RNG file and, on rank 0, the sharding record (``layout.json``, with ``layouts`` of
    :func:`_dense_layouts`) and ``meta.pt``."""
    rank = dist.get_rank()
    manifest.write_durably(staging / rng_file(rank), json.dumps(rng_state()).encode())
    if rank:
        return
    record = {
        "format": FORMAT,
        "grid": list(grid.shape),
        "data_parallel_size": grid.data_parallel_size,
        "pipeline_size": grid.pipeline_size,
        "world_size": dist.get_world_size(),
        **layouts,
        "dense_root": dense_root(module),
    }
    manifest.write_durably(staging / RECORD_FILE, json.dumps(record, indent=1, default=str).encode())
    if meta is not None:
        buffer = io.BytesIO()
        torch.save(meta, buffer)
        manifest.write_durably(staging / META_FILE, buffer.getvalue())
        try:
            load_weights_only(staging / META_FILE, allowed=allowed)
        except CheckpointError as e:
            warnings.warn(f"this checkpoint's meta will load only when trusted: {e}", stacklevel=3)


def save(
    path: str | Path,
    tensors: dict,
    grid: Grid,
    module: nn.Module,
    meta: dict | None = None,
    allowed: Sequence[type] = (),
) -> None:
    """Write a sharded checkpoint at ``path``, visible only once complete. Collective over the world.

    Args:
        tensors: ``{"state_dict": model_state(...), "optimizer_0": {"state": ...}, ...}`` (DCP).
        module: the saved module (its dense shapes and dense root go into ``layout.json``); with pipeline
            stages, this rank's stages (each rank's ``tensors`` under the whole model's keys: the
            stages' true shapes are gathered over the ``"pipe"`` group, :mod:`.stages`).
        meta: anything else to keep (``meta.pt``, read back with weights-only unpickling:
            tensors, plain containers, numbers, strings, and the classes in ``allowed``).

    Every rank writes into a hidden staging directory; after all ranks' files are on disk and
    hashed (``world_size`` ways) rank 0 writes the manifest and renames the directory to ``path``
    in one step, replacing an existing checkpoint there. A failure on any rank raises on every rank
    and leaves ``path`` as it was.
    """
    path = Path(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    staging = staging_path(path)
    failure = None
    if rank == 0:
        try:
            remove(staging)
            (staging / RNG_DIR).mkdir(parents=True)
        except OSError as e:
            failure = f"cannot create {staging}: {e}"
    _gather(None, failure, f"cannot save a checkpoint at {path}")
    dcp.save(tensors, checkpoint_id=staging)
    layouts = _dense_layouts(module, grid)
    try:
        _local_files(staging, grid, module, layouts, meta, allowed)
    except OSError as e:
        failure = f"cannot write its files into {staging}: {e}"
    _gather(None, failure, f"no checkpoint was written at {path}")
    data_files = sorted({info.relative_path for info in read_dcp_metadata(staging).storage_data.values()})
    names = sorted(
        [DCP_METADATA]
        + data_files
        + [rng_file(r) for r in range(world)]
        + [RECORD_FILE]
        + ([META_FILE] if meta is not None else [])
    )
    try:
        part = {n: manifest.file_entry(staging, n) for n in names[rank::world]}
    except OSError as e:
        part, failure = {}, f"cannot read back what was written: {e}"
    entries = _gather(part, failure, f"no checkpoint was written at {path}")
    if rank == 0:
        try:
            manifest.write_manifest(staging, {n: e for p in entries for n, e in p.items()})
            publish(staging, path)
        except OSError as e:
            failure = f"cannot publish {staging} as {path}: {e}"
    _gather(None, failure, f"no checkpoint was written at {path}")


def read_record(path: str | Path) -> dict:
    """The sharding record (``layout.json``) of a complete checkpoint; :class:`CheckpointError` when ``path``
    is none."""
    path = Path(path)
    manifest.verify(path, [RECORD_FILE])
    return json.loads((path / RECORD_FILE).read_text())


def load_meta(path: str | Path, trusted: bool = False, allowed: Sequence[type] = ()) -> dict:
    """The ``meta`` given to :func:`save`, checked against the manifest and read without running code
    (classes beyond plain data: those in ``allowed``).

    ``trusted=True`` allows any class in it (``torch.load(weights_only=False)``): only for a
    checkpoint the caller vouches for.
    """
    path = Path(path)
    manifest.verify(path, [META_FILE])
    return load_weights_only(path / META_FILE, trusted=trusted, allowed=allowed)


def load_rng_state(path: str | Path, grid: Grid) -> dict:
    """This rank's saved RNG state when the checkpoint was written on the same grid (and stages), else rank 0's."""
    record = read_record(path)
    same = (
        record["grid"] == list(grid.shape)
        and record["data_parallel_size"] == grid.data_parallel_size
        and record.get("pipeline_size", 1) == grid.pipeline_size
    )
    name = rng_file(dist.get_rank() if same else 0)
    manifest.verify(path, [name])
    try:
        return json.loads((Path(path) / name).read_text())
    except ValueError as e:
        raise CheckpointError(f"{Path(path) / name} is not an RNG state file: {e}") from None


def _data_files_listed(path: Path, metadata) -> None:
    listed = manifest.read_manifest(path)["files"]
    unlisted = sorted({i.relative_path for i in metadata.storage_data.values()} - listed.keys())
    if unlisted:
        raise CheckpointError(f"{path}/.metadata refers to files the manifest does not list: {unlisted}")


def verified_metadata(path: str | Path, collective: bool):
    """Verify every file of checkpoint ``path`` against its manifest; its DCP metadata."""
    path = Path(path)
    manifest.verify(path, collective=collective)
    metadata = read_dcp_metadata(path)
    _data_files_listed(path, metadata)
    return metadata


def saved_shapes(metadata, key: str) -> dict[str, list[int]]:
    """Global shapes of the tensors saved under top-level ``key``, by their name inside it."""
    head = f"{key}."
    return {
        fqn[len(head) :]: list(md.size)
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(head) and isinstance(md, TensorStorageMetadata)
    }


def saved_key(path: str | Path, module: nn.Module) -> Callable[[str], str]:
    """``module``'s state-dict key → the key checkpoint ``path`` holds it under.

    The same model saved inside a LightningModule (``self.model``: keys ``model.…``) and set up
    alone in Fabric (keys ``…``) differ by the prefix of their dense root (:func:`dense_root`,
    recorded in ``layout.json``): keys under the module's root move to the saved root's prefix.
    """
    saved = read_record(path).get("dense_root", {}).get("prefix", "")
    own = dense_root(module)["prefix"]
    if saved == own:
        return lambda key: key
    return lambda key: saved + key[len(own) :] if key.startswith(own) else key


def load_model_(module: nn.Module, grid: Grid, path: str | Path, strict: bool = True) -> None:
    """Load the module's state (any grid's checkpoint) in place. Collective over the world.

    First every file is checked against the manifest (hashed ``world_size`` ways) and the saved
    model's true shapes against the module's; :class:`CheckpointError` names what differs.
    ``strict=False`` loads the tensors both have (shapes must still agree). Keys are matched
    through :func:`saved_key` (a model saved inside a LightningModule loads into the bare model,
    and the reverse). Submodules with extra state get theirs through ``set_extra_state``. With
    pipeline stages, ``module`` holds this rank's stages and the checks are of the whole model
    (keys and shapes gathered over the ``"pipe"`` group); each rank reads its own stages' tensors, so
    a checkpoint of any pipeline size loads.
    """
    path = Path(path)
    metadata = verified_metadata(path, collective=True)
    record = json.loads((path / RECORD_FILE).read_text())
    key = saved_key(path, module)
    own = whole_model(
        {
            "shapes": {key(k): v for k, v in global_shapes(module).items()},
            "dense_shapes": {key(k): v for k, v in dense_shapes(module).items()},
        },
        grid,
    )
    check_fits(
        path,
        saved_shapes(metadata, MODEL_KEY),
        record.get("dense_shapes", {}),
        own["shapes"],
        own["dense_shapes"],
        strict,
    )
    state = {
        key(k): v
        for k, v in model_state(module, grid).items()
        if strict or f"{MODEL_KEY}.{key(k)}" in metadata.state_dict_metadata
    }
    load_dcp({MODEL_KEY: state}, path, allow_partial_load=not strict)
    extra_state.restore_(module, state, key)


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

    Call it after :func:`load_model_`, which verifies the checkpoint.

    Args:
        names: parameter names, as :func:`parameter_names` returns them.
        param_groups: the saved ``param_groups`` of :func:`optimizer_state` (hyper-parameters are
            restored by group position; the groups must hold the same parameter names), with pipeline
            stages those of the whole model (:func:`~.stages.whole_param_groups`): each stage's optimizer
            holds its own parameters, and the stages' groups together must hold the saved names.
        holds_state: whether this rank keeps the state of a parameter (a ZeRO partition).
    """
    key = optimizer_key(index)
    own = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    whole = whole_param_groups([{"params": n} for n in own], grid)
    if len(param_groups) != len(whole):
        raise CheckpointError(
            f"{key}: the checkpoint has {len(param_groups)} param groups, the optimizer {len(whole)}"
        )
    by_name = {}
    for saved, mine, group in zip(param_groups, whole, optimizer.param_groups):
        if sorted(mine["params"]) != sorted(saved["params"]):
            raise CheckpointError(
                f"{key}: a param group holds {mine['params']} but the checkpoint's holds {saved['params']}"
            )
        by_name.update(zip((names[id(p)] for p in group["params"]), group["params"]))
    prefix = f"{key}.state."
    reader = SafeReader(str(path))
    wanted: dict[str, dict] = {}
    for fqn, md in reader.read_metadata().state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        name, _, k = fqn[len(prefix) :].rpartition(".")
        if name in by_name and holds_state(by_name[name]):
            wanted.setdefault(name, {})[k] = _placeholder(md, by_name[name], grid)
    load_dcp({key: {"state": wanted}}, path, reader=reader)
    for name, values in wanted.items():
        optimizer.state[by_name[name]] = {
            k: v.to_local() if isinstance(v, DTensor) else v for k, v in values.items()
        }
    for saved, group in zip(param_groups, optimizer.param_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
