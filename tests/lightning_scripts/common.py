"""What the Lightning driver scripts share: a tiny GPT3D LightningModule, its data, and the dense reference.

Data: 24 sequences of 9 tokens following ``x → (a·x + c) mod 60`` (learnable), the global batch 8
(3 steps an epoch), split over dp by Lightning's DistributedSampler (shuffle, seed ``SEED``). The
dense reference trains ``DenseGPT`` from the same init on the same global batches with the same
optimizer, schedule and clipping, so a correct strategy gives its losses and gradient norms.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_3d.grad_norm import grad_norm
from lightning_3d.models import GPT3D, DenseGPT, GPTConfig
from lightning_3d.parallel import options_of

SEED = 7
INIT_SEED = 1234
N_SEQ, SEQ, GLOBAL_BATCH = 24, 8, 8
CLIP = 0.3
LR = 1e-2


def config(dropout: float = 0.0, n_layer: int = 1, tied: bool = True) -> GPTConfig:
    return GPTConfig(
        vocab_size=60,
        block_size=SEQ,
        n_layer=n_layer,
        n_head=2,
        n_embd=16,
        dropout=dropout,
        tie_embeddings=tied,
    )


class Tokens(Dataset):
    """``(index, tokens [SEQ+1])``; the index lets a test see which rank got which sample."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, 60, (N_SEQ,), generator=g)
        mult = torch.randint(1, 8, (N_SEQ,), generator=g)
        seqs = [start]
        for _ in range(SEQ):
            seqs.append((seqs[-1] * mult + 1) % 60)
        self.data = torch.stack(seqs, 1)

    def __len__(self):
        return N_SEQ

    def __getitem__(self, i):
        return i, self.data[i]


class WithDraws(Dataset):
    """``(index, tokens, draw)``: ``draw`` is ``torch.rand(())`` taken in the dataloader worker that loads the
    sample."""

    def __init__(self, data: Dataset):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return (*self.data[i], torch.rand(()))


def optimizers(params):
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.2 * step))


