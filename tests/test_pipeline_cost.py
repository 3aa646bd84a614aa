"""The pipeline's cost: the bubble GPipe and 1F1B show on CPU, with stages of known cost, is the cost
model's ``(pp − 1) / (m + pp − 1)``; the model's step, memory and hand-overs follow the stages.
(``torch.distributed.pipelining``'s interleaved schedules leave more than their ideal
``(pp − 1) / (v·m + pp − 1)``, which the cost model prices: see :mod:`lightning_3d.cost.pipeline`.)"""

from __future__ import annotations

import time

import harness
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_3d import cost
from lightning_3d.pipeline.kinds import schedule_class

FORWARD_S, BACKWARD_S = 0.03, 0.06  # a rank's work per micro-batch, over all its stages


class _Timed(torch.autograd.Function):
    """Identity that takes ``forward_s`` seconds forward and ``backward_s`` backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class TimedStage(nn.Module):
    def __init__(self, share: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.forward_s, self.backward_s = FORWARD_S * share, BACKWARD_S * share

    def forward(self, x):
        return _Timed.apply(x * self.weight, self.forward_s, self.backward_s)


def bubble_job(schedule: str, microbatches: int, per_rank: int) -> float:
    """The measured share of a step this rank idles, under ``schedule`` on a pipe of every rank."""
    pp, rank = dist.get_world_size(), dist.get_rank()
    indices = (
        [rank, 2 * pp - 1 - rank] if schedule == "ZBVZeroBubble" else [rank + k * pp for k in range(per_rank)]
    )
    stages = [
        PipelineStage(
            TimedStage(1 / per_rank),
            i,
            pp * per_rank,
            torch.device("cpu"),
            input_args=(torch.ones(1, 4, requires_grad=i > 0),),  # activations between stages take gradients
            output_args=torch.ones(1, 4, requires_grad=True),
        )
        for i in indices
    ]
    cls = schedule_class(schedule)
    runner = cls(stages[0] if per_rank == 1 else stages, microbatches, loss_fn=lambda out, target: out.sum())
    batch = torch.ones(microbatches, 4)
    steps = []
    for _ in range(3):  # the first warms up
        dist.barrier()
        start = time.perf_counter()
        args = (
            (batch,) if 0 in indices else ()
        )  # the input where the first stage runs, the target at the last
        kwargs = {"target": batch} if pp * per_rank - 1 in indices else {}
        runner.step(*args, **kwargs)
        dist.barrier()
        steps.append(time.perf_counter() - start)
    work = microbatches * (FORWARD_S + BACKWARD_S)
    return 1 - work / min(steps[1:])


@pytest.mark.parametrize("schedule, microbatches, per_rank", [("GPipe", 4, 1), ("1F1B", 8, 1)])
def test_bubble_on_cpu_is_the_formula(schedule, microbatches, per_rank):
    measured = harness.run(4, bubble_job, schedule, microbatches, per_rank)
    formula = cost.bubble_fraction(4, microbatches, per_rank)
    assert all(abs(b - formula) < 0.06 for b in measured), (schedule, formula, measured)


LLAMA = cost.ModelShape(4096, 32, 2048, 16, 32, 11008, kv_heads=8, gated=True, vocab=32000)


def test_predicted_step_follows_stages_and_bubble():
    one = cost.predict_job(LLAMA, (2, 2, 2))
    two = cost.predict_pipeline(LLAMA, (2, 2, 2), 1, 2, 8, "1F1B")
    half = cost.predict_job(cost.ModelShape(**{**LLAMA.__dict__, "layers": 16}), (2, 2, 2))
    assert two.detail["stage_layers"] == 16 and two.detail["bubble_fraction"] == pytest.approx(1 / 9)
    assert two.step_ms == pytest.approx(half.step_ms * 9 / 8 + two.detail["hand_over_ms"] * 2, rel=1e-6)
    assert two.step_ms < one.step_ms  # twice the GPUs
    gpipe = cost.predict_pipeline(LLAMA, (2, 2, 2), 1, 2, 8, "GPipe")
    assert gpipe.memory_GiB > two.memory_GiB  # all eight micro-batches' activations in flight, not two
    assert cost.stage_layers(10, 4) == [3, 3, 2, 2]
    assert cost.hand_over_bytes(LLAMA, (2, 2, 2), 1, 2) == 2 * 16 * 2048 * 4096 / 8 * 2
