"""Dense export of a DeepSpeed checkpoint written by a :func:`deepspeed_3d.initialize` engine.

DeepSpeed writes one set of files per model-parallel (cube) rank ``r``: ``mp_rank_{r:02d}_model_states.pt``
(ZeRO-3: ``zero_pp_rank_{d}_mp_rank_{r:02d}_model_states.pt``) and, under ZeRO, one
``*zero_pp_rank_{d}_mp_rank_{r:02d}_optim_states.pt`` per dp rank ``d``. Each cube rank's full-precision
shards come from DeepSpeed's own ``zero_to_fp32`` reader (fp32 master weights) run on that rank's
files alone, or from the module state without ZeRO; the sharding record the engine saved in the checkpoint
(:mod:`deepspeed_3d.sharding_record`) then places every shard in the global tensor.

With pipeline stages the model-parallel rank is ``stage · px·py·pz + r``, and the module's state is in
DeepSpeed's layer files instead, one per stage ``s`` and cube rank ``r``:
``layer_{s:02d}-model_{r:02d}-model_states.pt``, each stage's module under the whole model's names
(:func:`stage_state_dicts`); each stage's record is in its cube rank 0's model states.

DeepSpeed unpickles its files with ``weights_only=False``. So before anything reads a tag, every
``*.pt`` file of it is read once with weights-only unpickling (:func:`check_files`), allowing only
the few DeepSpeed types its files hold (:func:`deepspeed_globals`): a file naming anything else is
refused, naming the file, and nothing in it runs. DeepSpeed's own reader then gets the same bytes.

Command line: ``python -m deepspeed_3d.checkpoint to-dense CKPT_DIR OUT.pt [--tag TAG] [--prefix P]``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from lightning_3d.checkpoint import CheckpointError, root_info, save_dense
from lightning_3d.checkpoint.untrusted import load_weights_only
from lightning_3d.dense_twin import global_to_dense
from lightning_3d.grid import Grid
from lightning_3d.models.config import GPTConfig
from lightning_3d.sharding import assemble_tensor

from .sharding_record import RECORD_KEY, record_specs


def tag_dir(checkpoint_dir: str | Path, tag: str | None = None) -> Path:
    """The directory of checkpoint ``tag`` (default: the one named in ``checkpoint_dir/latest``)."""
    checkpoint_dir = Path(checkpoint_dir)
    if tag is None:
        latest = checkpoint_dir / "latest"
        if not latest.is_file():
            raise ValueError(
                f"{checkpoint_dir} has no 'latest' file; pass the checkpoint tag (a subdirectory name)"
            )
        tag = latest.read_text().strip()
    path = checkpoint_dir / str(tag)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory: {checkpoint_dir} holds no checkpoint tagged {tag!r}")
    return path


def deepspeed_globals() -> list:
    """The DeepSpeed types its checkpoint files hold (loss scalers, the ZeRO stage, fragment addresses), and
    the library's model config (a LightningModule's hyper-parameter in the client state)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, GPTConfig]


def load_file(file: Path) -> Any:
    """One DeepSpeed checkpoint file, unpickled weights-only (:class:`CheckpointError` naming it otherwise)."""
    with torch.serialization.safe_globals(deepspeed_globals()):
        return load_weights_only(file)


def check_files(path: Path) -> None:
    """Read every ``*.pt`` file of tag directory ``path`` weights-only: refuse any that could run code."""
    for file in sorted(path.glob("*.pt")):
        load_file(file)


