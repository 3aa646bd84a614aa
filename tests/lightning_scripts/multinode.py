"""Driver: one "node" of a two-node run on one host (tests/test_multinode.py starts two of them).

- ``python multinode.py lightning OUT``, with ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set:
  ``Trainer(num_nodes=2, devices=2, accelerator="cpu", strategy=Tensor3DStrategy())`` (grid
  ``"auto"``) trains one epoch of ``common``'s tiny GPT3D; Lightning's launcher starts the node's
  other process.
- ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank K ... multinode.py torch OUT``: plain
  ``init_grid`` on grids 2×1×1 (dp 2: a cube per node) and 2×2×1 (one cube on both nodes), three
  AdamW steps of GPT3D against DenseGPT on the same global batches, in every rank.

Each process writes ``OUT/pid.<pid>`` at start; each rank writes ``OUT/<mode>.rank<r>.json``: its grid, node,
where the cube's axes lie, and losses.
"""

import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common
import torch
import torch.distributed as dist

from lightning_3d.grid import node_name

common.quiet()
TIMEOUT = datetime.timedelta(
    seconds=150
)  # the rendezvous waits for every process to import Lightning: over 60 s on a loaded 2-core machine
STEPS = 3


def _place(grid) -> dict:
    return {
        "grid": list(grid.shape),
        "dp": grid.data_parallel_size,
        "coords": list(grid.coords),
        "axes_across_nodes": list(grid.axes_across_nodes),
        "node": node_name(),
        "rank": dist.get_rank(),
    }


def lightning(out: Path) -> None:
    import lightning.pytorch as pl

    from lightning_3d import Tensor3DStrategy

    pl.seed_everything(common.SEED)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        strategy=Tensor3DStrategy(timeout=TIMEOUT),
        max_epochs=1,
        gradient_clip_val=common.CLIP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=out,
    )
    module = common.module_class("lightning.pytorch")()
    trainer.fit(module)
    record = {
        **_place(trainer.strategy.grid),
        "loss": module.record["loss"],
        "batches": module.record["batches"],
    }
    (out / f"lightning.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _batches(dp: int, d: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The first STEPS global batches of 8 sequences, and dp replica ``d``'s share of each."""
    data = common.Tokens().data
    full = [data[s * common.GLOBAL_BATCH : (s + 1) * common.GLOBAL_BATCH] for s in range(STEPS)]
    share = common.GLOBAL_BATCH // dp
    return full, [b[d * share : (d + 1) * share] for b in full]


def _train(model, batches, dp_group=None) -> list[float]:
    opt, _ = common.optimizers(model.parameters())
    losses = []
    for tokens in batches:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if dp_group is not None:  # data parallelism: average every shard's gradient over the replicas
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dist.get_world_size(dp_group)
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=dp_group)
            loss = mean / dist.get_world_size(dp_group)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def plain_torch(out: Path) -> None:
    from lightning_3d import init_grid
    from lightning_3d.models import GPT3D, DenseGPT

    dist.init_process_group("gloo", timeout=TIMEOUT)
    records = {}
    for shape in [(2, 1, 1), (2, 2, 1)]:
        grid = init_grid(shape)
        full, mine = _batches(grid.data_parallel_size, grid.coord("dp"))
        torch.manual_seed(common.INIT_SEED)
        dense = _train(DenseGPT(common.config()), full)
        torch.manual_seed(common.INIT_SEED)
        parallel = _train(
            GPT3D(common.config(), grid=grid), mine, grid.group("dp") if grid.data_parallel_size > 1 else None
        )
        records["×".join(map(str, shape))] = {**_place(grid), "loss": parallel, "dense_loss": dense}
    (out / f"torch.rank{dist.get_rank()}.json").write_text(json.dumps(records))
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    (out / f"pid.{os.getpid()}").write_text("")  # lets the test end every process it started, should one hang
    {"lightning": lightning, "torch": plain_torch}[mode](out)
