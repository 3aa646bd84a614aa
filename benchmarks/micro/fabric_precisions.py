"""Fabric(strategy=Tensor3DFabricStrategy()) on one GPU in each precision: six AdamW steps of a small DenseGPT.

``python benchmarks/micro/fabric_precisions.py OUT``: builds the model on ``meta``
(``init_module(empty_init=True)``), sets it up, trains on the same random batches in ``32-true``,
``16-mixed``, ``bf16-mixed``, ``bf16-true`` and ``16-true``, saves and loads a checkpoint, and writes
each precision's losses, plugin and loss scaler (or the error) to ``OUT/fabric_precisions.json``.
Needs CUDA (``16-mixed`` runs there only).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch

import lightning_3d
from lightning_3d.models import DenseGPT, GPTConfig

PRECISIONS = ["32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true"]


def train(precision: str, batches: torch.Tensor, path: Path) -> dict:
    fabric = L.Fabric(
        accelerator="cuda", devices=1, strategy=lightning_3d.Tensor3DFabricStrategy(), precision=precision
    )
    fabric.launch()
    torch.manual_seed(1)
    with fabric.init_module(empty_init=True):
        model = DenseGPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128))
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for ids in batches.to(fabric.device):
        loss = model(ids[:, :-1], ids[:, 1:])
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    fabric.save(path, {"model": model, "optimizer": opt, "step": len(losses)})
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(path, state)
    return {
        "loss": losses,
        "loaded_step": state["step"],
        "dtype": str(next(model.parameters()).dtype),
        "plugin": type(fabric.strategy.precision).__name__,
        "scaler": type(getattr(fabric.strategy.precision, "scaler", None)).__name__,
    }


if __name__ == "__main__":
    out = Path(sys.argv[1])
    batches = torch.randint(0, 256, (6, 8, 65), generator=torch.Generator().manual_seed(0))
    results = {"torch": torch.__version__, "lightning": L.__version__}
    for precision in PRECISIONS:
        try:
            results[precision] = train(precision, batches, out / f"ckpt_{precision}")
        except Exception as e:  # a precision that fails is reported with the others
            results[precision] = f"{type(e).__name__}: {e}"
        print(precision, results[precision], flush=True)
    (out / "fabric_precisions.json").write_text(json.dumps(results, indent=1))
