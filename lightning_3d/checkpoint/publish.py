"""Making a checkpoint visible in one step, and finding the newest complete one.

Every rank writes into a hidden staging directory ``.<name>.partial`` beside the target; once
every file and the manifest are on disk, global rank 0 renames it to ``<name>``. An existing
``<name>`` is swapped with the staging directory in one atomic ``renameat2(RENAME_EXCHANGE)``
(Linux) and then removed, so a reader sees the old complete checkpoint or the new one, never
neither and never a half-written one. Where the exchange is unsupported (another OS, some network
file systems) the old one is first renamed to ``.<name>.old`` (which :func:`latest_complete` still
finds) and removed after the new one is in place.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from pathlib import Path

from .files import FORMAT, MANIFEST_FILE

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging_path(path: Path) -> Path:
    """The hidden directory a checkpoint for ``path`` is written into."""
    return path.parent / f".{path.name}.partial"


def _old_path(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def remove(path: Path) -> None:
    """Remove a file, a link (not its target) or a directory tree, if it exists."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically; False where the OS or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def publish(staging: Path, path: Path) -> None:
    """Make the complete checkpoint ``staging`` visible as ``path``, replacing what is there."""
    for d in [p for p in staging.rglob("*") if p.is_dir()] + [staging]:
        _fsync_dir(d)
    if not os.path.lexists(path):
        os.rename(staging, path)
    elif _exchange(staging, path):
        remove(staging)  # now the previous checkpoint
    else:
        old = _old_path(path)
        remove(old)
        os.rename(path, old)
        os.rename(staging, path)
        remove(old)
    _fsync_dir(path.parent)


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a manifest and every file it lists, at its size (no hashing)."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        return manifest["format"] == FORMAT and all(
            (path / name).stat().st_size == entry["size"] for name, entry in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _saved_at(path: Path) -> float:
    return float(json.loads((path / MANIFEST_FILE).read_text()).get("saved_at", 0.0))


def latest_complete(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory`` (by the time its manifest was written), or None.

    Staging directories are skipped; links (Lightning's ``last.ckpt`` with ``save_last="link"``)
    count as their target. Sizes are checked here, digests when the checkpoint is loaded.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [
        p
        for p in directory.iterdir()
        if (not p.name.startswith(".") or p.name.endswith(".old")) and p.is_dir() and is_complete(p)
    ]
    return max(found, key=lambda p: (_saved_at(p), not p.name.startswith("."), p.name), default=None)
