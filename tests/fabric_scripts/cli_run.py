"""Driver: a script that
``fabric run --strategy tensor3d --accelerator cpu --devices 2 --precision bf16-mixed`` launches.

``lightning_3d`` is imported first, without importing Lightning; ``"tensor3d"`` is then registered
in both Fabric namespaces. ``Fabric()`` takes the strategy, accelerator and devices from the
command line; one training step; each rank writes ``OUT/cli.rank<r>.json``.
"""

import json
import sys
from pathlib import Path

import lightning_3d  # registers "tensor3d" as each Fabric namespace is imported

assert not {"lightning", "lightning_fabric", "pytorch_lightning"} & set(sys.modules), (
    "import lightning_3d imported Lightning"
)

import lightning_fabric  # noqa: E402
import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent.parent / "lightning_scripts"))

import common  # noqa: E402

common.quiet()

from lightning_3d.models import GPT3D  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    fabric = Fabric()
    torch.manual_seed(common.INIT_SEED)
    with fabric.init_module():  # made of 3-D layers already: setup takes it as it is
        model = GPT3D(common.config())
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=common.LR))
    tokens = common.Tokens().data[: common.GLOBAL_BATCH]
    loss = model(tokens[:, :-1], tokens[:, 1:])
    fabric.backward(loss)
    opt.step()
    registered = [
        lightning_3d.strategy.register(ns) is L.strategies.STRATEGY_REGISTRY["tensor3d"]["strategy"]
        for ns, L in (
            ("lightning.fabric", sys.modules["lightning.fabric"]),
            ("lightning_fabric", lightning_fabric),
        )
    ]
    record = {
        "registered": registered,
        "precision": type(fabric.strategy.precision).__name__,
        "strategy": f"{type(fabric.strategy).__module__}.{type(fabric.strategy).__name__}",
        "grid": list(fabric.strategy.grid.shape),
        "world": fabric.world_size,
        "loss": fabric.all_reduce(loss.detach(), reduce_op="mean").item(),
    }
    (out / f"cli.rank{fabric.global_rank}.json").write_text(json.dumps(record))
