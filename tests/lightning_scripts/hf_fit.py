"""Driver: a Hugging Face Llama (GQA, padding masks) trained 3 AdamW steps under ``Trainer(strategy="tensor3d")``.

``python hf_fit.py OUT`` on each of 4 ranks (``RANK``, ``WORLD_SIZE``, ... set by the test): grid
1×2×1 with dp 2, float64. ``configure_model`` builds the model from ``INIT_SEED`` and
parallelizes it with its built-in plan. Each rank writes ``OUT/hf.rank<r>.json`` (the sequence
indices of each step's batch, the dp-mean loss of each step); after fit ``save_pretrained`` writes
``OUT/trained`` and the strategy a checkpoint ``OUT/last.ckpt``. test_hf_parallelize.py replays
the same batches on the dense model.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common
import torch
from torch.utils.data import DataLoader, Dataset

common.quiet()

INIT_SEED, STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 3, 8, 8, 60
LR = 1e-2


def llama():
    """The model, drawn in float64 from ``INIT_SEED`` (whatever the default dtype: Lightning's 64-true sets it)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(INIT_SEED)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


class Padded(Dataset):
    """``GLOBAL_BATCH · STEPS`` sequences of random tokens with random right padding (labels -100 there)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ), generator=g)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (len(self.ids),), generator=g)
        self.mask = (torch.arange(SEQ) < lengths[:, None]).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {
            "index": i,
            "input_ids": self.ids[i],
            "attention_mask": self.mask[i],
            "labels": self.ids[i].masked_fill(self.mask[i] == 0, -100),
        }


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def main(out: Path) -> None:
    import lightning.pytorch as pl

    from lightning_3d import Tensor3DStrategy, parallelize, save_pretrained

    class LitHF(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.record = None, {"batches": [], "loss": []}

        def configure_model(self):
            if self.model is None:
                self.model = parallelize(llama())

        def train_dataloader(self):
            return DataLoader(Padded(), batch_size=GLOBAL_BATCH // self.grid.data_parallel_size)

        def training_step(self, batch, batch_idx):
            index = batch.pop("index")
            loss = self.model(**batch).loss
            self.record["batches"].append(index.tolist())
            self.record["loss"].append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
            return loss

        def configure_optimizers(self):
            return optimizer(self.parameters())

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=Tensor3DStrategy(grid=(1, 2, 1), data_parallel_size=2),
        precision="64-true",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=out,
    )
    module = LitHF()
    trainer.fit(module)
    save_pretrained(module.model, out / "trained")
    trainer.save_checkpoint(
        out / "last.ckpt"
    )  # the strategy's sharded checkpoint (LightningModule keys: "model." ...)
    record = {**module.record, "dp_rank": module.grid.coord("dp")}
    (out / f"hf.rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
