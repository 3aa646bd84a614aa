"""Sharded checkpoints of 3-D models (``torch.distributed.checkpoint``), safe to load, and their dense export.

A checkpoint is a directory, visible only once complete (:mod:`.publish`):

- ``.metadata`` and ``__<r>_<i>.distcp`` (DCP): ``state_dict.<name>`` for every entry of the
  module's state dict, ``optimizer_<i>.state.<param name>.<key>`` for optimizer state, each 3-D
  tensor as a DTensor view of its ShardSpec (:mod:`.views`). Any grid reads any part back, at any
  pipeline size: each rank of pipeline stages saves and reads its stages' tensors under the whole
  model's names (:mod:`.stages`). A module's extra state is kept as a tensor or as its JSON text
  (:mod:`.extra_state`).
- ``layout.json``, the sharding record: the grid it was written on, the model's true shapes and layouts and
  its dense root (:mod:`.saved_model`).
- ``rng/<rank>.json``: each rank's RNG states (:mod:`.rng`).
- ``meta.pt``: what the caller adds (the Lightning strategy: loop state, param groups,
  hyper-parameters), read with weights-only unpickling (:mod:`.untrusted`).
- ``manifest.json``, written last: size and SHA-256 of every other file (:mod:`.manifest`).

Loading checks the manifest, reads no pickle that could run code, and refuses a checkpoint of
another model (:class:`CheckpointError`, naming the file or both shapes); a failure inside DCP is
a :class:`CheckpointError` too, naming each rank's cause.

Command line: ``python -m lightning_3d.checkpoint to-dense CKPT OUT.safetensors [--prefix model.]``.
"""

from .cli import main
from .dense import dense_info, read_dense, root_info, save_dense, to_dense
from .files import META_FILE, MODEL_KEY, RECORD_FILE, RNG_DIR, CheckpointError, optimizer_key
from .manifest import verify
from .publish import is_complete, latest_complete
from .rng import rng_state, set_rng_state
from .saved_model import dense_root
from .store import load_meta, load_model_, load_optimizer_, load_rng_state, read_record, save
from .views import model_state, optimizer_state, parameter_names, sharded_view

__all__ = [
    "META_FILE",
    "MODEL_KEY",
    "RECORD_FILE",
    "RNG_DIR",
    "CheckpointError",
    "dense_info",
    "dense_root",
    "root_info",
    "is_complete",
    "latest_complete",
    "load_meta",
    "load_model_",
    "load_optimizer_",
    "load_rng_state",
    "main",
    "model_state",
    "optimizer_key",
    "optimizer_state",
    "parameter_names",
    "read_dense",
    "read_record",
    "rng_state",
    "save",
    "save_dense",
    "set_rng_state",
    "sharded_view",
    "to_dense",
    "verify",
]
