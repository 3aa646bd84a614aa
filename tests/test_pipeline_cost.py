"""The pipeline's cost: the bubble every schedule shows on CPU, with stages of known cost, is the one its
own order of actions leaves (``cost.order_bubble``): for GPipe, 1F1B and the looped schedules the cost
model's ``(pp − 1) / (v·m + pp − 1)``, for the zero-bubble ones less (see
:mod:`lightning_3d.cost.pipeline`); the model's step, memory and hand-overs follow the stages."""

from __future__ import annotations

import math
import time

import harness
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_3d import cost
from lightning_3d.pipeline.kinds import ZERO_BUBBLE, schedule_class, stage_indices

# a rank's work per micro-batch, over all its stages: forward, backward, and the part of the backward
# that zero-bubble schedules defer to their W actions (the stages' weight pass)
FORWARD_S, BACKWARD_S, WEIGHT_S = 0.04, 0.08, 0.04
# schedule → (micro-batches, stages per rank), at pp 4
SCHEDULES = {
    "GPipe": (4, 1),
    "1F1B": (8, 1),
    "Interleaved1F1B": (8, 2),
    "LoopedBFS": (4, 2),
    "InterleavedZeroBubble": (8, 2),
    "ZBVZeroBubble": (8, 2),
    "DualPipeV": (8, 2),
}


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
    """A stage of ``share`` of a rank's work: its backward (I) the input part, its weight pass (W) the rest."""

    def __init__(self, share: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.share = share
        self.timed = False

    def seconds(self, part: float) -> float:
        return part * self.share if self.timed else 0.0

    def weight_pass(self):
        return lambda: time.sleep(self.seconds(WEIGHT_S))

    def forward(self, x):
        return _Timed.apply(x * self.weight, self.seconds(FORWARD_S), self.seconds(BACKWARD_S - WEIGHT_S))


def fastest_step(
    runner, modules: list[TimedStage], args: tuple, kwargs: dict, timed: bool, steps: int
) -> float:
    """The fastest of ``steps`` steps of ``runner``, its stages of known cost or of none."""
    for m in modules:
        m.timed = timed
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        runner.step(*args, **kwargs)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return min(times)


def bubble_job(schedules: dict) -> dict:
    """Under each schedule on a pipe of every rank: ``(measured, predicted)`` bubble fractions, the latter
    the schedule's order's (:func:`cost.order_bubble`).

    A step of stages of known cost takes the schedule's time plus the cost of running it (hand-overs,
    the schedule's own work, which on a loaded 2-core machine is a tenth of a second); a step of the
    same schedule with stages of no cost takes that cost alone, and is taken off."""
    pp, out = dist.get_world_size(), {}
    grid = type("PipeOnly", (), {"pipeline_size": pp, "stage": dist.get_rank()})()
    for name, (microbatches, per_rank) in schedules.items():
        indices = stage_indices(grid, name, per_rank)
        modules = [TimedStage(1 / len(indices)) for _ in indices]
        stages = [
            PipelineStage(
                module,
                i,
                pp * len(indices),
                torch.device("cpu"),
                input_args=(
                    torch.ones(1, 4, requires_grad=i > 0),
                ),  # activations between stages take gradients
                output_args=torch.ones(1, 4, requires_grad=True),
                dw_builder=module.weight_pass,
            )
            for module, i in zip(modules, indices)
        ]
        single = len(stages) == 1
        runner = schedule_class(name)(
            stages[0] if single else stages, microbatches, loss_fn=lambda out, target: out.sum()
        )
        batch = torch.ones(microbatches, 4)
        args = (
            (batch,) if 0 in indices else ()
        )  # the input where the first stage runs, the target at the last
        kwargs = {"target": batch} if pp * len(indices) - 1 in indices else {}

        fastest_step(runner, modules, args, kwargs, False, 1)  # warms up
        overhead = fastest_step(runner, modules, args, kwargs, False, 3)
        work = microbatches * (FORWARD_S + BACKWARD_S)
        measured = 1 - work / (fastest_step(runner, modules, args, kwargs, True, 2) - overhead)
        # 1F1B runs its own loop; its pipeline_order, drawn for display, is off by one micro-batch
        order = (
            None
            if name == "1F1B"
            else cost.order_bubble(runner.pipeline_order, FORWARD_S, BACKWARD_S, WEIGHT_S)
        )
        out[name] = (measured, order)
    return out


def test_every_schedules_bubble_on_cpu_is_its_orders():
    """Each schedule at pp 4: every rank idles the share the cost model's formula gives GPipe, 1F1B and the
    looped schedules (whose orders give it too); the zero-bubble ones, whose W actions fill the drain, idle
    less than the formula, as their orders say (measured only as a bound: their runtime's own work per
    action is as large as these stages' on 2 CPU cores)."""
    results = harness.run(4, bubble_job, SCHEDULES)
    predicted = {name: results[0][name][1] for name in SCHEDULES}
    for name in SCHEDULES:  # every rank simulates the whole order
        assert all(r[name][1] == predicted[name] for r in results), name
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"):
        formula = cost.bubble_fraction(4, *SCHEDULES[name])
        assert predicted[name] in (None, pytest.approx(formula, abs=1e-12)), (name, predicted[name], formula)
        predicted[name] = formula
    for name, want in predicted.items():
        measured = [r[name][0] for r in results]
        if name in ZERO_BUBBLE:  # their runtime's own work per action is as large as these stages' on 2 cores
            assert all(b < cost.bubble_fraction(4, *SCHEDULES[name]) for b in measured), (name, measured)
        else:
            assert all(abs(b - want) < 0.05 for b in measured), (name, want, measured)
    assert predicted["ZBVZeroBubble"] < predicted["Interleaved1F1B"] - 0.05  # the W actions fill the drain


LLAMA = cost.ModelShape(4096, 32, 2048, 16, 32, 11008, kv_heads=8, gated=True, vocab=32000)


def test_predicted_step_follows_stages_and_bubble():
    """The busiest rank's stage work over 1 − bubble, its share of what runs after the schedule, the hand-overs."""
    one = cost.predict_job(LLAMA, (2, 2, 2))
    two = cost.predict_pipeline(LLAMA, (2, 2, 2), 1, 2, 8, "1F1B")
    parts = cost.stage_costs(LLAMA, (2, 2, 2))
    assert two.detail["stage_layers"] == [16, 16] and two.detail["bubble_fraction"] == pytest.approx(1 / 9)
    assert two.detail["busiest_rank_stages"] == [1]  # the head outweighs the embedding
    work = 16 * parts.layer_ms + parts.last_ms
    after = one.step_ms - 32 * parts.layer_ms - parts.first_ms - parts.last_ms
    share = (16 * LLAMA.block_weights + LLAMA.vocab * LLAMA.hidden) / LLAMA.params
    expected = work * 9 / 8 + after * share + two.detail["hand_over_ms"] * 2
    assert two.step_ms == pytest.approx(expected, rel=1e-9)
    assert two.step_ms < one.step_ms  # twice the GPUs
    gpipe = cost.predict_pipeline(LLAMA, (2, 2, 2), 1, 2, 8, "GPipe")
    assert gpipe.memory_GiB > two.memory_GiB  # all eight micro-batches' activations in flight, not two
    assert cost.hand_over_bytes(LLAMA, (2, 2, 2), 1, 2) == 2 * 16 * 2048 * 4096 / 8 * 2


GPT2 = cost.ModelShape(768, 12, 1024, 16, 12, vocab=50257)  # the head costs about 2.6 layers


def test_the_split_balances_the_embedding_and_the_head():
    """GPT-2 small: the last stage (head and loss) gets fewer layers than equal counts give it, and the slowest
    stage is faster than theirs; split points are what PipelineOptions takes; the predicted step prices them."""
    parts = cost.stage_costs(GPT2, (2, 2, 1))
    assert parts.last_ms > 2 * parts.layer_ms > parts.first_ms

    def slowest(counts):
        return max(parts.stage_ms(n, s, len(counts)) for s, n in enumerate(counts))

    for stages, equal in [(2, [6, 6]), (4, [3, 3, 3, 3])]:
        counts = cost.balanced_counts(parts, 12, stages)
        assert sum(counts) == 12 and counts[-1] < equal[-1] and slowest(counts) < slowest(equal), counts
    assert cost.split_points(GPT2, (2, 2, 1), 1, 4) == [3, 7, 11]  # counts [3, 4, 4, 1]
    balanced = cost.predict_pipeline(GPT2, (2, 2, 1), 1, 4, 8)
    equal = cost.predict_pipeline(GPT2, (2, 2, 1), 1, 4, 8, split_points=[3, 6, 9])
    assert balanced.detail["stage_layers"] == [3, 4, 4, 1] and equal.detail["stage_layers"] == [3, 3, 3, 3]
    assert balanced.step_ms < equal.step_ms


@pytest.mark.parametrize("layers, stages", [(7, 1), (7, 2), (7, 3), (9, 4), (6, 6)])
def test_balanced_counts_are_the_fastest_split(layers, stages):
    """Against every split of ``layers`` into ``stages`` non-empty stages, for drawn stage costs (and none: equal
    counts, the first stages one more, as ``layer_ranges``)."""
    from itertools import combinations

    from lightning_3d.pipeline import layer_ranges

    splits = [
        [b - a for a, b in zip((0, *cut), (*cut, layers))]
        for cut in combinations(range(1, layers), stages - 1)
    ]
    g = torch.Generator().manual_seed(layers * 10 + stages)
    for first, last in torch.rand(4, 2, generator=g).mul(3).tolist():
        parts = cost.StageCosts(1.0, first, last)

        def slowest(counts, parts=parts):
            return max(parts.stage_ms(n, s, stages) for s, n in enumerate(counts))

        counts = cost.balanced_counts(parts, layers, stages)
        assert sum(counts) == layers and min(counts) >= 1
        assert slowest(counts) == pytest.approx(min(map(slowest, splits)), rel=1e-12), (first, last, counts)
    equal = [len(r) for r in layer_ranges(layers, stages)]
    assert cost.balanced_counts(cost.StageCosts(1.0, 0.0, 0.0), layers, stages) == equal
    with pytest.raises(ValueError, match=f"{layers + 1} pipeline stages need at least one layer each"):
        cost.balanced_counts(parts, layers, layers + 1)


def test_grid_auto_with_stages_picks_the_fastest_cube_and_the_split():
    """``grid="auto"`` with a model shape and stages: the fastest of the cubes whose micro-batches split, priced as
    stages; the strategy's split is the one that balances them on that cube, unless split points are given."""
    from lightning_3d.pipeline import PipelineOptions
    from lightning_3d.strategy import grid_rules

    pipeline = PipelineOptions(n_microbatches=4)
    shape, dp = grid_rules.resolve("auto", "auto", 16, 8, GPT2, pipeline_size=2, pipeline=pipeline)
    machine = grid_rules.on_nodes(None, 8)
    priced = cost.candidates(GPT2, 16, machine, pipeline_size=2, n_microbatches=4, grads_at_end=True)
    assert (shape, dp) == (priced[0].grid, priced[0].dp) and 2 * dp * math.prod(shape) == 16
    assert all(cost.pipeline_error(GPT2, p.grid, p.dp, 4) is None for p in priced)
    assert cost.pipeline_error(GPT2, (1, 1, 1), 8, 4) == "batch 16 % dp·micro-batches 8·4"
    assert cost.grid_error(GPT2, (1, 4, 1), 2, "sequences") is None  # 8 sequences a replica split over y
    assert (
        cost.pipeline_error(GPT2, (1, 4, 1), 2, 4, "sequences") == "batch/dp % px·py"
    )  # 2 a micro-batch do not
    split = grid_rules.priced_split(pipeline, GPT2, shape, dp, 2, 8)
    assert split.split_points == tuple(cost.split_points(GPT2, shape, dp, 2, machine, grads_at_end=True))
    assert split.split_points[0] > 6  # the first stage holds more layers than the last
    given = PipelineOptions(split_points=[6])
    assert grid_rules.priced_split(given, GPT2, shape, dp, 2, 8) is given
    assert grid_rules.priced_split(pipeline, None, shape, dp, 2, 8) is pipeline
