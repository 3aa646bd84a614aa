"""Driver: a run of which one rank gets SIGTERM, then its resumption (Lightning's own launcher: ``devices=2``).

``python preempt.py OUT preempt``: 2×1×1, 3 epochs of 3 steps; rank 1 sends itself SIGTERM
before step 3 (noting the time in ``OUT/signalled_at``). Every rank must stop one step later, at the
end of epoch 0 (global step 3), save ``OUT/preempted.ckpt`` and exit with status 143; each rank
notes when it exits in ``OUT/exit.rank<r>``.
``python preempt.py OUT resume``: the same run resumed from that checkpoint, to the end; its losses
land in ``OUT/resumed.rank<r>.json``.
"""

import atexit
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

SIGNAL_RANK, SIGNAL_STEP, TIMEOUT_S = 1, 2, 60


class SignalRank(pl.Callback):
    """Rank ``SIGNAL_RANK`` sends itself SIGTERM before step ``SIGNAL_STEP + 1``; every rank notes its exit time."""

    def __init__(self, out: Path):
        self.out = out

    def on_train_start(self, trainer, module):
        atexit.register(lambda: (self.out / f"exit.rank{trainer.global_rank}").write_text(str(time.time())))

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == SIGNAL_RANK and trainer.global_step == SIGNAL_STEP:
            (self.out / "signalled_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    pl.seed_everything(common.SEED)
    strategy = Tensor3DStrategy(
        grid=(2, 1, 1),
        data_parallel_size=1,
        timeout=TIMEOUT_S,
        checkpoint_on_preemption=out / "preempted.ckpt",
    )
    if mode == "preempt":
        common.fit(
            "lightning.pytorch", out, "preempted", strategy, epochs=3, devices=2, callbacks=[SignalRank(out)]
        )
    else:
        common.fit(
            "lightning.pytorch",
            out,
            "resumed",
            strategy,
            epochs=3,
            devices=2,
            ckpt_path=out / "preempted.ckpt",
        )
