"""Driver: Fabric loops (and one Trainer) in one launched world; the test starts every rank with env vars.

``python suite.py SCENARIO OUT`` on each rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` set), so neither Fabric nor Lightning creates processes. Every
run trains ``common.config()``'s GPT in float64 (``64-true``) with AdamW, clipped at
``common.CLIP`` by the global norm, on the global batches of 8 that one epoch of ``common.Tokens``
gives in the order of ``DistributedSampler(shuffle=True, seed=common.SEED)``: 3 steps, the same
order in every run. Each run writes ``OUT/<run>.rank<r>.json``; test_fabric.py judges them.

``world4`` (4 ranks):

- F1 ``lightning.fabric``, 2×1×1 dp 2, ZeRO-1: ``DenseGPT`` built with ``init_module(empty_init=True)``,
  ``fabric.setup(model, optimizer)``; each step two micro-batches, the first under
  ``no_backward_sync``; the world's collectives; saves ``OUT/F1`` (model, optimizer, scheduler, step).
- F2 ``Fabric(strategy="tensor3d")`` (auto 2×2×1): ``setup_module``, then the optimizer and
  ``setup_optimizers``; loads ``OUT/F1``, trains 3 steps.
- T ``Trainer`` (``lightning.pytorch``), 1×2×2: a LightningModule holding GPT3D as ``self.model``,
  ``fit(ckpt_path=OUT/F1)``, 3 steps; its checkpoint ``OUT/T/epoch=0.ckpt``.
- F3 ``lightning_fabric``, 1×1×1 dp 4, the plan given to the strategy: loads ``OUT/T/epoch=0.ckpt``, trains 3 steps.
"""

import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "lightning_scripts"))

import common

common.quiet()

import torch
from torch.utils.data import DataLoader

from lightning_3d.grad_norm import grad_norm
from lightning_3d.models import GPT3D, DenseGPT, gpt_plan

STEPS = common.N_SEQ // common.GLOBAL_BATCH


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=common.LR, weight_decay=0.1)


