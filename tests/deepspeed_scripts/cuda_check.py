"""The checks of tests/test_deepspeed.py on GPUs (NCCL), for a machine with 4 of them; not run by CI.

    torchrun --nproc_per_node 4 tests/deepspeed_scripts/cuda_check.py

ZeRO 1, 2, 3 on 1×1×2 with dp 2 (losses, grad norm, start-up broadcast, save → load, dense
export), bf16 under ZeRO 1 and 3, GPT3D under ZeRO-2 on 2×1×1 with dp 2, and fp16 under ZeRO-1.
Rank 0 prints ``CUDA RESULT ok``.
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

import harness
import torch
import torch.distributed as dist
from test_deepspeed import _check_training, bf16_job, gpt_job, training_job

TOL = 1e-5


def fp16_job(shape):
    """fp16 (dynamic loss scale) under ZeRO-1: DeepSpeed's unscaled norm follows the fp32 dense norm."""
    from test_deepspeed import (
        STEPS,
        dense_model,
        dense_run,
        ds_config,
        engine_step,
        model_3d,
    )

    import deepspeed_3d

    grid = harness.grid(shape)
    dense = dense_model(seed=1)
    config = {
        **ds_config(shape, 1, grid.data_parallel_size),
        "fp16": {"enabled": True, "initial_scale_power": 8},
    }
    engine, *_ = deepspeed_3d.initialize(model=model_3d(dense, grid), config=config)
    _, ref_norms, _ = dense_run(dense, grid.data_parallel_size)
    norms = []
    for step in range(STEPS):
        engine_step(engine, grid, step, torch.float16)
        norms.append(float(engine.get_global_grad_norm()))
    return max(abs(a - b) / b for a, b in zip(norms, ref_norms))


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    root = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    box = [root]
    dist.broadcast_object_list(box)
    root = box[0]
    stages = (1, 2, 3)
    results = {
        "train": training_job((1, 1, 2), stages, root),
        "bf16": bf16_job((1, 1, 2), (1, 3)),
        "gpt": gpt_job((2, 1, 1), 2, root),
        "fp16": fp16_job((1, 1, 2)),
    }
    gathered = [None] * dist.get_world_size()
    dist.gather_object(results, gathered if dist.get_rank() == 0 else None)
    if dist.get_rank() == 0:
        _check_training([r["train"] for r in gathered], stages)
        for rank, r in enumerate(gathered):
            assert all(v["loss"] < 2e-2 and v["norm"] < 2e-2 for v in r["bf16"].values()), (rank, r["bf16"])
            assert r["gpt"]["loss"] < TOL and r["gpt"]["norm"] < TOL, (rank, r["gpt"])
            assert r["fp16"] < 2e-2, (rank, r["fp16"])
        assert gathered[0]["gpt"]["export_keys"] and gathered[0]["gpt"]["export_exact"]
        print("CUDA RESULT ok", {k: v for k, v in gathered[0].items() if k != "train"}, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
