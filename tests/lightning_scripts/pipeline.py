"""Driver: ``Trainer.fit`` with pipeline stages in one launched world of 4 (``python pipeline.py world4 OUT`` on
each rank, as ``suite.py``); test_strategy_pipeline.py judges the records.

- P: pp 2 × 2×1×1, 1F1B, two layers (one a stage), 2 epochs (model summary printed), then ``validate``
  through the pipeline.
- Q: pp 2 × 1×1×1 × dp 2 with ZeRO-1, Interleaved1F1B (four layers, two stages a rank), two
  micro-batches, batches of 4 sequences accumulated two to a step, 1 epoch.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common

common.quiet()


def main(out: Path) -> None:
    import lightning.pytorch as pl

    from lightning_3d import Tensor3DStrategy
    from lightning_3d.pipeline import PipelineOptions

    pl.seed_everything(common.SEED)
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
    )
    validated = common.validate_keeps_shards(trainer, module)
    (out / f"validate.rank{trainer.global_rank}.json").write_text(json.dumps(validated))
    common.fit(
        "lightning.pytorch",
        out,
        "Q",
        Tensor3DStrategy(
            grid=(1, 1, 1),
            pipeline_size=2,
            pipeline=PipelineOptions(schedule="Interleaved1F1B", n_microbatches=2),
            zero_stage=1,
        ),
        epochs=1,
        devices=4,
        n_layer=4,
        pipeline=True,
        global_batch=common.GLOBAL_BATCH // 2,
        accumulate=2,
    )


if __name__ == "__main__":
    main(Path(sys.argv[2]))
