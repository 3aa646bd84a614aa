"""The strategy's numerical pieces, without a Lightning run: global gradient norm and clipping, agreed fp16 overflow.

8-rank gloo pool (shared with the other harness tests). Gradients are drawn whole from one seed on
every rank and each rank keeps its shard, so the dense reference is the same tensors, unsharded.
"""

import math

import harness
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_3d import (
    LayerNorm3D,
    Linear3D,
    VocabParallelEmbedding3D,
    split_activation,
)
from lightning_3d.grad_norm import clip_grad_norm_, grad_norm
from lightning_3d.sharding import get_spec
from lightning_3d.strategy.precision import agreed_scaler
from lightning_3d.strategy.zero import partition


def _model_with_grads(grid, dtype=torch.float32):
    """3-D layers of every kind plus a plain (replicated) parameter; returns (params, full gradients)."""
    layers = nn.ModuleList(
        [
            VocabParallelEmbedding3D(16, 8, grid=grid, dtype=dtype),
            LayerNorm3D(8, grid=grid, dtype=dtype),
            Linear3D(8, 12, grid=grid, dtype=dtype),
            Linear3D(12, 8, input_layout="y", grid=grid, dtype=dtype),
        ]
    )
    params = [*layers.parameters(), nn.Parameter(torch.zeros(3, dtype=dtype))]
    torch.manual_seed(3)
    full = [
        torch.randn(get_spec(p).global_shape if get_spec(p) else p.shape, dtype=dtype) * (i + 1)
        for i, p in enumerate(params)
    ]
    for p, g in zip(params, full):
        p.grad = g[get_spec(p).local_slices(grid)].clone() if get_spec(p) else g.clone()
    return params, full


def norm_job(shape, dp, dtype=torch.float32):
    """Each global norm (and the clipped gradients) against the dense reference's, in ``dtype``: ratios, and
    differences that must be 0."""
    grid = harness.grid(shape, dp)
    params, full = _model_with_grads(grid, dtype)
    out = {"norm_dtype_differs": float(grad_norm(params, grid).dtype != dtype)}
    for p in (1.0, 2.0, 3.0, math.inf):
        ref = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full]), p)
        out[f"norm{p}"] = float(grad_norm(params, grid, p)) / float(ref)
    low = nn.Parameter(
        torch.zeros(5, dtype=torch.bfloat16)
    )  # a bf16 gradient: its norm accumulates in float32
    low.grad = (torch.arange(5.0) * 0.37 + 1.1).to(torch.bfloat16)
    ref = torch.linalg.vector_norm(torch.cat([g.flatten().double() for g in full + [low.grad]]), 2.0)
    out["norm_with_bf16"] = float(grad_norm(params + [low], grid)) / float(ref)
    owner = partition(
        params, grid.data_parallel_size
    )  # ZeRO: each dp rank passes its share, summed over the world
    mine = [p for p in params if owner[id(p)] == grid.coord("dp")]
    out["partitioned"] = float(grad_norm(mine, grid, 2.0, group=dist.group.WORLD)) / float(
        torch.cat([g.flatten() for g in full]).norm()
    )
    total = clip_grad_norm_(params, 0.5, grid)
    dense = [nn.Parameter(torch.zeros_like(g)) for g in full]
    for d, g in zip(dense, full):
        d.grad = g.clone()
    ref_total = torch.nn.utils.clip_grad_norm_(dense, 0.5)
    clipped = [d.grad for d in dense]
    out["clip_total"] = float(total) / float(ref_total)
    out["clipped"] = max(
        float((p.grad - (c[get_spec(p).local_slices(grid)] if get_spec(p) else c)).abs().max())
        for p, c in zip(params, clipped)
    )
    below = [
        p.grad.clone() for p in params
    ]  # now at norm 0.5: a limit above it must leave every gradient as it is
    clip_grad_norm_(params, 0.75, grid)
    out["unclipped_below_limit"] = float(not all(torch.equal(p.grad, g) for p, g in zip(params, below)))
    return out


def _off(result: dict, tol: float) -> dict:
    """The entries of a :func:`norm_job` result off by more than ``tol`` (differences from 0, ratios from 1)."""
    zero = ("clipped", "unclipped_below_limit", "norm_dtype_differs")
    return {k: v for k, v in result.items() if not (abs(v) if k in zero else abs(v - 1)) <= tol}


