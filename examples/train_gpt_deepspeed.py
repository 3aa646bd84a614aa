"""Train the byte-level GPT3D of ``train_gpt.py`` with DeepSpeed: ZeRO over dp, 3-D inside each replica.

Same model, data, optimizer, schedule and checkpoints-per-epoch as ``examples/train_gpt.py`` (its
``ByteGPT`` and ``StdlibText`` are imported from there); the strategy is ``"tensor3d_deepspeed"``
with the DeepSpeed config ``examples/ds_config.json`` (ZeRO-1, gradient clipping 1.0, grid 2×2×1:
8 CPU processes give dp 2). Checkpoints are DeepSpeed directories; convert one to a dense state
dict with ``python -m deepspeed_3d.checkpoint to-dense``.

    python examples/train_gpt_deepspeed.py                    # CPU: 8 processes (gloo)
    python examples/train_gpt_deepspeed.py --resume --max-steps 300
    python -m deepspeed_3d.checkpoint to-dense OUT/checkpoints/<ckpt> dense.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
from train_gpt import (
    ByteGPT,
    CSVLogger,
    ModelCheckpoint,
    StdlibText,
    TokensPerSecond,
    pl,
    run_options,
    run_parser,
)

try:
    import deepspeed  # noqa: F401
except ImportError:
    sys.exit(
        'this example needs DeepSpeed: pip install -e ".[deepspeed]" in the repository (or pip install deepspeed)'
    )

from deepspeed_3d import (  # noqa: E402
    Tensor3DDeepSpeedStrategy,  # the class of whichever Lightning package is installed
)

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = run_parser(__doc__.split("\n\n")[0], "runs/train_gpt_deepspeed")
    p.add_argument(
        "--config",
        default=str(HERE / "ds_config.json"),
        help='DeepSpeed config with a "tensor3d" section (mixed precision needs ZeRO >= 1; the config has 1)',
    )
    p.add_argument("--grid", default=None, help="px,py,pz: overrides the config's tensor3d grid")
    return p.parse_args()


def newest_checkpoint(folder: Path) -> Path:
    """The newest complete DeepSpeed checkpoint in ``folder``: DeepSpeed writes its ``latest`` file last."""
    found = sorted(
        (p for p in folder.glob("*.ckpt") if (p / "latest").is_file()),
        key=lambda p: (p / "latest").stat().st_mtime,
    )
    if not found:
        raise FileNotFoundError(
            f"--resume: no complete checkpoint in {folder}; run once without --resume first"
        )
    return found[-1]


def main() -> None:
    args = parse_args()
    warnings.filterwarnings(
        "ignore", message=r".*isinstance\(treespec, LeafSpec\)"
    )  # Lightning 2.6 on torch >= 2.10
    pl.seed_everything(args.seed)
    out = Path(args.out)
    config = json.loads(Path(args.config).read_text())
    if args.grid:
        config.setdefault("tensor3d", {})["grid"] = [int(s) for s in args.grid.split(",")]
    config.setdefault("tensor3d", {})["options"] = run_options(args)
    strategy = Tensor3DDeepSpeedStrategy(config=config)
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_train_batches=args.steps_per_epoch,
        max_epochs=-1,
        num_sanity_val_steps=-1,
        log_every_n_steps=5,  # max_steps alone ends a run; clipping is in the config
        logger=CSVLogger(out, name="logs"),
        callbacks=[
            ModelCheckpoint(dirpath=out / "checkpoints", filename="{step}", save_top_k=1, every_n_epochs=1),
            TokensPerSecond(args.batch_size * args.seq_len),
        ],
    )
    model = ByteGPT(
        args.n_layer,
        args.n_head,
        args.n_embd,
        args.seq_len,
        args.dropout,
        args.lr,
        args.warmup,
        args.max_steps,
    )
    data = StdlibText(args.seq_len, args.batch_size, args.max_bytes, args.val_windows, args.seed)
    trainer.fit(
        model, datamodule=data, ckpt_path=newest_checkpoint(out / "checkpoints") if args.resume else None
    )
    if trainer.is_global_zero:
        start = (
            f"untrained {model.untrained_val_loss:.3f}"
            if model.untrained_val_loss is not None
            else "(resumed)"
        )
        print(f"\nvalidation loss: {start} -> " + " -> ".join(f"{v:.3f}" for v in model.val_losses))
        print(
            f"checkpoint: {trainer.checkpoint_callback.best_model_path or newest_checkpoint(out / 'checkpoints')}"
        )


if __name__ == "__main__":
    main()
