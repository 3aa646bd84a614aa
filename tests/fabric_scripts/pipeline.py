"""Driver: Fabric loops, and one ``Trainer.fit``, with pipeline stages in one launched world of 4
(``python pipeline.py world4 OUT`` on each rank, as ``suite.py``); test_fabric_pipeline.py judges them.

Every run trains the two-layer ``DenseGPT`` of ``common.config(n_layer=2)`` (its head tied to its
embedding, which the first and the last stage each hold; built on ``meta``: one layer a stage at
pp 2) with ``common.optimizers`` (AdamW and its LR schedule), clipped at
``common.CLIP`` by the global norm, on the global batches of 8 that ``common.Tokens`` gives in the order
of ``DistributedSampler(shuffle=True, seed=common.SEED)``, epoch by epoch: 3 steps an epoch, as
``common.dense_reference``. Each run writes ``OUT/<run>.rank<r>.json`` (losses, clipped gradient
norms, what ``fabric.setup`` returned) and, from each stage's first replica's cube rank 0, the stage's
dense parameters after the steps (``OUT/<run>.stage<s>.pt``).

- FP: Fabric ``64-true``, pp 2 × 2×1×1 (1F1B, two micro-batches), ``fabric.setup(model, optimizer)``;
  saves ``OUT/FP.ckpt`` (model, optimizer, scheduler, step) after its epoch.
- FZ: Fabric ``64-true``, pp 2 × 1×1×1 × dp 2 with ZeRO-1: loads ``OUT/FP.ckpt`` and trains the second
  epoch, each step two batches of 2 a replica, the first under ``fabric.no_backward_sync``; saves
  ``OUT/FZ.ckpt``.
- FR: Fabric ``64-true`` without stages, 1×2×2: loads ``OUT/FZ.ckpt`` and trains the third epoch.
- FB: Fabric ``bf16-mixed``, pp 2 × 2×1×1.
- FA: Fabric ``bf16-mixed`` without stages, 2×1×1 × dp 2 (the same cube; a replica's batch is FB's
  micro-batch).
- TB: the Trainer (``lightning.pytorch``) ``bf16-mixed``, pp 2 × 2×1×1.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "lightning_scripts"))

import common

common.quiet()

import torch
from torch.utils.data import DataLoader

from lightning_3d import dense_state_dict
from lightning_3d.models import DenseGPT

STEPS = common.N_SEQ // common.GLOBAL_BATCH


def save_stage(out: Path, name: str, grid, model: torch.nn.Module) -> None:
    """The dense parameters of this rank's stage (collective over the cube), saved by its first replica's
    cube rank 0."""
    state = dense_state_dict(model)
    if grid.coord("dp") == 0 and grid.rank_in("cube") == 0:
        torch.save(state, out / f"{name}.stage{grid.stage}.pt")


def batches(fabric, epoch: int, size: int):
    """``setup_dataloaders``' batches of ``size`` sequences a replica, at epoch ``epoch`` (Fabric counts a
    loader's epochs by its iterations: a resumed run passes over the epochs before its own)."""
    loader = fabric.setup_dataloaders(DataLoader(common.Tokens(), batch_size=size, shuffle=True))
    for _ in range(epoch):
        next(iter(loader))
    return loader


def replicas_agree(fabric, grid, model) -> bool:
    """Whether this rank's gradients equal those of its dp replicas (each parameter's norm)."""
    norms = torch.stack([p.grad.norm() for p in model.parameters()])
    spread = fabric.all_gather(norms, group=grid.group("dp"))  # [dp, params]
    return all(torch.equal(spread[0], other) for other in spread)


