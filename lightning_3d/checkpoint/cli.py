"""``python -m lightning_3d.checkpoint to-dense CKPT OUT [--prefix P]``."""

from __future__ import annotations

import argparse

from .dense import dense_info, save_dense, to_dense


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_3d.checkpoint",
        description="Sharded checkpoints of 3-D models and their dense export.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    dense = commands.add_parser(
        "to-dense",
        help="write a sharded checkpoint's model as one dense state-dict file, keys of the dense twin",
    )
    dense.add_argument("checkpoint", help="sharded checkpoint directory")
    dense.add_argument(
        "output",
        help="output file: *.safetensors carries the model config inside; "
        "another name is torch.save of the state dict, the config in OUTPUT.json",
    )
    dense.add_argument(
        "--prefix",
        default=None,
        help="keep only keys starting with this and drop it; '' keeps every key; by default the prefix "
        "recorded in the checkpoint: the attribute holding the model (e.g. 'model.')",
    )
    args = parser.parse_args(argv)
    save_dense(to_dense(args.checkpoint, args.prefix), args.output, dense_info(args.checkpoint, args.prefix))
