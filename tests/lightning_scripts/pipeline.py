"""Driver: ``Trainer.fit`` with pipeline stages in one launched world of 4 (``python pipeline.py world4 OUT`` on each
rank, as ``suite.py``), ending in rank 2's death (K); test_strategy_pipeline.py judges the records and exits.

- P: pp 2 × 2×1×1, 1F1B, two layers (one a stage), 2 epochs (model summary printed), then ``validate``
  through the pipeline.
- Q: pp 2 × 1×1×1 × dp 2 with ZeRO-1, Interleaved1F1B (four layers, two stages a rank), two
  micro-batches, batches of 4 sequences accumulated two to a step, 1 epoch, a checkpoint at its end.
- R: Q resumed from that checkpoint at pp 4 × 1×1×1 (1F1B, a layer a stage) for another epoch.
- T: as P, 3 epochs; rank 3 (stage 1) sends itself SIGTERM before step 3 (noting the time in
  ``OUT/signalled_at``): every rank must stop at global step 3, save ``OUT/preempted.ckpt`` and
  raise ``Preempted`` (exit status 143), which each rank catches here, noting its status and the
  time in ``OUT/T.stopped<rank>``, to run on.
- S: ``OUT/preempted.ckpt`` resumed without stages on 1×2×1 × dp 2 with ZeRO-1 (GPT3D), to
  2 epochs.
- K: as P; rank 2 (stage 1) SIGKILLs itself inside the schedule of step 2, at its second
  micro-batch's forward, once its stage has handed the first micro-batch's gradient back (noting the
  time in ``OUT/killed_at``). Every other rank must exit within the 60 s timeout with tensor3d's
  message; each notes when in ``OUT/K.exit<rank>``.

Every run trains DenseGPT with its head tied to its embedding (held by the first and the last stage).
Q, R, S, T and K run in float64 (``precision="64-true"``).
"""

import atexit
import json
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
from lightning_3d.pipeline import PipelineOptions
from lightning_3d.strategy.preemption import Preempted

SIGNAL_RANK, SIGNAL_STEP = 3, 2
KILL_RANK, KILL_STEP = 2, 1
TIMEOUT_S = 60
F64 = "64-true"


class StopRank(pl.Callback):
    """SIGTERM (run T) or SIGKILL inside the schedule (run K) on one rank; in K every rank notes its exit time."""

    def __init__(self, out: Path, run: str):
        self.out, self.run = out, run

    def on_train_start(self, trainer, module):
        rank = trainer.global_rank
        if self.run == "K":
            atexit.register(lambda: (self.out / f"K.exit{rank}").write_text(str(time.time())))

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        rank, step = trainer.global_rank, trainer.global_step
        if self.run == "T" and (rank, step) == (SIGNAL_RANK, SIGNAL_STEP):
            (self.out / "signalled_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGTERM)
        if self.run == "K" and (rank, step) == (KILL_RANK, KILL_STEP):
            forwards = []

            def die_at_the_second(layer, args):
                forwards.append(layer)
                if len(forwards) == 2:
                    (self.out / "killed_at").write_text(str(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)

            next(iter(module.model.transformer.h)).register_forward_pre_hook(die_at_the_second)


def two_stages_of_two(out: Path, run: str, **kwargs) -> None:
    """Runs T and K: pp 2 × 2×1×1, two layers, 3 epochs, float64, rank ``SIGNAL_RANK`` or ``KILL_RANK`` stopping."""
    strategy = Tensor3DStrategy(grid=(2, 1, 1), pipeline_size=2, timeout=TIMEOUT_S, **kwargs)
    common.fit(
        "lightning.pytorch",
        out,
        run,
        strategy,
        epochs=3,
        devices=4,
        n_layer=2,
        pipeline=True,
        callbacks=[StopRank(out, run)],
        checkpoints=False,
        precision=F64,
    )


def preempted(out: Path) -> None:
    """Run T, whose ``Preempted`` every rank catches (see the module doc)."""
    try:
        two_stages_of_two(out, "T", checkpoint_on_preemption=out / "preempted.ckpt")
    except Preempted as stop:
        stopped = {"status": stop.code, "at": time.time()}
        (out / f"T.stopped{os.environ['RANK']}").write_text(json.dumps(stopped))


def world4(out: Path) -> None:
    trainer, module = common.fit(
        "lightning.pytorch",
        out,
        "P",
        Tensor3DStrategy(grid=(2, 1, 1), pipeline_size=2),
        epochs=2,
        devices=4,
        n_layer=2,
        pipeline=True,
        summary=True,
        checkpoints=False,
    )
    validated = common.validate_keeps_shards(trainer, module)
    (out / f"validate.rank{trainer.global_rank}.json").write_text(json.dumps(validated))
    accumulated = dict(
        n_layer=4, pipeline=True, global_batch=common.GLOBAL_BATCH // 2, accumulate=2, precision=F64
    )
    interleaved = PipelineOptions(schedule="Interleaved1F1B", n_microbatches=2)
    common.fit(
        "lightning.pytorch",
        out,
        "Q",
        Tensor3DStrategy(grid=(1, 1, 1), pipeline_size=2, pipeline=interleaved, zero_stage=1),
        epochs=1,
        devices=4,
        **accumulated,
    )
    common.fit(
        "lightning.pytorch",
        out,
        "R",
        Tensor3DStrategy(grid=(1, 1, 1), pipeline_size=4),
        epochs=2,
        devices=4,
        ckpt_path=out / "Q" / "epoch=0.ckpt",
        checkpoints=False,
        **accumulated,
    )
    preempted(out)
    common.fit(
        "lightning.pytorch",
        out,
        "S",
        Tensor3DStrategy(grid=(1, 2, 1), zero_stage=1),
        epochs=2,
        devices=4,
        ckpt_path=out / "preempted.ckpt",
        n_layer=2,
        checkpoints=False,
        precision=F64,
    )
    two_stages_of_two(out, "K")


if __name__ == "__main__":
    pl.seed_everything(common.SEED)
    world4(Path(sys.argv[2]))
