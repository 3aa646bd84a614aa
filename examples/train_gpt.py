"""Train a byte-level GPT3D with ``Trainer(strategy="tensor3d")`` on the Python standard library's own source.

No download: the text is the ``.py`` files of the running Python's standard library (tests and
vendored packages left out), read as bytes (vocabulary 256). Every 20th file is held out for
validation. Without a GPU it runs 8 CPU processes (gloo) on a 2×2×2 grid; with GPUs it uses all
of them (grid ``"auto"``). It logs loss, validation loss and tokens/s (progress bar and
``OUT/logs``), writes a sharded checkpoint at every epoch end (``OUT/checkpoints``), continues
from the newest one with ``--resume``, and ends by printing a generated sample.

``--pipeline 2`` splits the model into two pipeline stages (on 8 CPU processes: two stages of 2×2×1):
the LightningModule builds the plain ``DenseGPT`` and the strategy runs this rank's stages
under ``--schedule``; ``training_step`` is the same. Its checkpoints resume with ``--resume``, on another
``--pipeline`` or grid too; the sample is left out there (the stages
do not generate).

    python examples/train_gpt.py                      # CPU: 8 processes, a few minutes
    python examples/train_gpt.py --resume --max-steps 300
    python -m lightning_3d.checkpoint to-dense OUT/checkpoints/<ckpt> dense.safetensors
    python examples/train_gpt.py --pipeline 2         # CPU: pp 2 × 2×2×1
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_3d import (
    RuntimeOptions,
    Tensor3DStrategy,  # the class of whichever Lightning package is installed
)
from lightning_3d.checkpoint import latest_complete
from lightning_3d.models import GPT3D, DenseGPT, GPTConfig
from lightning_3d.pipeline import SCHEDULES, PipelineOptions

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
except ImportError:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger

SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"}
SEPARATOR = b"\n\n"


def stdlib_bytes(max_bytes: int, val_every: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` byte tensors from the standard library's ``.py`` files (sorted; every ``val_every``-th
    file is val)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts))
    train, val, size = [], [], 0
    for i, path in enumerate(files):
        text = path.read_bytes() + SEPARATOR
        (val if i % val_every == 0 else train).append(text)
        size += len(text)
        if size >= max_bytes:
            break

    def as_tensor(chunks: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)

    return as_tensor(train), as_tensor(val)


class Windows(Dataset):
    """``count`` windows of ``seq_len + 1`` bytes at offsets drawn once from ``seed`` (so an index always
    means the same window)."""

    def __init__(self, data: torch.Tensor, seq_len: int, count: int, seed: int):
        self.data, self.seq_len = data, seq_len
        self.starts = torch.randint(
            0, len(data) - seq_len - 1, (count,), generator=torch.Generator().manual_seed(seed)
        )

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.starts[i])
        return self.data[start : start + self.seq_len + 1].long()


class StdlibText(pl.LightningDataModule):
    """Train and validation windows; each dp replica gets ``batch_size / dp`` sequences a step."""

    def __init__(self, seq_len: int, batch_size: int, max_bytes: int, val_windows: int, seed: int):
        super().__init__()
        self.seq_len, self.batch_size, self.max_bytes, self.val_windows, self.seed = (
            seq_len,
            batch_size,
            max_bytes,
            val_windows,
            seed,
        )

    def setup(self, stage: str) -> None:
        train, val = stdlib_bytes(self.max_bytes)
        self.train_set = Windows(train, self.seq_len, 1_000_000, self.seed)
        self.val_set = Windows(val, self.seq_len, self.val_windows, self.seed + 1)

    def _replica_batch(self) -> int:
        dp = self.trainer.strategy.grid.data_parallel_size
        if self.batch_size % dp:
            raise ValueError(
                f"--batch-size {self.batch_size} must be divisible by the data-parallel size {dp}"
            )
        return self.batch_size // dp

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self._replica_batch(), shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self._replica_batch(), drop_last=True)


class ByteGPT(pl.LightningModule):
    """GPT3D on bytes; the 3-D layers are built in ``configure_model`` on the strategy's grid. With
    ``pipeline``: the plain DenseGPT, which the strategy splits into its pipeline stages."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        n_embd: int,
        seq_len: int,
        dropout: float,
        lr: float,
        warmup: int,
        max_steps: int,
        pipeline: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None
        self.untrained_val_loss: float | None = None
        self.val_losses: list[float] = []
        self._val_batch_losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.model is None:
            hp = self.hparams
            config = GPTConfig(
                vocab_size=256,
                block_size=hp.seq_len,
                n_layer=hp.n_layer,
                n_head=hp.n_head,
                n_embd=hp.n_embd,
                dropout=hp.dropout,
            )
            # run-time choices: the strategy's options
            self.model = DenseGPT(config) if hp.pipeline else GPT3D(config, grid=self.grid)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch[:, :-1], batch[:, 1:])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self._loss(batch)
        self._val_batch_losses.append(loss.detach())
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        """Remember the epoch's validation loss (mean over the dp replicas); the sanity check's is the untrained one."""
        loss = self.trainer.strategy.reduce(
            torch.stack(self._val_batch_losses).mean(), reduce_op="mean"
        ).item()
        self._val_batch_losses.clear()
        if self.trainer.sanity_checking:
            self.untrained_val_loss = loss
        else:
            self.val_losses.append(loss)

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=(0.9, 0.95), weight_decay=0.1)

        def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10%
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            progress = min(1.0, (step - hp.warmup) / max(1, hp.max_steps - hp.warmup))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule),
                "interval": "step",
            },
        }


