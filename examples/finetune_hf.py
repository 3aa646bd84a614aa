"""Fine-tune a Hugging Face causal LM on the 3-D grid with Lightning, then export it for ``from_pretrained``.

    python examples/finetune_hf.py                                  # 4 CPU processes, 1×2×2 grid, a tiny random Llama
    python examples/finetune_hf.py --model-dir ./my-llama --accelerator gpu --devices 8 --grid 2 2 2

The LightningModule's ``configure_model`` loads the model with ``AutoModelForCausalLM.from_pretrained``
and puts it on the grid with ``lightning_3d.parallelize`` (its built-in plan, found by class name);
the model is then called as usual, ``model(input_ids, attention_mask=..., labels=...).loss``.
Without ``--model-dir`` a tiny random Llama (GQA) is written to ``<out>/initial`` first: nothing
is downloaded. The data are padded sequences ``x, x+a, x+2a, ...`` with ``a`` set per sequence.
At the end ``lightning_3d.save_pretrained`` writes ``<out>/finetuned``; rank 0 loads it with plain
``transformers`` and prints its loss on a held-out batch next to the trained model's.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_3d import Tensor3DStrategy, parallelize, save_pretrained


class RuleSequences(Dataset):
    """Sequences ``x, x+a, x+2a, ...`` (mod vocab, ``a`` in 1..4 per sequence) of random lengths,
    right-padded with 0 (attention mask 0, labels -100)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        a, x = torch.randint(1, 5, (n,), generator=g), torch.randint(0, vocab, (n,), generator=g)
        tokens = [x]
        for _ in range(seq_len - 1):
            tokens.append((tokens[-1] + a) % vocab)
        self.ids = torch.stack(tokens, 1)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=g)
        self.mask = (torch.arange(seq_len) < lengths[:, None]).long()
        self.ids = self.ids * self.mask

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, mask = self.ids[i], self.mask[i]
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def write_tiny_llama(path: Path, vocab: int, seq_len: int) -> None:
    """A random 2-layer Llama (4 heads, 2 key/value heads, untied head) saved with plain ``transformers``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


class FineTune(pl.LightningModule):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.args = args
        self.model_dir = Path(args.model_dir) if args.model_dir else Path(args.out) / "initial"
        self.model = None

    def prepare_data(self) -> None:  # local rank 0 of each node, before configure_model
        if not self.args.model_dir and not (self.model_dir / "config.json").exists():
            write_tiny_llama(self.model_dir, self.args.vocab, self.args.seq_len)

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if self.model is None:
            self.model = parallelize(
                AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            ).train()

    def train_dataloader(self) -> DataLoader:
        vocab = self.model.config.vocab_size
        data = RuleSequences(
            self.args.batch_size * self.args.max_steps, self.args.seq_len, vocab, self.args.seed
        )
        return DataLoader(data, batch_size=self.args.batch_size // self.grid.data_parallel_size)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss  # the same scalar on every rank of a cube
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.01)

    def on_train_end(self) -> None:
        """Export (collective; global rank 0 writes), then check it: plain ``transformers`` on one batch."""
        from transformers import AutoModelForCausalLM

        folder = Path(self.args.out) / "finetuned"
        data = RuleSequences(
            self.args.batch_size, self.args.seq_len, self.model.config.vocab_size, seed=self.args.seed + 1
        )
        batch = next(iter(DataLoader(data, batch_size=self.args.batch_size)))
        with torch.no_grad():
            trained = self.model(
                **{k: t.to(self.device) for k, t in batch.items()}
            ).loss  # every rank: a collective
        save_pretrained(self.model, folder)
        if self.trainer.is_global_zero:
            with torch.no_grad():
                exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(**batch).loss
            print(
                f"saved {folder}: held-out loss {trained:.4f} on the grid, {exported:.4f} loaded by transformers"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--model-dir", default=None, help="a local Hugging Face folder; none: a tiny random Llama"
    )
    parser.add_argument(
        "--out", default="runs/finetune_hf", help="where the initial (if written) and fine-tuned folders go"
    )
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"], help="CPU processes or GPUs")
    parser.add_argument("--devices", type=int, default=4, help="processes (CPU, over gloo) or GPUs")
    parser.add_argument(
        "--grid",
        type=int,
        nargs=3,
        default=[1, 2, 2],
        metavar=("PX", "PY", "PZ"),
        help="the cube; the rest of the devices is data parallelism",
    )
    parser.add_argument("--max-steps", type=int, default=30, help="optimizer steps (one epoch of fresh data)")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="global batch: a multiple of dp·lcm(px·py, px·pz)"
    )
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence, padding included")
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary of the tiny model")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed")
    parser.add_argument("--seed", type=int, default=0, help="data and Lightning seed")
    args = parser.parse_args()
    px, py, pz = args.grid
    multiple = (args.devices // (px * py * pz)) * math.lcm(px * py, px * pz)
    if args.devices % (px * py * pz) or args.batch_size % multiple:
        parser.error(
            f"--devices {args.devices} must be a multiple of px·py·pz = {px * py * pz}, and --batch-size "
            f"{args.batch_size} a multiple of dp·lcm(px·py, px·pz) = {multiple}"
        )
    pl.seed_everything(args.seed)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=Tensor3DStrategy(grid=tuple(args.grid)),
        precision=args.precision,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(FineTune(args))
    if trainer.is_global_zero:
        print(
            f"trained {trainer.global_step} steps on a {px}×{py}×{pz} grid: loss {trainer.callback_metrics['loss']:.4f}"
        )


if __name__ == "__main__":
    main()
