"""Pretrain a small LitGPT model with ``Fabric(strategy="tensor3d")`` on the Python standard library's own source.

The model is LitGPT's own ``litgpt.model.GPT`` (``Config.from_name("pythia-14m")`` by default, any
LitGPT config name with ``--model``) over bytes (vocabulary 256); the text is the standard
library's ``.py`` files, as in ``train_gpt.py`` (no download). ``fabric.setup`` puts the model on
the grid with its built-in plan. Without a GPU it runs 8 CPU processes (gloo) on a 2×2×2 grid;
with GPUs it uses all of them (grid ``"auto"``). It prints loss and tokens/s, writes a sharded
checkpoint every ``--save-every`` steps (``OUT/checkpoints``), continues from the newest one with
``--resume``, and ends by exporting what LitGPT's own scripts load: ``OUT/final/lit_model.pth``
(LitGPT's state dict) and ``OUT/final/model_config.yaml``.

    pip install litgpt                                # or: pip install -e ".[litgpt]"
    python examples/fabric_litgpt.py                  # CPU: 8 processes, a few minutes
    python examples/fabric_litgpt.py --resume --max-steps 120
    litgpt convert_from_litgpt runs/fabric_litgpt/final runs/fabric_litgpt/hf   # LitGPT's converter to Hugging Face
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import lightning_3d
from lightning_3d.checkpoint import latest_complete
from lightning_3d.litgpt import cross_entropy

sys.path.insert(0, str(Path(__file__).parent))
from train_gpt import Windows, stdlib_bytes  # noqa: E402  (the data train_gpt.py trains on)

try:
    from lightning.fabric import Fabric
except ImportError:
    from lightning_fabric import Fabric

BYTES = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default="runs/fabric_litgpt", help="checkpoints and the export go here")
    p.add_argument(
        "--model",
        default="pythia-14m",
        help="a LitGPT config name (litgpt.Config.from_name), with a byte vocabulary",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in OUT/checkpoints",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=torch.cuda.device_count() if gpu else 8,
        help="processes (GPUs, or CPU processes)",
    )
    p.add_argument("--grid", default="auto" if gpu else "2,2,2", help="'auto' or px,py,pz")
    p.add_argument("--precision", default="bf16-mixed" if gpu else "32-true", help="Fabric's precision flag")
    p.add_argument(
        "--max-steps",
        type=int,
        default=1000 if gpu else 60,
        help="optimizer steps of the whole run (a resumed one too)",
    )
    p.add_argument(
        "--save-every", type=int, default=200 if gpu else 20, help="steps between sharded checkpoints"
    )
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument(
        "--batch-size", type=int, default=64 if gpu else 8, help="global: sequences a step over all replicas"
    )
    p.add_argument("--seq-len", type=int, default=256 if gpu else 64, help="tokens (bytes) a sequence")
    p.add_argument(
        "--lr",
        type=float,
        default=1e-3 if gpu else 3e-3,
        help="peak AdamW learning rate (cosine decay to 10%%)",
    )
    p.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=12_000_000 if gpu else 2_000_000,
        help="how much of the standard library to read",
    )
    p.add_argument("--seed", type=int, default=1337, help="seed of the model init and the data order")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (RuntimeOptions.compile)")
    return p.parse_args(argv)


def litgpt_config(args: argparse.Namespace):
    """LitGPT's config ``--model`` over bytes, its context ``--seq-len``."""
    from litgpt import Config

    return Config.from_name(args.model, vocab_size=BYTES, padded_vocab_size=BYTES, block_size=args.seq_len)


def make_fabric(args: argparse.Namespace) -> Fabric:
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    options = lightning_3d.RuntimeOptions(compile=args.compile)
    if args.grid == "auto":
        strategy = lightning_3d.strategy.Tensor3DFabricStrategy(options=options)
    else:
        strategy = lightning_3d.strategy.Tensor3DFabricStrategy(
            grid=tuple(int(n) for n in args.grid.split(",")), options=options
        )
    return Fabric(accelerator=accelerator, devices=args.devices, strategy=strategy, precision=args.precision)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to 10% of ``--lr``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def replica_batch(windows: Windows, step: int, batch_size: int, dp: int, dp_rank: int) -> torch.Tensor:
    """Step ``step``'s sequences of replica ``dp_rank``: windows ``[step·B, (step+1)·B)`` cut into dp parts
    (so a resumed run reads exactly what an uninterrupted one would)."""
    per = batch_size // dp
    first = (step * batch_size + dp_rank * per) % len(windows)
    return torch.stack([windows[(first + i) % len(windows)] for i in range(per)])


def export(fabric: Fabric, model: torch.nn.Module, config, folder: Path) -> None:
    """LitGPT's checkpoint folder: ``lit_model.pth`` (its state dict) and ``model_config.yaml`` (collective)."""
    from litgpt.utils import save_config

    state = lightning_3d.dense_state_dict(model)  # LitGPT's full state dict, on every cube rank
    if fabric.global_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / "lit_model.pth")
        save_config(config, folder)
        fabric.print(f"exported LitGPT's checkpoint to {folder} (lit_model.pth, model_config.yaml)")
    fabric.barrier()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from litgpt.model import GPT

    fabric = make_fabric(args)
    fabric.launch()
    grid = fabric.strategy.grid
    dp, dp_rank = grid.data_parallel_size, grid.coord("dp")
    if args.batch_size % dp:
        raise ValueError(f"--batch-size {args.batch_size} must be divisible by the data-parallel size {dp}")
    fabric.seed_everything(args.seed)  # the same model init on every rank
    config = litgpt_config(args)
    with fabric.init_module(empty_init=True):  # on meta: setup draws each rank's shards
        model = GPT(config)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    )
    fabric.print(
        f"LitGPT {args.model}: {config.n_layer} layers, {config.n_embd} wide, {config.n_head} heads; "
        f"grid {grid.shape}, dp {dp}"
    )

    out = Path(args.out)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        newest = latest_complete(out / "checkpoints")
        if newest is None:
            raise SystemExit(f"--resume: no complete checkpoint in {out / 'checkpoints'}")
        fabric.load(newest, state)
        fabric.print(f"resumed from {newest} at step {state['step']}")

    train, _ = stdlib_bytes(args.max_bytes)
    windows = Windows(train, args.seq_len, 1_000_000, args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    tick, logged = time.perf_counter(), state["step"]
    while state["step"] < args.max_steps:
        step = state["step"]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        batch = replica_batch(windows, step, args.batch_size, dp, dp_rank).to(fabric.device)
        logits = model(batch[:, :-1])  # this rank's y-layout block of the logits
        loss = cross_entropy(model, logits, batch[:, 1:])  # the same scalar on every cube rank
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if state["step"] % args.log_every == 0 or state["step"] == args.max_steps:
            mean = fabric.all_reduce(
                loss.detach(), reduce_op="mean"
            ).item()  # over every rank: the mean over the replicas
            now = time.perf_counter()
            rate = tokens_per_step * (state["step"] - logged) / (now - tick)
            fabric.print(f"step {state['step']:5d}/{args.max_steps}  loss {mean:.4f}  {rate:,.0f} tok/s")
            tick, logged = now, state["step"]
        if state["step"] % args.save_every == 0 or state["step"] == args.max_steps:
            path = out / "checkpoints" / f"step-{state['step']:06d}"
            fabric.save(path, state)
            fabric.print(f"saved {path}")
    export(fabric, model, config, out / "final")


if __name__ == "__main__":
    main()