class TokensPerSecond(pl.Callback):
    """Logs the global training throughput (tokens of every replica's batch) each step."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step, self.start = tokens_per_step, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        module.log(
            "tok/s",
            self.tokens_per_step / (time.perf_counter() - self.start),
            prog_bar=True,
            rank_zero_only=True,
        )


def run_parser(description: str, out: str) -> argparse.ArgumentParser:
    """The options this example shares with train_gpt_deepspeed.py: run, model, data, optimiser."""
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default=out, help="logs and checkpoints go here")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in OUT/checkpoints",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=torch.cuda.device_count() if gpu else 8,
        help="processes (GPUs, or CPU processes)",
    )
    p.add_argument(
        "--precision", default="bf16-mixed" if gpu else "32-true", help="Lightning's precision flag"
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=2000 if gpu else 240,
        help="optimizer steps of the whole run (a resumed one too)",
    )
    p.add_argument(
        "--steps-per-epoch",
        type=int,
        default=200 if gpu else 40,
        help="a checkpoint and a validation after each",
    )
    p.add_argument(
        "--batch-size", type=int, default=64 if gpu else 16, help="global: sequences a step over all replicas"
    )
    p.add_argument("--seq-len", type=int, default=256 if gpu else 64, help="tokens (bytes) a sequence")
    p.add_argument("--n-layer", type=int, default=8 if gpu else 2, help="transformer blocks")
    p.add_argument("--n-head", type=int, default=8 if gpu else 4, help="attention heads")
    p.add_argument("--n-embd", type=int, default=512 if gpu else 64, help="model width")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    p.add_argument(
        "--lr",
        type=float,
        default=1e-3 if gpu else 3e-3,
        help="peak AdamW learning rate (cosine decay to 10%%)",
    )
    p.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=12_000_000 if gpu else 4_000_000,
        help="how much of the standard library to read",
    )
    p.add_argument("--val-windows", type=int, default=64, help="validation sequences")
    p.add_argument("--seed", type=int, default=1337, help="seed of the model init and the data order")
    p.add_argument(
        "--async-tp",
        action="store_true",
        help="collective matmuls over symmetric memory (GPUs of one NVLink domain)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each block (RuntimeOptions.compile)")
    p.add_argument(
        "--regather",
        action="store_true",
        help="less memory: re-gather weights in backward, a block ahead, instead of keeping them (save_gathered=False)",
    )
    return p


def run_options(args: argparse.Namespace) -> dict[str, bool]:
    """The ``RuntimeOptions`` fields that ``--async-tp``, ``--compile`` and ``--regather`` set."""
    return {"async_tp": args.async_tp, "compile": args.compile, "save_gathered": not args.regather}


def parse_args() -> argparse.Namespace:
    p = run_parser(__doc__.split("\n\n")[0], "runs/train_gpt")
    p.add_argument("--grid", default="auto", help="'auto' or px,py,pz, e.g. 2,2,2")
    p.add_argument("--data-parallel-size", default="auto", help="'auto' or an int")
    p.add_argument(
        "--zero-stage",
        type=int,
        default=0,
        choices=(0, 1),
        help="1: optimizer state sharded over dp (ZeRO-1)",
    )
    p.add_argument("--pipeline", type=int, default=1, help="pipeline stages (pp); the grid is each stage's")
    p.add_argument(
        "--schedule", default="1F1B", choices=SCHEDULES, help="the pipeline schedule, with --pipeline"
    )
    p.add_argument(
        "--timeout", type=float, default=300, help="seconds a rank waits for a dead or stalled peer"
    )
    p.add_argument("--sample-tokens", type=int, default=300, help="bytes generated from 'def ' at the end")
    return p.parse_args()


def newest_checkpoint(folder: Path) -> Path:
    """The newest complete checkpoint in ``folder`` (one cut short by a crash is passed over)."""
    found = latest_complete(folder)
    if found is None:
        raise FileNotFoundError(
            f"--resume: no complete checkpoint in {folder}; run once without --resume first"
        )
    return found


def _val_losses(model: ByteGPT) -> str:
    """The validation losses of the run, the untrained one first."""
    start = (
        f"untrained {model.untrained_val_loss:.3f}" if model.untrained_val_loss is not None else "(resumed)"
    )
    return f"{start} -> " + " -> ".join(f"{v:.3f}" for v in model.val_losses)


def main() -> None:
    args = parse_args()
    warnings.filterwarnings(
        "ignore", message=r".*isinstance\(treespec, LeafSpec\)"
    )  # Lightning 2.6 on torch >= 2.10
    pl.seed_everything(args.seed)
    out = Path(args.out)
    grid = args.grid if args.grid == "auto" else tuple(int(s) for s in args.grid.split(","))
    dp = args.data_parallel_size if args.data_parallel_size == "auto" else int(args.data_parallel_size)
    staged = args.pipeline > 1
    strategy = Tensor3DStrategy(
        grid=grid,
        data_parallel_size=dp,
        pipeline_size=args.pipeline,
        pipeline=PipelineOptions(schedule=args.schedule) if staged else None,
        zero_stage=args.zero_stage,
        timeout=args.timeout,
        options=RuntimeOptions(**run_options(args)),
    )
    callbacks = [
        TokensPerSecond(args.batch_size * args.seq_len),
        ModelCheckpoint(dirpath=out / "checkpoints", filename="{step}", save_top_k=1, every_n_epochs=1),
    ]
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_train_batches=args.steps_per_epoch,
        max_epochs=-1,
        num_sanity_val_steps=-1,
        gradient_clip_val=1.0,
        log_every_n_steps=5,  # max_steps alone ends a run
        logger=CSVLogger(out, name="logs"),
        callbacks=callbacks,
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
        staged,
    )
    data = StdlibText(args.seq_len, args.batch_size, args.max_bytes, args.val_windows, args.seed)
    ckpt_path = newest_checkpoint(out / "checkpoints") if args.resume else None
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    sample = None
    if not staged:
        device = trainer.strategy.root_device
        model.model.to(device).eval()  # Lightning's teardown moved the module to the CPU
        prompt = torch.tensor([list(b"def ")], device=device)
        sample = model.model.generate(
            prompt, args.sample_tokens, temperature=0.8, top_k=40
        )  # collective: every rank
    if trainer.is_global_zero:
        print(f"\nvalidation loss: {_val_losses(model)}")
        print(
            f"checkpoint: {trainer.checkpoint_callback.best_model_path or newest_checkpoint(out / 'checkpoints')}"
        )
        if sample is not None:
            print("sample:\n" + bytes(sample[0].tolist()).decode("utf-8", errors="replace"))


if __name__ == "__main__":
    main()
