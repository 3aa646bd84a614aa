"""The cost of pipeline stages: the split that balances them, the bubble each schedule leaves, the
stage hand-overs, the step.

A replica's batch is cut into ``m`` micro-batches that pass through ``S = pp·v`` stages
(:mod:`lightning_3d.pipeline`), ``v`` a rank (1 for ``GPipe`` and ``1F1B``, the looped schedules'
``stages_per_rank``, 2 for the V-shaped ones). A stage's work is its layers', plus the embedding on
the first stage and the final norm, LM head and loss on the last (:class:`StageCosts`, read off
:func:`~lightning_3d.cost.formulas.predict_job`), so equal layer counts leave the last stage the
slowest wherever the head is worth a few layers (a vocabulary of 50k on a hidden size of 768: about
five). :func:`balanced_counts` gives the layer counts whose slowest stage is the fastest,
:func:`split_points` the ``PipelineOptions(split_points=...)`` they make.

Every rank idles while the pipeline fills and drains, ``(pp − 1)`` stage-steps of a stage's
``1/v``-sized work, out of ``v·m + pp − 1``: the bubble fraction is ``(pp − 1) / (v·m + pp − 1)``
(Huang et al. 2019 for GPipe, Narayanan et al. 2021 for 1F1B and interleaving), exactly what
``torch.distributed.pipelining``'s GPipe, 1F1B, Interleaved1F1B and LoopedBFS leave.
:func:`order_bubble` computes the bubble of any schedule from its own order of actions (its
``pipeline_order``) and the stages' costs. The zero-bubble schedules differ from the formula: their
W actions (weight gradients, deferred from the backward) fill the drain, so with W half the backward
they leave 0.06 (DualPipeV 0.11) at pp 4, v 2, m 8 where the formula says 0.16; without deferred
weight gradients InterleavedZeroBubble leaves the formula's bubble and ZBVZeroBubble and DualPipeV
more (0.20 and 0.23). GPipe, 1F1B and the looped schedules show the formula's bubble on CPU with stages of
known cost, and the zero-bubble ones less (``tests/test_pipeline_cost.py``).
:func:`predict_pipeline`, which prices schedules before any stage exists, takes the formula for
all of them: the stages defer only the weight gradients of 3-D products gathered over x (px > 1, eager:
:mod:`lightning_3d.pipeline.schedule`), the rest coming with the input gradients, so a
zero-bubble schedule's bubble lies between the two.

Between stages each cube rank sends its own z-layout block of a micro-batch
(``tokens/m · h / cube`` elements) forward and its gradient back, point to point, over the link
between the stages' nodes. Outside the fill and drain the hand-overs overlap the next micro-batch's
work; on the critical path are those of the fill and the drain, ``2·(pp − 1)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ..pipeline.kinds import stage_owner
from ..pipeline.split import layer_ranges
from .formulas import BYTES, ModelShape, Prediction, grid_error, predict_job
from .machine import DEFAULT_MACHINE, Machine

#: stages per rank of the schedules that fix it; the looped ones run ``stages_per_rank`` (default 2)
FIXED_STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "ZBVZeroBubble": 2, "DualPipeV": 2}
#: schedules that run every micro-batch's forward before any backward (all ``m`` in flight)
ALL_FORWARDS_FIRST = ("GPipe", "LoopedBFS")


@dataclass(frozen=True)
class StageCosts:
    """What a pipeline stage's forward and backward cost, in ms for a replica's whole batch (a stage
    runs it micro-batch by micro-batch): ``layer_ms`` each layer, ``first_ms`` what the first stage
    adds (the embedding), ``last_ms`` what the last adds (the LM head and the loss)."""

    layer_ms: float
    first_ms: float
    last_ms: float

    @classmethod
    def of(cls, job: Prediction, layers: int) -> StageCosts:
        """The parts of :func:`~lightning_3d.cost.formulas.predict_job`'s step ``job`` of ``layers`` layers."""
        detail = job.detail
        return cls(
            detail["blocks_ms"] / layers, detail["embedding_ms"], detail["head_ms"] + detail["loss_ms"]
        )

    def stage_ms(self, layers: int, index: int, num_stages: int) -> float:
        """Stage ``index`` of ``num_stages`` holding ``layers`` layers."""
        return (
            layers * self.layer_ms + self.first_ms * (index == 0) + self.last_ms * (index == num_stages - 1)
        )


def stage_costs(
    shape: ModelShape, grid: tuple[int, int, int], dp: int = 1, machine: Machine = None, **job
) -> StageCosts:
    """:class:`StageCosts` of ``shape`` (``vocab`` required) on ``grid`` with ``dp`` replicas; ``job``:
    :func:`~lightning_3d.cost.formulas.predict_job`'s keyword arguments."""
    return StageCosts.of(predict_job(shape, grid, dp, machine, **job), shape.layers)


