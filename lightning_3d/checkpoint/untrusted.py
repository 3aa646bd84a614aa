"""Reading pickles from a checkpoint without running code.

A pickle names functions and classes that unpickling calls, so a crafted file runs whatever it
names. Every pickle a checkpoint holds is read here with an allowlist of harmless names:

- DCP's ``.metadata`` by :class:`MetadataUnpickler` (DCP's own metadata types, ``torch.Size``,
  dtypes, layouts, memory formats, paths), through :class:`SafeReader`;
- DCP's non-tensor entries and ``meta.pt`` by ``torch.load(weights_only=True)`` with
  :func:`meta_globals` added (:func:`load_weights_only`, :class:`SafePlanner`), and the classes a
  caller allows (``allowed``: a model's config class among a LightningModule's hyper-parameters).

A name outside the allowlist raises :class:`~.files.CheckpointError` naming the file and the name.
Every DCP load goes through :func:`load_dcp`, which turns DCP's ``CheckpointException`` (a
``BaseException``) into one :class:`~.files.CheckpointError` saying what failed on which rank.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, Metadata
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from ..agreement import describe_ranks
from .files import DCP_METADATA, CheckpointError

_METADATA_OBJECTS = (
    *(
        getattr(dcp_metadata, n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    dcp_filesystem._StorageInfo,
    torch.Size,
    torch.serialization._get_layout,
    collections.OrderedDict,
    pathlib.Path,
    pathlib.PosixPath,
    pathlib.WindowsPath,
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
)
METADATA_GLOBALS: dict[tuple[str, str], Any] = {(o.__module__, o.__qualname__): o for o in _METADATA_OBJECTS}
"""``(module, name)`` → object: everything DCP's ``.metadata`` may name (torch dtypes, layouts and
memory formats are added by :meth:`MetadataUnpickler.find_class`)."""


def meta_globals(allowed: Sequence[type] = ()) -> list:
    """Classes allowed in ``meta.pt`` and non-tensor DCP entries besides torch's weights-only defaults:
    ``pathlib`` paths and the caller's ``allowed``."""
    return [pathlib.PosixPath, pathlib.WindowsPath, *allowed]


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global raises ``pickle.UnpicklingError``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return METADATA_GLOBALS[module, name]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"{module}.{name} is not one of the types DCP metadata holds")


def read_dcp_metadata(path: str | Path) -> Metadata:
    """The ``.metadata`` of DCP checkpoint directory ``path``, read by :class:`MetadataUnpickler`."""
    file = Path(path) / DCP_METADATA
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: {path} is not a complete sharded checkpoint") from None
    except Exception as e:  # any malformed pickle: truncated, crafted, of another program
        raise CheckpointError(
            f"refusing to read {file}: {e}. The file is damaged or was crafted to run code; "
            f"nothing in it was executed"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by :class:`MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner; a non-tensor entry is first read with ``torch.load(weights_only=True)``.

    DCP's own planner unpickles such entries with ``weights_only=False``; it gets the bytes only after
    they proved to name nothing outside :func:`meta_globals`, so it can build nothing else.
    """

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        try:
            with torch.serialization.safe_globals(meta_globals()):
                torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            info = (
                self.metadata.storage_data.get(read_item.storage_index) if self.metadata is not None else None
            )
            raise CheckpointError(
                f"refusing to read the entry {read_item.dest_index.fqn!r} in "
                f"{getattr(info, 'relative_path', 'its shard')}: {_first_line(e)}; nothing in it was executed. "
                "The file is damaged or was crafted to run code; a checkpoint "
                f"you trust whose state holds objects of your own classes loads once they are allowed with "
                f"torch.serialization.add_safe_globals([cls])"
            ) from None
        super().load_bytes(read_item, io.BytesIO(data))  # the same bytes: only the globals just allowed


def load_dcp(
    state: dict,
    path: str | Path,
    reader: SafeReader | None = None,
    allow_partial_load: bool = False,
    no_dist: bool = False,
) -> None:
    """``dcp.load`` of ``state`` from checkpoint ``path`` through :class:`SafeReader` and :class:`SafePlanner`.

    A failure on any rank raises the same :class:`CheckpointError` on every rank, naming each
    rank's cause (ranks with the same cause together), in place of DCP's ``CheckpointException``;
    that one is let through as it is when a cause is no ``Exception`` (Ctrl-C, ``SystemExit``).
    """
    try:
        dcp.load(
            state,
            storage_reader=reader or SafeReader(path),
            planner=SafePlanner(allow_partial_load=allow_partial_load),
            no_dist=no_dist,
        )
    except CheckpointException as e:
        if not all(isinstance(_cause(f), Exception) for f in e.failures.values()):
            raise
        raise CheckpointError(f"cannot load {path}: {_causes(e)}") from None


def _cause(failure: Any) -> BaseException:
    """The exception of one of DCP's per-rank failures (``(exception, traceback summary)``)."""
    return failure[0] if isinstance(failure, tuple) else failure


def _causes(e: CheckpointException) -> str:
    """``"ranks 0-3: <cause>; rank 5: <other cause>"`` from DCP's per-rank failures."""
    ranks_of: dict[str, list[int]] = {}
    for rank, failure in sorted(e.failures.items()):
        cause = _cause(failure)
        text = (
            str(cause)
            if isinstance(cause, CheckpointError)
            else f"{type(cause).__name__}: {_first_line(cause)}"
        )
        ranks_of.setdefault(text, []).append(rank)
    return "; ".join(f"{describe_ranks(ranks)}: {text}" for text, ranks in ranks_of.items())


def load_weights_only(file: str | Path, trusted: bool = False, allowed: Sequence[type] = ()) -> Any:
    """``torch.load`` of ``file`` allowing tensors, plain containers and :func:`meta_globals` (with ``allowed``) only.

    ``trusted=True`` unpickles anything: only for a file the caller vouches for.
    """
    try:
        if trusted:
            return torch.load(file, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(meta_globals(allowed)):
            return torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refusing to read {file}: {_first_line(e)} Nothing in it was executed. A checkpoint you trust that holds "
            "objects of your own classes (e.g. hyper-parameters) loads with "
            "torch.serialization.add_safe_globals([cls]) "
            f"or Trainer.fit(..., weights_only=False)"
        ) from None
    except Exception as e:
        raise CheckpointError(f"cannot read {file}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():
        if "GLOBAL" in line or "Unsupported" in line:
            return line.strip()
    return text.splitlines()[0] if text else type(e).__name__
