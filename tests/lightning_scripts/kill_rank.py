"""Driver: a run that loses a rank (Lightning's own launcher: ``devices=2``).

``python kill_rank.py OUT``: 2×1×1 (auto for 2 devices), 3 epochs of 3 steps with a checkpoint at
every epoch end; rank 0 SIGKILLs itself before step 5 (noting the time in ``OUT/killed_at``). The
survivor, rank 1, must fail within the strategy's timeout (60 s) with tensor3d's message. Rank 0
dies, not rank 1: rank 0 is the launching process, whose child-process observer kills every rank
within 5 s of a child's death, sometimes before the survivor's failed collective reports.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common

common.quiet()

import lightning.pytorch as pl

from lightning_3d import Tensor3DStrategy

KILL_RANK, KILL_STEP, TIMEOUT_S = 0, 4, 60


class KillRank(pl.Callback):
    """Rank ``KILL_RANK`` notes the time in ``OUT/killed_at`` and SIGKILLs itself before step ``KILL_STEP + 1``."""

    def __init__(self, out: Path):
        self.out = out

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == KILL_RANK and trainer.global_step == KILL_STEP:
            (self.out / "killed_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    pl.seed_everything(common.SEED)
    common.fit(
        "lightning.pytorch",
        out,
        "killed",
        Tensor3DStrategy(timeout=TIMEOUT_S),
        epochs=3,
        devices=2,
        callbacks=[KillRank(out)],
    )