def balanced_counts(costs: StageCosts, layers: int, num_stages: int) -> list[int]:
    """The layers of each of ``num_stages`` stages, at least one each, whose slowest stage
    (:meth:`StageCosts.stage_ms`) is the fastest possible.

    The stages between the first and the last cost alike, so they share their layers equally. Of
    counts that are as fast, those whose stage times are the most even (the least sum of squares),
    then the largest first: equal counts, the first stages one layer more, when the first and last
    stage add nothing, as :func:`~lightning_3d.pipeline.split.layer_ranges` splits.

    Raises:
        ValueError: fewer layers than stages.
    """
    if layers < num_stages:
        raise ValueError(
            f"{num_stages} pipeline stages need at least one layer each, but the model has {layers}; "
            f"use at most {layers} stages (pipeline_size × stages per rank)"
        )
    if num_stages == 1:
        return [layers]
    middle = num_stages - 2
    splits = []
    for first in range(1, layers - num_stages + 2):
        for last in range(1, layers - first - middle + 1) if middle else (layers - first,):
            per, extra = divmod(layers - first - last, middle) if middle else (0, 0)
            counts = [first, *(per + (k < extra) for k in range(middle)), last]
            times = [costs.stage_ms(n, s, num_stages) for s, n in enumerate(counts)]
            splits.append((max(times), sum(t * t for t in times), counts))
    fastest = min(slowest for slowest, _, _ in splits)
    splits = [(squares, counts) for slowest, squares, counts in splits if slowest <= fastest * (1 + 1e-9)]
    evenest = min(squares for squares, _ in splits)
    return max(counts for squares, counts in splits if squares <= evenest * (1 + 1e-9))


def split_points(
    shape: ModelShape, grid: tuple[int, int, int], dp: int, num_stages: int, machine: Machine = None, **job
) -> list[int]:
    """The first layer of stages ``1 … num_stages-1`` (``PipelineOptions(split_points=...)``) that
    balance ``shape``'s stages on ``grid`` (:func:`stage_costs`, :func:`balanced_counts`)."""
    counts = balanced_counts(stage_costs(shape, grid, dp, machine, **job), shape.layers, num_stages)
    return list(itertools.accumulate(counts))[:-1]


