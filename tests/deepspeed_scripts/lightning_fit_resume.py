"""``"tensor3d_deepspeed"`` under Lightning on CPU: fit 1 epoch of 2 steps, checkpoint, resume to 2 epochs,
then validate the checkpoint in a fresh Trainer (DeepSpeed's inference engine); last, a fourth fit
in which rank 1 sends itself SIGTERM before its first step: every rank must stop at the next step
boundary, save ``TMPDIR/preempted.ckpt`` and exit with status 143.

The first fit passes the strategy object; the resumed one names it (``strategy="tensor3d_deepspeed"``)
and gives the config through ``PL_DEEPSPEED_CONFIG_PATH``.

Launched by tests/test_deepspeed.py as ``python lightning_fit_resume.py TMPDIR [cpu|gpu]``; Lightning starts
the other 3 processes (grid 1×1×2, dp 2, ZeRO-2). Every rank compares its replica's losses with a
plain-PyTorch dense model trained on the global batches; rank 0 prints ``RESULT ok``.
"""

import copy
import datetime
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the model of test_deepspeed

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from test_deepspeed import CLIP, LR, WEIGHT_DECAY, B, N, S, dense_model, model_3d
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import deepspeed_3d  # registers "tensor3d_deepspeed"

SHAPE, DP, STEPS, RESUME_AT = (1, 1, 2), 2, 4, 2
ACCELERATOR = sys.argv[2] if len(sys.argv) > 2 else "cpu"
torch.backends.cuda.matmul.allow_tf32 = False  # GPU runs compare with the float32 dense model
TOL = 1e-5


class Module(L.LightningModule):
    def __init__(self, seed: int):
        super().__init__()
        self.seed, self.losses = seed, []

    def configure_model(self):
        with torch.device(
            "cpu"
        ):  # the dense weights from the CPU generator, as in the reference (on GPU too)
            dense = dense_model(self.seed)
        self.model = model_3d(dense, self.grid)

    def training_step(self, batch, _):
        x, target = batch
        loss = F.mse_loss(self.model(x), target)
        self.losses.append(float(loss))
        self.log("loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, _):
        x, target = batch
        self.log("val_loss", F.mse_loss(self.model(x), target), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def dataset() -> TensorDataset:
    """One epoch = RESUME_AT steps of dp micro-batches, so the checkpoint falls on an epoch boundary."""
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(RESUME_AT * DP * B, S, N, generator=g), torch.randn(RESUME_AT * DP * B, S, N, generator=g)
    )


def micro_batches(step: int) -> list[list[int]]:
    """Sample indices of each replica at ``step``: Lightning's shuffled DistributedSampler (seed 0) over dp."""
    samplers = [
        DistributedSampler(dataset(), num_replicas=DP, rank=r, shuffle=True, seed=0) for r in range(DP)
    ]
    for sampler in samplers:
        sampler.set_epoch(step // RESUME_AT)
    k = step % RESUME_AT
    return [list(sampler)[k * B : (k + 1) * B] for sampler in samplers]


def dense_reference(dp_rank: int) -> tuple[list[float], float]:
    """The dense model trained on the global batches: the loss of this replica's micro-batch at each
    step, and the loss over the whole dataset at the checkpoint (after RESUME_AT steps)."""
    x, target = dataset().tensors
    dense = dense_model(seed=0)
    opt = torch.optim.AdamW(dense.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for t in range(STEPS):
        if t == RESUME_AT:
            with torch.no_grad():
                val_loss = float(F.mse_loss(dense(x), target))
        replicas = micro_batches(t)
        rows = [i for micro in replicas for i in micro]
        opt.zero_grad()
        F.mse_loss(dense(x[rows]), target[rows]).backward()
        mine = replicas[dp_rank]
        losses.append(float(F.mse_loss(dense(x[mine]), target[mine])))
        torch.nn.utils.clip_grad_norm_(dense.parameters(), CLIP)
        opt.step()
    return losses, val_loss


CONFIG = {"zero_optimization": {"stage": 2}, "gradient_clipping": CLIP, "tensor3d": {"grid": list(SHAPE)}}


def trainer(epochs: int, tmp: Path, by_name: bool, summary: bool = False) -> L.Trainer:
    """The strategy as an object, or by its registered name with the config from PL_DEEPSPEED_CONFIG_PATH."""
    if by_name:
        path = tmp / f"ds_config_{os.getpid()}.json"
        path.write_text(json.dumps(CONFIG))
        os.environ["PL_DEEPSPEED_CONFIG_PATH"] = str(path)
        strategy = "tensor3d_deepspeed"
    else:
        strategy = deepspeed_3d.Tensor3DDeepSpeedStrategy(
            config=copy.deepcopy(CONFIG), timeout=datetime.timedelta(seconds=120)
        )  # Lightning edits it
    return L.Trainer(
        accelerator=ACCELERATOR,
        devices=DP * 2,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=summary,
    )


class SignalRankOne(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def main(tmp: Path) -> None:
    loader = DataLoader(dataset(), batch_size=B)
    first = Module(seed=0)
    t1 = trainer(1, tmp, by_name=False, summary=True)  # rank 0 prints the model summary
    t1.fit(first, loader)
    ckpt = tmp / "resume.ckpt"
    t1.save_checkpoint(ckpt)
    second = Module(seed=5)  # other weights: the checkpoint must overwrite them
    t2 = trainer(STEPS // RESUME_AT, tmp, by_name=True)
    t2.fit(second, loader, ckpt_path=ckpt)
    t3 = trainer(1, tmp, by_name=False)
    val_loss = t3.validate(Module(seed=9), loader, ckpt_path=ckpt, verbose=False)[0]["val_loss"]
    grid = t2.strategy.grid
    losses = first.losses + second.losses
    expected, expected_val = dense_reference(grid.coord("dp"))
    err = max(abs(a - b) / abs(b) for a, b in zip(losses, expected)) if len(losses) == STEPS else float("inf")
    err = max(err, abs(val_loss - expected_val) / expected_val)
    rank = t2.global_rank
    report = {
        "losses": losses,
        "expected": expected,
        "val_loss": val_loss,
        "expected_val": expected_val,
        "err": err,
    }
    (tmp / f"rank{rank}.json").write_text(json.dumps(report))
    t2.strategy.barrier()
    if rank == 0:
        reports = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(t2.world_size)]
        bad = [(r, rep) for r, rep in enumerate(reports) if not rep["err"] < TOL]
        print("RESULT " + ("ok" if not bad else f"mismatch {bad}"), flush=True)
    strategy = deepspeed_3d.Tensor3DDeepSpeedStrategy(
        config=copy.deepcopy(CONFIG), checkpoint_on_preemption=tmp / "preempted.ckpt"
    )
    t4 = L.Trainer(
        accelerator=ACCELERATOR,
        devices=DP * 2,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        callbacks=[SignalRankOne()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t4.fit(Module(seed=0), loader)  # ends the process: SystemExit(143)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
