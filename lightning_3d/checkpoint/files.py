"""The names of a checkpoint's files and top-level keys, and the error every check raises."""

from __future__ import annotations

FORMAT = "lightning_3d.sharded/1"
MODEL_KEY = "state_dict"
DCP_METADATA = ".metadata"
RECORD_FILE = "layout.json"  # the sharding record (:mod:`.saved_model`); the name every checkpoint carries
MANIFEST_FILE = "manifest.json"
META_FILE = "meta.pt"
RNG_DIR = "rng"


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, altered, unsafe to read, or made for another model."""


def optimizer_key(index: int) -> str:
    """Top-level key of optimizer ``index``'s state."""
    return f"optimizer_{index}"


def rng_file(rank: int) -> str:
    """The file of global rank ``rank``'s RNG states, relative to the checkpoint."""
    return f"{RNG_DIR}/{rank}.json"
