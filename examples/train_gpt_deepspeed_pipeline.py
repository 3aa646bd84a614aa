"""Train the byte-level GPT of ``train_gpt.py`` with DeepSpeed's pipeline engine: stages over the 3-D grid.

``deepspeed_3d.initialize`` splits the plain ``DenseGPT`` (built on ``meta``: each rank
materialises its own stage; its head tied to its embedding, held by the first and the last stage)
into ``--pipeline`` stages, each stage's layers on its cube of ``--grid`` ranks, as DeepSpeed's
``PipelineModule``; ``engine.train_batch`` runs DeepSpeed's
schedule over ``--accumulation`` micro-batches of ``--micro-batch`` sequences per replica
(ZeRO-1, gradient clipping 1.0); ``engine.eval_batch`` the validation loss. The data is
``train_gpt.py``'s: the standard library's own source, as bytes. The run ends with a DeepSpeed
checkpoint in ``OUT`` (convert it with ``python -m deepspeed_3d.checkpoint to-dense OUT dense.pt``).
Launch one process per rank: the world is ``pipeline × grid × dp``.

    torchrun --nproc_per_node 4 examples/train_gpt_deepspeed_pipeline.py                # CPU: pp 2 × 2×1×1
    torchrun --nproc_per_node 8 examples/train_gpt_deepspeed_pipeline.py --grid 2,2,1   # pp 2 × 2×2×1
    deepspeed --num_gpus 8 examples/train_gpt_deepspeed_pipeline.py --grid 2,1,1        # GPUs: dp 2
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler
from train_gpt import Windows, stdlib_bytes

try:
    import deepspeed
except ImportError:
    sys.exit(
        'this example needs DeepSpeed: pip install -e ".[deepspeed]" in the repository (or pip install deepspeed)'
    )

import deepspeed_3d  # noqa: E402
from lightning_3d.models import DenseGPT, GPTConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--pipeline", type=int, default=2, help="pipeline stages (pp)")
    p.add_argument("--grid", default="2,1,1", help="px,py,pz: each stage's cube")
    p.add_argument("--n-layer", type=int, default=4, help="transformer blocks, shared out over the stages")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=int, default=128, help="hidden size")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch and replica")
    p.add_argument("--accumulation", type=int, default=4, help="micro-batches per step (the schedule's)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="standard-library bytes read")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    p.add_argument("--out", default="runs/train_gpt_deepspeed_pipeline", help="checkpoint directory")
    return p.parse_args()


def micro_batches(windows: Windows, micro: int, grid, seed: int):
    """Endless micro-batches ``(ids, targets)`` of this dp replica, the same on every rank of it."""
    sampler = DistributedSampler(
        windows, num_replicas=grid.data_parallel_size, rank=grid.coord("dp"), shuffle=True, seed=seed
    )
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for w in DataLoader(windows, batch_size=micro, sampler=sampler, drop_last=True):
            yield w[:, :-1], w[:, 1:]
        epoch += 1


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accumulation,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1, "torch_adam": True}},
        "steps_per_print": 10,
        "tensor3d": {"grid": [int(s) for s in args.grid.split(",")], "pipeline_size": args.pipeline},
    }
    grid = deepspeed_3d.init_grid_from_config(config)
    gpt = GPTConfig(
        vocab_size=256,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    torch.manual_seed(args.seed)  # the same on every rank: each stage draws the whole model's values
    engine, *_ = deepspeed_3d.initialize(model=DenseGPT(gpt, device="meta"), config=config)
    train, val = stdlib_bytes(args.max_bytes)
    data = micro_batches(
        Windows(train, args.seq_len, 1_000_000, args.seed), args.micro_batch, grid, args.seed
    )
    val_windows = Windows(
        val, args.seq_len, args.micro_batch * args.accumulation * grid.data_parallel_size, 1
    )

    def val_loss() -> float:
        return float(engine.eval_batch(micro_batches(val_windows, args.micro_batch, grid, args.seed)))

    losses = [val_loss()]
    for _ in range(args.steps):
        engine.train_batch(data)  # DeepSpeed prints the loss every steps_per_print steps
    losses.append(val_loss())
    deepspeed_3d.save_checkpoint(engine, args.out)
    if torch.distributed.get_rank() == 0:
        print(f"\nvalidation loss: untrained {losses[0]:.3f} -> {losses[1]:.3f}; checkpoint: {args.out}")


if __name__ == "__main__":
    main()