def module_class(namespace: str):
    """``LitGPT`` for ``lightning.pytorch`` or ``pytorch_lightning``."""
    pl = importlib.import_module(namespace)

    class LitGPT(pl.LightningModule):
        """``workers > 0``: the training data is loaded by that many worker processes, which draw a random
        number a sample. ``pipeline``: the plain DenseGPT (its head tied to its embedding across the first
        and the last stage), which the strategy splits into pipeline stages."""

        def __init__(
            self,
            dropout: float = 0.0,
            workers: int = 0,
            global_batch: int = GLOBAL_BATCH,
            n_layer: int = 1,
            pipeline: bool = False,
        ):
            super().__init__()
            self.save_hyperparameters()
            self.model = None
            self.record = {
                "loss": [],
                "grad_norm": [],
                "batches": [],
                "seqs": [],
                "all_gather": None,
                "reduce_sum": None,
                "draws": [],
            }

        def configure_model(self):
            if self.model is None:
                torch.manual_seed(INIT_SEED)
                model = DenseGPT if self.hparams.pipeline else GPT3D
                hp = self.hparams
                self.model = model(config(hp.dropout, hp.n_layer))

        def train_dataloader(self):
            workers = self.hparams.workers
            return DataLoader(
                WithDraws(Tokens()) if workers else Tokens(),
                batch_size=self.hparams.global_batch // self.grid.data_parallel_size,
                num_workers=workers,
            )

        def training_step(self, batch, batch_idx):
            index, tokens, *draws = batch
            self.record["draws"] += [d.tolist() for d in draws]
            loss = self.model(tokens[:, :-1], tokens[:, 1:])
            self.record["batches"].append(index.tolist())
            self.record["loss"].append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
            self.log("seqs", float(len(index)), reduce_fx="sum", sync_dist=True, on_step=True, on_epoch=False)
            if self.record["all_gather"] is None:
                self.record["all_gather"] = self.all_gather(
                    torch.tensor([float(self.grid.coord("dp"))])
                ).tolist()
                self.record["reduce_sum"] = self.trainer.strategy.reduce(
                    torch.tensor(1.0), reduce_op="sum"
                ).item()
            return loss

        def validation_step(self, batch, batch_idx):
            _, tokens = batch
            self.log("val_loss", self.model(tokens[:, :-1], tokens[:, 1:]), sync_dist=True)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.record["seqs"].append(float(self.trainer.callback_metrics["seqs"]))

        def on_before_optimizer_step(self, optimizer):
            self.record["grad_norm"].append(grad_norm(self.parameters(), self.grid).item())

        def configure_optimizers(self):
            opt, sched = optimizers(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return LitGPT


def fit(
    namespace: str,
    out: Path,
    name: str,
    strategy,
    epochs: int,
    devices: int,
    dropout: float = 0.0,
    ckpt_path=None,
    callbacks=(),
    precision="32-true",
    summary=False,
    ckpt_dir=None,
    workers=0,
    global_batch=GLOBAL_BATCH,
    n_layer=1,
    pipeline=False,
    accumulate=1,
    checkpoints=True,
):
    """One ``Trainer.fit`` with a checkpoint at every epoch end under ``ckpt_dir`` (default ``out/name``; none
    without ``checkpoints``); writes ``out/name.rank<r>.json``.

    ``summary``: Lightning's model summary table, printed by rank 0. ``workers``: dataloader worker processes.
    ``global_batch``: sequences a step over all replicas (a batch, with ``accumulate`` batches a step).
    ``pipeline``: the LightningModule builds the plain DenseGPT of ``n_layer`` layers, which the strategy
    splits into stages.
    """
    pl = importlib.import_module(namespace)
    save_every_epoch = importlib.import_module(f"{namespace}.callbacks").ModelCheckpoint(
        dirpath=ckpt_dir or out / name, filename="{epoch}", save_top_k=-1, every_n_epochs=1
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_epochs=epochs,
        gradient_clip_val=CLIP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=summary,
        default_root_dir=out,
        callbacks=[*([save_every_epoch] if checkpoints else []), *callbacks],
        enable_checkpointing=checkpoints,
        accumulate_grad_batches=accumulate,
    )
    module = module_class(namespace)(dropout, workers, global_batch, n_layer, pipeline)
    trainer.fit(module, ckpt_path=ckpt_path)
    strategy = trainer.strategy
    record = {
        **module.record,
        "grid": list(strategy.grid.shape),
        "dp": strategy.grid.data_parallel_size,
        "stage": strategy.grid.stage,
        "coords": list(strategy.grid.coords),
        "strategy": f"{type(strategy).__module__}.{type(strategy).__name__}",
        "global_step": trainer.global_step,
        "options": dataclasses.asdict(options_of(module.model)),  # every 3-D layer's (else options_of raises)
    }
    (out / f"{name}.rank{strategy.global_rank}.json").write_text(json.dumps(record))
    return trainer, module


def validate_keeps_shards(trainer, module) -> dict:
    """``trainer.validate`` after fit: every rank keeps its own shards (nothing broadcast over the world)."""
    before = [p.detach().clone() for p in module.parameters()]
    loader = DataLoader(Tokens(), batch_size=GLOBAL_BATCH // module.grid.data_parallel_size)
    val_loss = trainer.validate(module, dataloaders=loader, verbose=False)[0]["val_loss"]
    kept = all(torch.equal(a, p.detach()) for a, p in zip(before, module.parameters()))
    return {"kept_shards": kept, "val_loss": val_loss}


def dense_reference(
    steps: int,
    dropout: float = 0.0,
    global_batch: int = GLOBAL_BATCH,
    n_layer: int = 1,
    tied: bool = True,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Losses, pre-clip gradient norms and final state of DenseGPT on the same global batches; ``dtype``: the
    default dtype it is built in (``float64``: as ``Trainer(precision="64-true")`` builds it)."""
    torch.manual_seed(INIT_SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = DenseGPT(config(dropout, n_layer, tied))
    finally:
        torch.set_default_dtype(previous)
    opt, sched = optimizers(model.parameters())
    data = Tokens()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    losses, norms, epoch = [], [], 0
    while len(losses) < steps:
        sampler.set_epoch(epoch)
        for _, tokens in DataLoader(data, batch_size=global_batch, sampler=sampler):
            if len(losses) == steps:
                break
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            losses.append(loss.item())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            opt.step()
            sched.step()
            opt.zero_grad()
        epoch += 1
    return {"loss": losses, "grad_norm": norms, "state": model.state_dict()}


def read_records(out: Path, name: str) -> list[dict]:
    """Every rank's record of run ``name``, by rank."""
    files = sorted(out.glob(f"{name}.rank*.json"), key=lambda f: int(f.suffixes[0][5:]))
    return [json.loads(f.read_text()) for f in files]


def quiet() -> None:
    """Keep the drivers' output short and CPU use to one thread per process."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