@pytest.mark.parametrize("shape, dp", [((2, 2, 2), 1), ((2, 2, 1), 2), ((1, 2, 2), 2)])
def test_global_norm_counts_each_shard_once(shape, dp):
    for rank, r in enumerate(harness.run(8, norm_job, shape, dp)):
        bad = _off(r, 1e-6)
        assert not bad, f"rank {rank} on {shape} dp {dp}: {bad}"


def test_float64_norm_and_clipping_are_float64_exact():
    """float64 gradients: the norm is accumulated and returned in float64 (float32 would be ~1e-8 off) and clips
    exactly as torch's clip_grad_norm_ of the dense gradients does."""
    for rank, r in enumerate(harness.run(4, norm_job, (2, 1, 1), 2, torch.float64)):
        bad = _off(r, 1e-12)
        assert not bad, f"rank {rank}: {bad}"


def overflow_job(agreed: bool):
    grid = harness.grid((2, 2, 2))
    torch.manual_seed(0)
    layer = Linear3D(8, 8, grid=grid)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler = agreed_scaler(scaler, "cpu") if agreed else scaler
    x = split_activation(torch.randn(4, 8), "z", grid)
    scaler.scale(layer(x).sum()).backward()
    if dist.get_rank() == 5:  # one shard overflows
        layer.weight.grad.view(-1)[0] = math.inf
    before = layer.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    return torch.equal(before, layer.weight.detach()), scaler.get_scale()


def test_fp16_overflow_skips_the_step_on_every_rank():
    assert all(r == (True, 2.0) for r in harness.run(8, overflow_job, True)), (
        "an overflow on one rank must skip the step everywhere"
    )
    unagreed = harness.run(8, overflow_job, False)
    assert unagreed[5][0] and not any(r[0] for i, r in enumerate(unagreed) if i != 5), (
        "control: a plain scaler lets ranks disagree"
    )


def zero1_job(shape, dp):
    """ZeRO-1 over dp: each dp rank keeps the optimizer state of its share of the parameters, and the shares balance."""
    from lightning_3d.strategy.zero import ShardedOptimizerState

    grid = harness.grid(shape, dp)
    params, _ = _model_with_grads(grid)
    optimizer = torch.optim.AdamW(params, lr=0.1)
    zero = ShardedOptimizerState(optimizer, grid)
    before = [p.detach().clone() for p in params]
    optimizer.step()
    zero.remove()
    mine = [p for p in params if p in optimizer.state]
    held = torch.tensor([float(sum(p.numel() for p in mine))])
    loads = [torch.zeros(1) for _ in range(dp)]
    dist.all_gather(loads, held, group=grid.group("dp"))
    loads = [float(x) for x in loads]
    return {
        "owns_exactly_its_share": all((p in optimizer.state) == zero.holds_state(p) for p in params),
        "loads": loads,
        "largest": max(p.numel() for p in params),
        "total": sum(p.numel() for p in params),
        "all_moved": all(
            not torch.equal(b, p.detach()) for b, p in zip(before, params)
        ),  # owners broadcast their update
    }


@pytest.mark.parametrize("shape, dp", [((2, 1, 1), 4), ((1, 2, 2), 2)])
def test_zero1_shards_optimizer_state_evenly_over_dp(shape, dp):
    """A partition that put every state on dp rank 0 (or kept it everywhere) fails here: loads must split the total."""
    for rank, r in enumerate(harness.run(8, zero1_job, shape, dp)):
        where = f"rank {rank} on {shape} dp {dp}"
        assert r["owns_exactly_its_share"], (
            f"{where}: holds optimizer state of a parameter another dp rank owns"
        )
        assert sum(r["loads"]) == r["total"], (
            f"{where}: the dp ranks' states cover {sum(r['loads'])} of {r['total']} elements"
        )
        assert max(r["loads"]) - min(r["loads"]) <= r["largest"], f"{where}: unbalanced shares {r['loads']}"
        assert min(r["loads"]) > 0, f"{where}: a dp rank holds no state: {r['loads']}"
        assert r["all_moved"], f"{where}: a parameter was not updated on every replica"
