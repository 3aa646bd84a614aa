"""The README's Lightning example, runnable: a one-block byte LM from the 3-D layers.

python examples/quickstart_lightning.py            # 8 CPU processes, 2×2×2 grid
"""

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_3d  # noqa: F401  (registers "tensor3d" with Lightning)
from lightning_3d import CrossEntropyLoss3D, LayerNorm3D, Linear3D, VocabParallelEmbedding3D


class TinyLM(pl.LightningModule):
    def configure_model(self):
        self.emb = VocabParallelEmbedding3D(256, 64)  # full ids → z-layout
        self.ln = LayerNorm3D(64)
        self.fc1 = Linear3D(64, 256)  # z → y
        self.fc2 = Linear3D(256, 64, input_layout="y")  # y → z
        self.head = Linear3D(64, 256, bias=False)  # z → y logits, vocab split over y
        self.loss = CrossEntropyLoss3D()

    def training_step(self, batch, batch_idx):
        ids, targets = batch  # the same batch on every cube rank
        h = self.emb(ids)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(h))))
        loss = self.loss(self.head(h), targets)  # the same scalar on every cube rank
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=8, help="CPU processes (8: a 2×2×2 grid)")
    parser.add_argument("--max-steps", type=int, default=30, help="optimizer steps")
    args = parser.parse_args()
    torch.manual_seed(0)
    text = torch.tensor(list(b"3-D tensor parallelism splits every weight, activation and FLOP. " * 64))
    windows = text[: (len(text) - 1) // 17 * 17 + 1].unfold(0, 17, 16)
    data = TensorDataset(windows[:, :-1], windows[:, 1:])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="tensor3d",
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyLM(), DataLoader(data, batch_size=8, shuffle=True, drop_last=True))
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss']:.3f}")


if __name__ == "__main__":
    main()
