"""Driver: a Fabric loop (``lightning_fabric``, auto 2×1×1 on 2 ranks, collective timeout 60 s) that loses a rank.

``python stops.py preempt OUT`` (16-true): rank 1 sends itself SIGTERM after step ``SIGNAL_STEP``'s
``check_preemption`` (noting the time in ``OUT/signalled_at``); every rank must stop at the same
later step, save ``OUT/preempted`` and exit with status 143.
``python stops.py kill OUT`` (bf16-true): rank 1 SIGKILLs itself there (noting ``OUT/killed_at``); rank 0 must
fail within seconds. Each rank notes when it exits in ``OUT/exit.rank<r>``, and after each step its
parameters' dtype and losses in ``OUT/steps.rank<r>.json``.

Both Fabric namespaces are imported before ``lightning_3d``, which registers ``"tensor3d"`` in
them at once.
"""

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning.fabric
import lightning_fabric

sys.path.insert(0, str(Path(__file__).parent.parent / "lightning_scripts"))

import common

common.quiet()

import torch
from torch.utils.data import DataLoader

from lightning_3d.models import DenseGPT
from lightning_3d.strategy.lightning_fabric import Tensor3DFabricStrategy

SIGNAL_RANK, SIGNAL_STEP, TIMEOUT_S = 1, 2, 60
PRECISION = {"preempt": "16-true", "kill": "bf16-true"}


def main(mode: str, out: Path) -> None:
    for L, namespace in ((lightning.fabric, "fabric"), (lightning_fabric, "lightning_fabric")):
        registered = L.strategies.STRATEGY_REGISTRY["tensor3d"]["strategy"]
        assert registered.__module__ == f"lightning_3d.strategy.{namespace}", registered
    strategy = Tensor3DFabricStrategy(timeout=TIMEOUT_S, checkpoint_on_preemption=out / "preempted")
    fabric = lightning_fabric.Fabric(
        accelerator="cpu", devices=2, strategy=strategy, precision=PRECISION[mode]
    )
    fabric.launch()
    atexit.register(lambda: (out / f"exit.rank{fabric.global_rank}").write_text(str(time.time())))
    torch.manual_seed(common.INIT_SEED)
    with fabric.init_module():  # materialised: parallelize shards its weights
        model = DenseGPT(common.config())
    # eps 1e-4: AdamW's default 1e-8 is 0 in fp16, and 16-true's first update would divide by it
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=common.LR, eps=1e-4))
    loader = fabric.setup_dataloaders(
        DataLoader(common.Tokens(), batch_size=common.GLOBAL_BATCH, shuffle=True)
    )
    state = {"model": model, "optimizer": opt, "step": 0}
    record = {"dtype": str(next(model.parameters()).dtype), "loss": []}
    for _ in range(3):
        for _, tokens in loader:
            fabric.strategy.check_preemption(state)
            if fabric.global_rank == SIGNAL_RANK and state["step"] == SIGNAL_STEP:
                (out / ("signalled_at" if mode == "preempt" else "killed_at")).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGTERM if mode == "preempt" else signal.SIGKILL)
            loss = model(tokens[:, :-1], tokens[:, 1:])
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            state["step"] += 1
            record["loss"].append(loss.item())
            (out / f"steps.rank{fabric.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
