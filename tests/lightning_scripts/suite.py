"""Driver: several ``Trainer.fit`` runs in one launched world (the test starts every rank with env vars).

``python suite.py SCENARIO OUT`` on each rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` set), so Lightning creates no processes itself and one world
serves several Trainers. Each run writes ``OUT/<run>.rank<r>.json``; test_strategy.py judges them.

- ``world4`` (lightning.pytorch, 4 ranks): A ``strategy="tensor3d"`` by name (auto 2×2×1), 2 epochs;
  B 2×1×1 dp 2 with ZeRO-1 resumed from A's epoch-0 checkpoint; C 1×2×2 with dropout, 2 epochs;
  D resumed from C's epoch-0 checkpoint;
  F 2×1×1 dp 2 (one dataloader worker a rank, model summary printed), then ``validate``;
  H the same in bf16-mixed, 1 epoch;
  I the same in float32 with the dp gradients reduced in fp16 (``ddp_comm_hook``; bf16 needs NCCL) and the
  strategy's ``options`` (re-gathered weights, no token-range check: the same numbers), 1 epoch;
  J 2×1×1 dp 2 at one sequence a replica (token rows), 1 epoch.
- ``world1`` (pytorch_lightning): LightningCLI parses the strategy by name and by class_path;
  E ``strategy="tensor3d"`` by name (auto 1×1×1) resumed from B's last checkpoint, 3 epochs.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common

common.quiet()


def world4(out: Path) -> None:
    import lightning.pytorch as pl
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lightning_3d import RuntimeOptions, Tensor3DStrategy

    pl.seed_everything(common.SEED)
    common.fit("lightning.pytorch", out, "A", "tensor3d", epochs=2, devices=4)
    common.fit(
        "lightning.pytorch",
        out,
        "B",
        Tensor3DStrategy(grid=(2, 1, 1), data_parallel_size=2, zero_stage=1),
        epochs=2,
        devices=4,
        ckpt_path=out / "A" / "epoch=0.ckpt",
    )
    common.fit(
        "lightning.pytorch", out, "C", Tensor3DStrategy(grid=(1, 2, 2)), epochs=2, devices=4, dropout=0.1
    )
    common.fit(
        "lightning.pytorch",
        out,
        "D",
        Tensor3DStrategy(grid=(1, 2, 2)),
        epochs=2,
        devices=4,
        dropout=0.1,
        ckpt_path=out / "C" / "epoch=0.ckpt",
    )

    pl.seed_everything(common.SEED, workers=True)  # workers seeded by dp rank: the same within a cube
    trainer, module = common.fit(
        "lightning.pytorch",
        out,
        "F",
        Tensor3DStrategy(grid=(2, 1, 1), data_parallel_size=2),
        epochs=2,
        devices=4,
        summary=True,
        workers=1,
    )
    validated = common.validate_keeps_shards(trainer, module)
    (out / f"validate.rank{trainer.global_rank}.json").write_text(json.dumps(validated))
    common.fit(
        "lightning.pytorch",
        out,
        "H",
        Tensor3DStrategy(grid=(2, 1, 1), data_parallel_size=2),
        epochs=1,
        devices=4,
        precision="bf16-mixed",
    )
    common.fit(
        "lightning.pytorch",
        out,
        "I",
        Tensor3DStrategy(
            grid=(2, 1, 1),
            data_parallel_size=2,
            ddp_comm_hook=default_hooks.fp16_compress_hook,
            options=RuntimeOptions(save_gathered=False, check_inputs=False),
            bucket_cap_mb=1,
        ),
        epochs=1,
        devices=4,
    )
    common.fit(
        "lightning.pytorch",
        out,
        "J",
        Tensor3DStrategy(grid=(2, 1, 1), data_parallel_size=2),
        epochs=1,
        devices=4,
        global_batch=2,
    )


def world1(out: Path, resume_from: str) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.cli import LightningCLI

    import lightning_3d  # noqa: F401  registers "tensor3d" (pytorch_lightning imported first: at once)

    cls = common.module_class("pytorch_lightning")
    by_name = LightningCLI(
        cls, run=False, args=["--trainer.strategy=tensor3d", "--trainer.accelerator=cpu"]
    ).trainer.strategy
    by_path = LightningCLI(
        cls,
        run=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.strategy.class_path=lightning_3d.strategy.pytorch_lightning.Tensor3DStrategy",
            "--trainer.strategy.init_args.grid=[1, 1, 1]",
            "--trainer.strategy.init_args.zero_stage=1",
            "--trainer.strategy.init_args.timeout=45",
        ],
    ).trainer.strategy
    cli = {
        "by_name": type(by_name).__qualname__,
        "by_name_bases": [c.__module__ for c in type(by_name).__mro__],
        "by_path": type(by_path).__qualname__,
        "by_path_args": [list(by_path._grid_arg), by_path.zero_stage, by_path._timeout.total_seconds()],
    }
    (out / "cli.json").write_text(json.dumps(cli))
    pl.seed_everything(common.SEED)
    common.fit("pytorch_lightning", out, "E", "tensor3d", epochs=3, devices=1, ckpt_path=resume_from)


if __name__ == "__main__":
    scenario, out = sys.argv[1], Path(sys.argv[2])
    {"world4": world4, "world1": world1}[scenario](out, *sys.argv[3:])