def bubble_fraction(pipeline_size: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a step a rank idles: ``(pp − 1) / (v·m + pp − 1)``."""
    pp, m, v = pipeline_size, n_microbatches, stages_per_rank
    return (pp - 1) / (v * m + pp - 1)


def order_bubble(
    order: Mapping[int, Sequence], forward: float, backward: float, weight: float = 0.0
) -> float:
    """The bubble fraction a schedule's own order of actions leaves, with stages of known cost.

    ``order``: a ``torch.distributed.pipelining`` schedule's ``pipeline_order`` (pipe rank → its
    actions in order, None where it idles; each action's ``stage_index``, ``computation_type`` F, B,
    I, W or an overlapped pair, and ``microbatch_index``). ``forward``, ``backward``: a rank's work
    per micro-batch over all its stages (a stage of ``v`` a rank does ``1/v`` of it); ``weight``: the
    part of ``backward`` a zero-bubble schedule's W action does (its I action the rest).

    Each rank runs its actions in order, each as soon as the rank is free and what it needs is done:
    a forward the previous stage's forward of the micro-batch, a backward (B or I) the stage's own
    forward and the next stage's backward, a W its I; an overlapped pair (DualPipeV) starts once both
    its actions could, and runs them one after the other. Hand-overs take no time. Returns
    ``1 − m·(forward + backward) / step`` with ``step`` the last action's end, the share of a step a
    rank idles; for GPipe, 1F1B and the looped schedules it is :func:`bubble_fraction`.
    """
    units = {
        rank: [u for u in (_compute_unit(a) for a in acts if a is not None) if u]
        for rank, acts in order.items()
    }
    flat = [a for acts in units.values() for unit in acts for a in unit]
    num_stages = 1 + max(a.stage_index for a in flat)
    microbatches = 1 + max(a.microbatch_index for a in flat)
    v = num_stages // len(units)
    cost = {"F": forward / v, "B": backward / v, "I": (backward - weight) / v, "W": weight / v}
    done: dict[tuple[str, int, int], float] = {}
    free, position = dict.fromkeys(units, 0.0), dict.fromkeys(units, 0)
    while any(position[r] < len(acts) for r, acts in units.items()):
        progressed = False
        for rank, acts in units.items():
            while position[rank] < len(acts):
                needs = [n for action in acts[position[rank]] for n in _needs(action, num_stages)]
                if any(n not in done for n in needs):
                    break
                end = max([free[rank], *(done[n] for n in needs)])
                for action in acts[position[rank]]:
                    kind = action.computation_type.value
                    end += cost[kind]
                    done[("dx" if kind in "BI" else kind, action.stage_index, action.microbatch_index)] = end
                free[rank] = end
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule's order waits on an action that no rank runs")
    return 1 - microbatches * (forward + backward) / max(free.values())


def _compute_unit(action) -> tuple:
    """The forward and backward actions that ``action`` runs at once: itself, an overlapped pair's two, or
    none (a communication or gradient reduction)."""
    if action.sub_actions is not None:
        return tuple(a for sub in action.sub_actions for a in _compute_unit(sub))
    return (action,) if action.computation_type.value in ("F", "B", "I", "W") else ()


def _needs(action, num_stages: int) -> list[tuple[str, int, int]]:
    """What ``action`` waits for: ``(kind, stage, micro-batch)``, kind F, dx (B or I) or W."""
    kind, s, mb = action.computation_type.value, action.stage_index, action.microbatch_index
    if kind == "F":
        return [("F", s - 1, mb)] if s > 0 else []
    if kind == "W":
        return [("dx", s, mb)]
    return [("F", s, mb)] + ([("dx", s + 1, mb)] if s < num_stages - 1 else [])


def pipeline_error(
    shape: ModelShape, grid: tuple[int, int, int], dp: int, n_microbatches: int, rows: str = "auto"
) -> str | None:
    """Why micro-batches of ``shape``'s batch (``n_microbatches`` a replica's) cannot run on ``grid``
    with ``dp`` replicas (:func:`~lightning_3d.cost.formulas.grid_error` of a micro-batch), or None."""
    if shape.batch % (dp * n_microbatches):
        return f"batch {shape.batch} % dp·micro-batches {dp}·{n_microbatches}"
    return grid_error(replace(shape, batch=shape.batch // n_microbatches), grid, dp, rows)


def predict_pipeline(
    shape: ModelShape,
    grid: tuple[int, int, int],
    dp: int = 1,
    pipeline_size: int = 1,
    n_microbatches: int = 1,
    schedule: str = "1F1B",
    stages_per_rank: int = 2,
    machine: Machine = None,
    split_points: list[int] | None = None,
    **job,
) -> Prediction:
    """Predicted training step of ``shape`` (``vocab`` required) in ``pipeline_size`` stages of
    ``grid`` cubes, ``dp`` replicas, ``n_microbatches`` micro-batches a replica's batch, under
    ``schedule`` (a name of :data:`lightning_3d.pipeline.SCHEDULES`; ``stages_per_rank`` for the
    looped ones), the layers split at ``split_points`` (default :func:`balanced_counts`'); ``job``:
    :func:`~lightning_3d.cost.formulas.predict_job`'s keyword arguments.

    The busiest rank sets the pace: its stages' work (:class:`StageCosts`) over ``1 −``
    :func:`bubble_fraction`, plus the hand-overs of the fill and the drain, plus what runs after the
    schedule (clipping, the optimizer, the gradient reduction over dp), the whole model's share of
    the rank's parameters; forward and backward in the whole step's proportion. Memory, at most:
    a whole step's of the most layers a rank holds (embedding and head included), its activations
    those of the micro-batches in flight on the first stage (all ``m`` where every forward runs first,
    GPipe and LoopedBFS; else at most ``pp·v``).
    """
    m = machine or DEFAULT_MACHINE
    pp, n, layers = pipeline_size, n_microbatches, shape.layers
    v = FIXED_STAGES_PER_RANK.get(schedule, stages_per_rank)
    num_stages = pp * v
    whole = predict_job(shape, grid, dp, m, **job)
    costs = StageCosts.of(whole, layers)
    if split_points is None:
        counts = balanced_counts(costs, layers, num_stages)
    else:
        counts = [len(r) for r in layer_ranges(layers, num_stages, split_points)]
    in_schedule = layers * costs.layer_ms + costs.first_ms + costs.last_ms
    after_schedule = whole.step_ms - in_schedule
    embedding = (shape.vocab or 0) * shape.hidden
    ranks = [[s for s in range(num_stages) if stage_owner(s, pp, schedule) == r] for r in range(pp)]

    bubble = bubble_fraction(pp, n, v)

    def work_ms(stages: list[int]) -> float:
        return sum(costs.stage_ms(counts[s], s, num_stages) for s in stages)

    def rank_ms(stages: list[int]) -> float:
        params = sum(counts[s] for s in stages) * shape.block_weights
        params += embedding * ((0 in stages) + (num_stages - 1 in stages))
        return work_ms(stages) / (1 - bubble) + after_schedule * params / shape.params

    busiest = max(ranks, key=rank_ms)
    cube = math.prod(grid)
    block = shape.batch / dp / n * shape.seq * shape.hidden / cube * BYTES
    across = pp > 1 and m.gpus_per_node <= cube * dp  # a stage fills its nodes: the next is on others
    hand_over = m.link("all_gather", 2, across).seconds(block) * 1e3 if pp > 1 else 0.0  # a pair of ranks
    fill_drain = 2 * (pp - 1) * hand_over
    step = rank_ms(busiest) + fill_drain
    most = max(sum(counts[s] for s in stages) for stages in ranks)
    stage = predict_job(replace(shape, layers=most), grid, dp, m, **job)
    in_flight = n if schedule in ALL_FORWARDS_FIRST else min(n, pp * v)
    activations = stage.detail["activations_GiB"]
    detail = {
        **stage.detail,
        "stage_layers": counts,
        "busiest_rank_stages": busiest,
        "bubble_fraction": bubble,
        "hand_over_ms": hand_over,
        "pipeline_exposed_ms": work_ms(busiest) * bubble / (1 - bubble) + fill_drain,
    }
    forward = step * whole.fwd_ms / whole.step_ms
    return Prediction(
        grid,
        dp,
        forward,
        step - forward,
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
