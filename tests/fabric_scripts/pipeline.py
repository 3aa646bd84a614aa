"""Driver: Fabric loops, and one ``Trainer.fit``, with pipeline stages in one launched world of 4
(``python pipeline.py world4 OUT`` on each rank, as ``suite.py``); test_fabric_pipeline.py judges them.

Every run trains the untied two-layer ``DenseGPT`` of ``common.config(n_layer=2, tied=False)`` (built on
``meta``: one layer a stage at pp 2) with ``common.optimizers`` (AdamW and its LR schedule), clipped at
``common.CLIP`` by the global norm, on the global batches of 8 that one epoch of ``common.Tokens``
gives in the order of ``DistributedSampler(shuffle=True, seed=common.SEED)``: 3 steps, as
``common.dense_reference``. Each run writes ``OUT/<run>.rank<r>.json`` (losses, clipped gradient
norms) and, from each stage's first replica's cube rank 0, the stage's dense parameters after the
steps (``OUT/<run>.stage<s>.pt``).

- FP: Fabric ``64-true``, pp 2 × 2×1×1 (1F1B, two micro-batches), ``fabric.setup(model, optimizer)``.
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
from torch.nn.parallel import DistributedDataParallel
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


def fabric_run(out: Path, name: str, strategy, precision: str) -> None:
    """One Fabric loop of ``STEPS`` steps (see the module doc)."""
    import lightning.fabric as L

    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy, precision=precision)
    fabric.launch()
    fabric.seed_everything(common.SEED)
    torch.manual_seed(common.INIT_SEED)
    with fabric.init_module(empty_init=True):
        model = DenseGPT(common.config(n_layer=2, tied=False))
    meta_built = all(p.is_meta for p in model.parameters())
    opt, sched = common.optimizers(model.parameters())
    model, opt = fabric.setup(model, opt)
    grid = fabric.strategy.grid
    record = {
        "grid": list(grid.shape),
        "dp": grid.data_parallel_size,
        "stage": grid.stage,
        "meta_built": meta_built,
        "dtype": str(next(model.parameters()).dtype),
        "optimized": sorted(
            n for n, p in model.named_parameters() if any(p is q for q in opt.param_groups[0]["params"])
        ),
        "held": sorted(n for n, _ in model.named_parameters()),
        "loss": [],
        "grad_norm": [],
    }
    loader = fabric.setup_dataloaders(
        DataLoader(common.Tokens(), batch_size=common.GLOBAL_BATCH // grid.data_parallel_size, shuffle=True)
    )
    for _, tokens in loader:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        fabric.backward(loss)
        record["grad_norm"].append(fabric.clip_gradients(model, opt, max_norm=common.CLIP).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        record["loss"].append(fabric.strategy.all_reduce(loss.detach().double(), reduce_op="mean").item())
    bare = model._forward_module
    save_stage(out, name, grid, bare.module if isinstance(bare, DistributedDataParallel) else bare)
    (out / f"{name}.rank{fabric.global_rank}.json").write_text(json.dumps(record))


def world4(out: Path) -> None:
    import lightning.pytorch as pl

    from lightning_3d import Tensor3DFabricStrategy, Tensor3DStrategy
    from lightning_3d.pipeline import PipelineOptions

    stages = dict(grid=(2, 1, 1), pipeline_size=2)
    fabric_run(
        out, "FP", Tensor3DFabricStrategy(**stages, pipeline=PipelineOptions(n_microbatches=2)), "64-true"
    )
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