def fabric_run(
    out: Path,
    name: str,
    strategy,
    precision: str,
    load: Path | None = None,
    save: Path | None = None,
    micro_batches: int = 1,
) -> None:
    """One Fabric loop of ``STEPS`` steps (see the module doc), after ``load``'s if given; each step
    ``micro_batches`` batches, all but the last under ``no_backward_sync``."""
    import lightning.fabric as L

    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy, precision=precision)
    fabric.launch()
    fabric.seed_everything(common.SEED)
    torch.manual_seed(common.INIT_SEED)
    with fabric.init_module(empty_init=True):
        model = DenseGPT(common.config(n_layer=2))
    meta_built = all(p.is_meta for p in model.parameters())
    opt, sched = common.optimizers(model.parameters())
    model, opt = fabric.setup(model, opt)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    if load is not None:
        fabric.load(load, state)
    grid = fabric.strategy.grid
    params = dict(model.module.named_parameters())
    shards = model.state_dict()
    record = {
        "grid": list(grid.shape),
        "dp": grid.data_parallel_size,
        "stage": grid.stage,
        "meta_built": meta_built,
        "dtype": str(next(model.parameters()).dtype),
        "module": type(model.module).__name__,
        "state_dict": sorted(shards),
        "state_dict_holds_the_shards": all(shards[n].data_ptr() == p.data_ptr() for n, p in params.items()),
        "optimized": sorted(
            n for n, p in params.items() if any(p is q for q in opt.param_groups[0]["params"])
        ),
        "held": sorted(params),
        "first_step": state["step"],
        "loss": [],
        "grad_norm": [],
        "unsynced": [],
        "synced": [],
    }
    loader = iter(
        batches(
            fabric, state["step"] // STEPS, common.GLOBAL_BATCH // grid.data_parallel_size // micro_batches
        )
    )
    for _ in range(STEPS):
        loss = 0.0
        for m in range(micro_batches):
            _, tokens = next(loader)
            last = m == micro_batches - 1
            with fabric.no_backward_sync(model, enabled=not last):
                micro = model(tokens[:, :-1], tokens[:, 1:]) / micro_batches
                fabric.backward(micro)
            loss += micro.detach()
            if micro_batches > 1:
                record["synced" if last else "unsynced"].append(replicas_agree(fabric, grid, model))
        record["grad_norm"].append(fabric.clip_gradients(model, opt, max_norm=common.CLIP).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        state["step"] += 1
        record["loss"].append(fabric.strategy.all_reduce(loss.double(), reduce_op="mean").item())
    record["with_state"] = sorted(n for n, p in params.items() if p in opt.state)
    if save is not None:
        fabric.save(save, state)
    save_stage(out, name, grid, model.module)
    (out / f"{name}.rank{fabric.global_rank}.json").write_text(json.dumps(record))


def world4(out: Path) -> None:
    import lightning.pytorch as pl

    from lightning_3d import Tensor3DFabricStrategy, Tensor3DStrategy
    from lightning_3d.pipeline import PipelineOptions

    stages = dict(grid=(2, 1, 1), pipeline_size=2)
    fabric_run(
        out,
        "FP",
        Tensor3DFabricStrategy(**stages, pipeline=PipelineOptions(n_microbatches=2)),
        "64-true",
        save=out / "FP.ckpt",
    )
    zero = Tensor3DFabricStrategy(grid=(1, 1, 1), data_parallel_size=2, pipeline_size=2, zero_stage=1)
    fabric_run(out, "FZ", zero, "64-true", load=out / "FP.ckpt", save=out / "FZ.ckpt", micro_batches=2)
    fabric_run(out, "FR", Tensor3DFabricStrategy(grid=(1, 2, 2)), "64-true", load=out / "FZ.ckpt")
    fabric_run(out, "FB", Tensor3DFabricStrategy(**stages), "bf16-mixed")
    fabric_run(out, "FA", Tensor3DFabricStrategy(grid=(2, 1, 1), data_parallel_size=2), "bf16-mixed")
    pl.seed_everything(common.SEED)
    trainer, module = common.fit(
        "lightning.pytorch",
        out,
        "TB",
        Tensor3DStrategy(**stages),
        epochs=1,
        devices=4,
        n_layer=2,
        pipeline=True,
        precision="bf16-mixed",
        checkpoints=False,
    )
    save_stage(out, "TB", trainer.strategy.grid, module.model)


if __name__ == "__main__":
    scenario, out = sys.argv[1], Path(sys.argv[2])
    {"world4": world4}[scenario](out)
