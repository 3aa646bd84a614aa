"""``manifest.json``: the size and SHA-256 of every file of a checkpoint, written last.

A checkpoint without a manifest is not a checkpoint (its writer died or is still writing); a file
whose size or digest differs from its entry was truncated or altered after it was written. The
digests catch damage, not an attacker (who can rewrite the manifest too): safety against crafted
files comes from reading nothing that can run code (:mod:`.untrusted`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path, PurePosixPath

import torch.distributed as dist

from .files import DCP_METADATA, FORMAT, MANIFEST_FILE, RECORD_FILE, CheckpointError

_CHUNK = 1 << 22
ALWAYS_LISTED = (DCP_METADATA, RECORD_FILE)
"""The files every checkpoint lists: checking a whole checkpoint requires them listed, as loading reads them."""


def file_entry(root: Path, name: str) -> dict:
    """``{"size", "sha256"}`` of file ``name`` (relative, ``/``-separated) under ``root``."""
    digest = hashlib.sha256()
    size = 0
    with open(root / name, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
            size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}


def write_durably(file: Path, data: bytes) -> None:
    """Write ``data`` to ``file`` and flush it to the disk."""
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(root: Path, entries: dict[str, dict]) -> None:
    manifest = {"format": FORMAT, "saved_at": time.time(), "files": dict(sorted(entries.items()))}
    write_durably(root / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())


def read_manifest(root: str | Path) -> dict:
    """The manifest of checkpoint ``root``; :class:`CheckpointError` when it has none or it is malformed."""
    root = Path(root)
    file = root / MANIFEST_FILE
    if not file.is_file():
        what = "does not exist" if not root.exists() else f"has no {MANIFEST_FILE}"
        raise CheckpointError(
            f"{root} {what}: it is not a complete lightning_3d checkpoint (its writer died before "
            f"every rank's files were on disk, or it was written by an older version)"
        )
    try:
        manifest = json.loads(file.read_text())
        files = manifest["files"]
        ok = manifest["format"] == FORMAT and all(
            _safe_name(n) and set(e) >= {"size", "sha256"} for n, e in files.items()
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{file} is malformed (expected format {FORMAT!r} listing relative file names)")
    return manifest


def _safe_name(name: str) -> bool:
    p = PurePosixPath(name)
    return isinstance(name, str) and not p.is_absolute() and ".." not in p.parts and name == p.as_posix()


def _problem(root: Path, name: str, entry: dict, hash_it: bool) -> str | None:
    try:
        size = (root / name).stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    if size != entry["size"]:
        return f"{name} has {size} bytes, the manifest says {entry['size']} (truncated or rewritten)"
    if hash_it and file_entry(root, name)["sha256"] != entry["sha256"]:
        return f"{name} does not match its SHA-256 in the manifest (altered after it was written)"
    return None


def _checked(files: dict, names: list[str] | None) -> list[str]:
    """The names to check: ``names``, or by default every listed file and :data:`ALWAYS_LISTED`."""
    return sorted(names if names is not None else set(files) | set(ALWAYS_LISTED))


def problems(root: str | Path, names: list[str] | None = None, hash_it: bool = True) -> list[str]:
    """What is wrong with the files ``names`` (default: the whole checkpoint) of checkpoint ``root``, in this
    process: a file the manifest does not list is read unchecked, so it is a problem too."""
    root = Path(root)
    files = read_manifest(root)["files"]
    names = _checked(files, names)
    unknown = [f"{n} is not listed in the manifest" for n in names if n not in files]
    return unknown + [p for n in names if n in files for p in [_problem(root, n, files[n], hash_it)] if p]


def verify(root: str | Path, names: list[str] | None = None, collective: bool = False) -> None:
    """Raise :class:`CheckpointError` naming every missing, unlisted, truncated or altered file of ``root``.

    ``collective=True`` (every rank of the default process group calls): the files are hashed
    ``world_size`` ways, and every rank raises the same error.
    """
    root = Path(root)
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        read_manifest(root)  # a missing manifest is seen by every rank alike
        rank, world = dist.get_rank(), dist.get_world_size()
        share = _checked(read_manifest(root)["files"], names)[rank::world]
        found: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(found, problems(root, share))
        found_all = [p for ps in found for p in ps]
    else:
        found_all = problems(root, names)
    if found_all:
        raise CheckpointError(f"{root} is damaged, refusing to load it: " + "; ".join(found_all))