def read_record(path: Path) -> dict | None:
    """The sharding record saved in checkpoint directory ``path`` (a tag's), or None when it has none.

    Every file of the tag is checked first (:func:`check_files`), so a DeepSpeed load that follows
    reads only files that name nothing outside the allowlist.
    """
    files = sorted(path.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise CheckpointError(f"{path} holds no DeepSpeed model-states file (*mp_rank_00_model_states.pt)")
    check_files(path)
    state = load_file(files[0])
    return state.get(RECORD_KEY) if isinstance(state, dict) else None


def rank_state_dict(path: Path, mp_rank: int) -> dict[str, torch.Tensor]:
    """Cube rank ``mp_rank``'s local state dict in checkpoint directory ``path`` (a tag's), full
    precision (ZeRO's fp32 master weights when present)."""
    files = sorted(path.glob(f"*mp_rank_{mp_rank:02d}_*.pt"))
    if not any(f.name.endswith("_optim_states.pt") for f in files):
        return load_file(path / f"mp_rank_{mp_rank:02d}_model_states.pt")["module"]
    with (
        tempfile.TemporaryDirectory() as tmp
    ):  # DeepSpeed's reader globs a directory: show it this rank's files only
        view = Path(tmp) / path.name
        view.mkdir()
        for f in files:
            (view / f.name).symlink_to(f.resolve())
        return dict(get_fp32_state_dict_from_zero_checkpoint(tmp, path.name))


def _offline_grid(record: dict) -> Grid:
    """A grid description without process groups: enough to place shards (sizes, coordinates)."""
    return Grid(
        tuple(record["grid"]), record["data_parallel_size"], (0, 0, 0, 0), mesh=None, timeout=None, _groups={}
    )


def to_dense(
    checkpoint_dir: str | Path, tag: str | None = None, prefix: str | None = None
) -> dict[str, torch.Tensor]:
    """The dense state dict of a DeepSpeed 3-D checkpoint, in one process (no process group needed).

    Every file is read weights-only first (:func:`read_record`); DeepSpeed's ZeRO reader follows (with
    pipeline stages, every stage's layer files in their stead).

    Args:
        checkpoint_dir: the directory given to ``engine.save_checkpoint``.
        tag: the checkpoint tag; default: the one named in ``checkpoint_dir/latest``.
        prefix: keep the keys that start with it and drop it; ``""`` keeps every key; default: the
            prefix of the model recorded as the dense root (``"model."`` for a LightningModule whose
            3-D model is ``self.model``), so the keys are the dense twin's.
    """
    path = tag_dir(checkpoint_dir, tag)
    record = read_record(path)
    if record is None:
        raise ValueError(
            f"{path} carries no {RECORD_KEY!r}: it was not saved by an engine of deepspeed_3d.initialize"
        )
    prefix = root_info(record.get("dense_root"), prefix)["prefix"]
    grid = _offline_grid(record)
    pp = record.get("pipeline_size", 1)
    out = {}
    for stage in range(pp):
        if pp == 1:
            stage_record, shards = record, [rank_state_dict(path, r) for r in range(grid.cube_size)]
        else:
            stage_record, shards = stage_state_dicts(path, stage, grid.cube_size)
        out.update(_assembled(stage_record, shards, prefix, grid))
    if not out:
        raise ValueError(f"{path} holds no model tensors under the prefix {prefix!r}")
    return out


def stage_state_dicts(path: Path, stage: int, cube_size: int) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """Pipeline stage ``stage``'s sharding record and each cube rank's local state dict of it, in checkpoint
    directory ``path`` (a tag's).

    The record is in the model-states file of the stage's cube rank 0 (model-parallel rank
    ``stage · px·py·pz``); the state dicts are DeepSpeed's layer files of the stage,
    ``layer_{stage:02d}-model_{r:02d}-model_states.pt``: the stage's module as the engine held it, in the
    model's dtype (DeepSpeed's ZeRO reader does not read pipeline checkpoints).
    """
    record = load_file(path / f"mp_rank_{stage * cube_size:02d}_model_states.pt").get(RECORD_KEY)
    if record is None:
        raise ValueError(f"{path}: pipeline stage {stage}'s model states carry no {RECORD_KEY!r}")
    return record, [
        load_file(path / f"layer_{stage:02d}-model_{r:02d}-model_states.pt") for r in range(cube_size)
    ]


def _assembled(
    record: dict, shards: list[dict[str, torch.Tensor]], prefix: str, grid: Grid
) -> dict[str, torch.Tensor]:
    """The dense tensors of ``shards`` (each cube rank's local state dict) whose keys start with ``prefix``,
    placed by ``record``, under their keys without ``prefix``."""
    specs, dense_shapes, transposed = (
        record_specs(record),
        record["dense_shapes"],
        set(record.get("dense_transposed", ())),
    )
    orders = record.get("dense_row_orders", {})
    out = {}
    for key, value in shards[0].items():
        if not key.startswith(prefix):
            continue
        spec = specs.get(key)
        tied = record.get("ties", {}).get(
            key, key
        )  # DeepSpeed lists a tied parameter under its first name only, on some ranks
        full = (
            value
            if spec is None
            else assemble_tensor([shard.get(key, shard.get(tied)) for shard in shards], spec, grid)
        )
        out[key[len(prefix) :]] = global_to_dense(
            full, dense_shapes.get(key), key in transposed, orders.get(key)
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed_3d.checkpoint", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    dense = commands.add_parser(
        "to-dense", help="write a DeepSpeed 3-D checkpoint's model as one dense state-dict file"
    )
    dense.add_argument("checkpoint", help="the directory given to engine.save_checkpoint")
    dense.add_argument("output", help="output file (torch.save of the state dict)")
    dense.add_argument("--tag", default=None, help="checkpoint tag (default: the one in CHECKPOINT/latest)")
    dense.add_argument(
        "--prefix",
        default=None,
        help="keep only keys starting with this and drop it; '' keeps every key; "
        "default: the recorded prefix of the model, so the keys are its dense twin's",
    )
    args = parser.parse_args(argv)
    record = read_record(tag_dir(args.checkpoint, args.tag)) or {}
    save_dense(
        to_dense(args.checkpoint, args.tag, args.prefix),
        args.output,
        root_info(record.get("dense_root"), args.prefix),
    )


if __name__ == "__main__":
    main()
