"""The cost of pipeline stages: the bubble each schedule leaves, the stage hand-overs, the step.

A replica's batch is cut into ``m`` micro-batches that pass through ``pp`` stages, each stage a
cube running ``L / pp`` layers (:mod:`lightning_3d.pipeline`). With ``v`` stages per rank (1 for
``GPipe`` and ``1F1B``, the looped schedules' ``stages_per_rank``, 2 for the V-shaped ones), every
rank idles while the pipeline fills and drains, ``(pp − 1)`` stage-steps of a stage's
``1/v``-sized work, out of ``v·m + pp − 1``: the bubble fraction is ``(pp − 1) / (v·m + pp − 1)``
(Huang et al. 2019 for GPipe, Narayanan et al. 2021 for 1F1B and interleaving). GPipe and 1F1B
show it on CPU with stages of known cost (``tests/test_pipeline_cost.py``); for ``v > 1`` it is the
ideal, which ``torch.distributed.pipelining``'s interleaved order does not reach (measured on CPU
at pp 4, v 2: 0.21 at m 16 and 0.34 at m 4, against 0.09 and 0.27), so the prediction of a looped
schedule is a lower bound. The zero-bubble schedules would fill the bubble by deferring the weight
gradients; the stages here compute them with the input gradients.

Between stages each cube rank sends its own z-layout block of a micro-batch
(``tokens/m · h / cube`` elements) forward and its gradient back, point to point, over the link
between the stages' nodes. Outside the fill and drain the hand-overs overlap the next micro-batch's
work; on the critical path are those of the fill and the drain, ``2·(pp − 1)``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .formulas import BYTES, ModelShape, Prediction, predict_job
from .machine import DEFAULT_MACHINE, Machine

#: stages per rank of the schedules that fix it; the looped ones run ``stages_per_rank`` (default 2)
FIXED_STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "ZBVZeroBubble": 2, "DualPipeV": 2}
#: schedules that run every micro-batch's forward before any backward (all ``m`` in flight)
ALL_FORWARDS_FIRST = ("GPipe", "LoopedBFS")


def bubble_fraction(pipeline_size: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a step a rank idles: ``(pp − 1) / (v·m + pp − 1)``."""
    pp, m, v = pipeline_size, n_microbatches, stages_per_rank
    return (pp - 1) / (v * m + pp - 1)


def stage_layers(layers: int, pipeline_size: int) -> list[int]:
    """Layers per stage, as :func:`lightning_3d.pipeline.split.layer_ranges` splits them: equal counts,
    the first stages one more where ``layers`` does not divide."""
    base, extra = divmod(layers, pipeline_size)
    return [base + (s < extra) for s in range(pipeline_size)]


def predict_pipeline(
    shape: ModelShape,
    grid: tuple[int, int, int],
    dp: int = 1,
    pipeline_size: int = 1,
    n_microbatches: int = 1,
    schedule: str = "1F1B",
    stages_per_rank: int = 2,
    machine: Machine = None,
    **job,
) -> Prediction:
    """Predicted training step of ``shape`` (``vocab`` required) in ``pipeline_size`` stages of
    ``grid`` cubes, ``dp`` replicas, ``n_microbatches`` micro-batches a replica's batch, under
    ``schedule`` (a name of :data:`lightning_3d.pipeline.SCHEDULES`; ``stages_per_rank`` for the
    looped ones).

    The slowest stage sets the pace: the most layers, with the embedding and the LM head and loss
    priced on it (:func:`~lightning_3d.cost.formulas.predict_job` of that many layers, ``job`` its
    keyword arguments); the step is its time over ``1 −`` :func:`bubble_fraction`, plus the
    hand-overs of the fill and the drain. Memory: the stage's, its activations those of the
    micro-batches in flight on the first stage (all ``m`` where every forward runs first, GPipe and
    LoopedBFS; else at most ``pp·v``).
    """
    m = machine or DEFAULT_MACHINE
    pp, n = pipeline_size, n_microbatches
    v = FIXED_STAGES_PER_RANK.get(schedule, stages_per_rank)
    stage_shape = replace(shape, layers=max(stage_layers(shape.layers, pp)))
    stage = predict_job(stage_shape, grid, dp, m, **job)
    bubble = bubble_fraction(pp, n, v)
    cube = math.prod(grid)
    block = shape.batch / dp / n * shape.seq * shape.hidden / cube * BYTES
    across = pp > 1 and m.gpus_per_node <= cube * dp  # a stage fills its nodes: the next is on others
    hand_over = m.link("all_gather", 2, across).seconds(block) * 1e3 if pp > 1 else 0.0  # a pair of ranks
    fill_drain = 2 * (pp - 1) * hand_over
    scale = 1 / (1 - bubble)
    in_flight = n if schedule in ALL_FORWARDS_FIRST else min(n, pp * v)
    activations = stage.detail["activations_GiB"]
    detail = {
        **stage.detail,
        "stage_layers": stage_shape.layers,
        "bubble_fraction": bubble,
        "hand_over_ms": hand_over,
        "pipeline_exposed_ms": stage.step_ms * (scale - 1) + fill_drain,
    }
    return Prediction(
        grid,
        dp,
        stage.fwd_ms * scale + fill_drain / 2,
        stage.bwd_ms * scale + fill_drain / 2,
        stage.comm_ms + 2 * n * hand_over,
        stage.exposed_comm_ms + fill_drain,
        stage.memory_GiB + activations * (in_flight / n - 1),
        detail,
    )


def hand_over_bytes(shape: ModelShape, grid: tuple[int, int, int], dp: int, pipeline_size: int) -> float:
    """Bytes a middle stage's rank sends per step: each micro-batch's block forward and its gradient
    back (the first and last stages send one of the two), whatever the number of micro-batches."""
    if pipeline_size == 1:
        return 0.0
    return 2 * shape.batch / dp * shape.seq * shape.hidden / math.prod(grid) * BYTES