def scheduler(opt) -> torch.optim.lr_scheduler.LRScheduler:
    """A stateful entry of the state (its ``last_epoch`` counts the steps); a constant factor, so that the Trainer,
    which restores no Fabric scheduler, trains alike."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def write(out: Path, name: str, rank: int, record: dict) -> None:
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(record))


def fabric_run(
    namespace: str,
    out: Path,
    name: str,
    strategy,
    load: Path | None = None,
    save: Path | None = None,
    separately: bool = False,
    micro_batches: int = 1,
    loaded: tuple[str, ...] = ("model", "optimizer", "scheduler", "step"),
) -> None:
    """One Fabric loop of ``STEPS`` steps (see the module doc); ``separately``: ``setup_module`` then
    ``setup_optimizers``; ``loaded``: the entries of the state restored from ``load``."""
    L = importlib.import_module(namespace)
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy, precision="64-true")
    fabric.launch()
    fabric.seed_everything(common.SEED)
    torch.manual_seed(common.INIT_SEED)
    with fabric.init_module(empty_init=True):
        model = DenseGPT(common.config())
    meta_built = all(p.is_meta for p in model.parameters())
    if separately:
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(optimizer(model.parameters()))
    else:
        model, opt = fabric.setup(model, optimizer(model.parameters()))
    sched = scheduler(opt)
    grid = fabric.strategy.grid
    record = {
        "strategy": f"{type(fabric.strategy).__module__}.{type(fabric.strategy).__name__}",
        "grid": list(grid.shape),
        "dp": grid.data_parallel_size,
        "coords": list(grid.coords),
        "meta_built": meta_built,
        "dtype": str(next(model.parameters()).dtype),
        "loss": [],
        "grad_norm": [],
        "batches": [],
        "unsynced": [],
        "synced": [],
    }
    if load is not None:
        state = {
            k: v
            for k, v in {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}.items()
            if k in loaded
        }
        remainder = fabric.load(load, state)
        record.update(
            loaded_step=state.get("step"), scheduler_epoch=sched.last_epoch, remainder=sorted(remainder)
        )
    batch = common.GLOBAL_BATCH // grid.data_parallel_size // micro_batches
    loader = fabric.setup_dataloaders(DataLoader(common.Tokens(), batch_size=batch, shuffle=True))
    batches = iter(loader)
    for _ in range(STEPS):
        losses = []
        for m in range(micro_batches):
            index, tokens = next(batches)
            record["batches"].append(index.tolist())
            last = m == micro_batches - 1
            with fabric.no_backward_sync(model, enabled=not last):
                loss = model(tokens[:, :-1], tokens[:, 1:]) / micro_batches
                fabric.backward(loss)
            losses.append(loss.detach())
            # the gradients of one shard on the two dp replicas: apart before the synced backward, equal after it
            local = torch.stack([p.grad.norm() for p in model.parameters()])
            spread = fabric.all_gather(local)  # [world, params]
            replicas = [
                spread[r]
                for r in range(fabric.world_size)
                if r % grid.cube_size == fabric.global_rank % grid.cube_size
            ]
            equal = all(torch.equal(replicas[0], other) for other in replicas)
            record["synced" if last else "unsynced"].append(equal)
        record["grad_norm"].append(fabric.clip_gradients(model, opt, max_norm=common.CLIP).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        # the strategy's all_reduce: Fabric's own casts float64 to float32
        record["loss"].append(fabric.strategy.all_reduce(sum(losses), reduce_op="mean").item())
    record.update(
        world_sum=fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item(),
        gathered=list(fabric.all_gather(torch.tensor(float(fabric.global_rank))).shape),
        broadcast=fabric.broadcast(f"from {fabric.global_rank}", src=0),
    )
    fabric.barrier()
    if save is not None:
        fabric.save(
            save, {"model": model, "optimizer": opt, "scheduler": sched, "step": STEPS, "note": "fabric"}
        )
    write(out, name, fabric.global_rank, record)


def trainer_run(out: Path, name: str, strategy, ckpt_path: Path) -> None:
    """The Trainer on the same model, data and optimizer; resumes from ``ckpt_path`` (a checkpoint Fabric wrote)."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.record = None, {"loss": [], "grad_norm": []}

        def configure_model(self):
            if self.model is None:
                torch.manual_seed(common.INIT_SEED)
                self.model = GPT3D(common.config())

        def train_dataloader(self):
            return DataLoader(
                common.Tokens(), batch_size=common.GLOBAL_BATCH // self.grid.data_parallel_size, shuffle=True
            )

        def training_step(self, batch, batch_idx):
            _, tokens = batch
            loss = self.model(tokens[:, :-1], tokens[:, 1:])
            self.record["loss"].append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.record["grad_norm"].append(grad_norm(self.parameters(), self.grid).item())

        def configure_optimizers(self):
            return optimizer(self.parameters())

    save = pl.callbacks.ModelCheckpoint(
        dirpath=out / name, filename="{epoch}", save_top_k=-1, every_n_epochs=1
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        precision="64-true",
        max_epochs=1,
        gradient_clip_val=common.CLIP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[save],
    )
    module = Module()
    trainer.fit(module, ckpt_path=ckpt_path)
    write(out, name, trainer.global_rank, {**module.record, "grid": list(trainer.strategy.grid.shape)})


def world4(out: Path) -> None:
    from lightning_3d import Tensor3DFabricStrategy, Tensor3DStrategy
    from lightning_3d.strategy.lightning_fabric import (
        Tensor3DFabricStrategy as FabricStrategyOfLightningFabric,
    )

    fabric_run(
        "lightning.fabric",
        out,
        "F1",
        Tensor3DFabricStrategy(grid=(2, 1, 1), data_parallel_size=2, zero_stage=1),
        save=out / "F1",
        micro_batches=2,
    )
    fabric_run("lightning.fabric", out, "F2", "tensor3d", load=out / "F1", separately=True)
    trainer_run(out, "T", Tensor3DStrategy(grid=(1, 2, 2)), out / "F1")
    fabric_run(
        "lightning_fabric",
        out,
        "F3",
        FabricStrategyOfLightningFabric(grid=(1, 1, 1), data_parallel_size=4, plan=gpt_plan(common.config())),
        load=out / "T" / "epoch=0.ckpt",
        loaded=("model", "optimizer"),
    )


if __name__ == "__main__":
    scenario, out = sys.argv[1], Path(sys.argv[2])
    {"world4": world4}[scenario](out, *sys.argv[3:])
