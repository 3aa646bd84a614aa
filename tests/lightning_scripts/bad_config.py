"""Driver: a 2-process run (Lightning's own launcher) whose ``configure_model`` builds a layer that does not
split on 2×1×1.

Every rank raises the same error; rank 0 must show it with its traceback, the other one line.
Rank 0 prints ``configure_model at <time.monotonic()>`` first, so the test times the error from there.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common

common.quiet()

import lightning.pytorch as pl
import torch

from lightning_3d import Linear3D, Tensor3DStrategy


class Misfit(pl.LightningModule):
    def configure_model(self):
        if self.global_rank == 0:
            print(f"configure_model at {time.monotonic()}", flush=True)
        self.layer = Linear3D(8, 31)  # 31 output features do not split over py·px = 2

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def train_dataloader(self):
        return [torch.zeros(4, 8)]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=Tensor3DStrategy(grid=(2, 1, 1), timeout=60),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Misfit())
