"""Driver: a checkpoint of another model is refused under fit and validate; ``ckpt_path="last"`` resumes.

``python other_model.py OUT`` (one process, grid 1×1×1): fits a 2-layer, vocab-60 GPT3D for one
epoch with ``ModelCheckpoint(save_last=True)``, then loads its checkpoint into a vocab-62 model
and into a 1-layer model under ``validate`` and ``fit``, and resumes the first model from "last".
Writes ``OUT/first.ckpt`` (after the first fit), ``OUT/dense_state.pt`` (its model as DenseGPT's
state dict) and ``OUT/other_model.json`` (the error of each attempt, the steps run after resuming from "last").
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_3d.models import GPT3D, GPTConfig

VOCAB, SEQ = 60, 8


class TinyGPT(pl.LightningModule):
    def __init__(self, vocab: int = VOCAB, layers: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.model = None
        self.steps_run = 0

    def configure_model(self):
        if self.model is None:
            torch.manual_seed(0)
            self.model = GPT3D(
                GPTConfig(
                    vocab_size=self.hparams.vocab,
                    block_size=SEQ,
                    n_layer=self.hparams.layers,
                    n_head=2,
                    n_embd=16,
                )
            )

    def training_step(self, tokens, _):
        self.steps_run += 1
        return self.model(tokens[:, :-1], tokens[:, 1:])

    def validation_step(self, tokens, _):
        self.log("val_loss", self.model(tokens[:, :-1], tokens[:, 1:]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader():
    return DataLoader(
        torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(0)), batch_size=4
    )


def trainer(out: Path, epochs: int = 1) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="tensor3d",
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpts", filename="{epoch}", save_last=True)],
    )


def main(out: Path) -> None:
    first, fitted = TinyGPT(), trainer(out)
    fitted.fit(first, loader(), loader())
    saved = out / "first.ckpt"
    fitted.save_checkpoint(saved)
    torch.save(first.model.dense_state_dict(), out / "dense_state.pt")
    errors = {}
    for vocab, layers in [(62, 2), (60, 1)]:
        for fn in ("validate", "fit"):
            t, model = trainer(out, 2), TinyGPT(vocab, layers)
            try:
                t.validate(model, loader(), ckpt_path=saved) if fn == "validate" else t.fit(
                    model, loader(), ckpt_path=saved
                )
                errors[f"{fn} vocab {vocab} layers {layers}"] = None
            except Exception as e:  # the message is what the test judges
                errors[f"{fn} vocab {vocab} layers {layers}"] = f"{type(e).__name__}: {e}"
    resumed = TinyGPT()
    trainer(out, 2).fit(resumed, loader(), loader(), ckpt_path="last")
    (out / "other_model.json").write_text(
        json.dumps({"errors": errors, "steps_after_resume": resumed.steps_run})
    )


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
