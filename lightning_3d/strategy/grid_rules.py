"""How :class:`Tensor3DStrategy` picks the grid: ``"auto"`` factoring and the checks of explicit values."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import arguments, cost
from ..options import RuntimeOptions
from ..pipeline import PipelineOptions
from ..pipeline.kinds import stages_per_rank

HALF_PRECISION_HOOKS = (default_hooks.bf16_compress_hook, default_hooks.fp16_compress_hook)


def auto_shape(n: int) -> tuple[int, int, int]:
    """The most even ``(px, py, pz)``, ``px ≥ py ≥ pz``, with ``px·py·pz = n``: 8→2×2×2, 4→2×2×1, 2→2×1×1, 12→3×2×2."""
    if n < 1:
        raise ValueError(f"cannot factor {n} ranks into a grid; need at least 1")
    triples = [
        (a, b, n // (a * b))
        for a in range(1, n + 1)
        if n % a == 0
        for b in range(1, a + 1)
        if (n // a) % b == 0 and n // (a * b) <= b
    ]
    return min(triples)


def check_grid_arg(grid) -> str | tuple[int, int, int]:
    """``"auto"`` or three positive ints ``(px, py, pz)`` (:func:`lightning_3d.arguments.grid_shape`);
    ``ValueError`` otherwise."""
    return grid if grid == "auto" else arguments.grid_shape(grid)


def check_dp_arg(dp) -> str | int:
    """``"auto"`` or a positive int; ``ValueError`` otherwise."""
    return dp if dp == "auto" else arguments.positive_int(dp, "data_parallel_size")


def resolve(
    grid: str | tuple[int, int, int],
    dp: str | int,
    world: int,
    devices_per_node: int,
    model_shape: cost.ModelShape | None = None,
    *,
    pipeline_size: int = 1,
    pipeline: PipelineOptions | None = None,
    options: RuntimeOptions | None = None,
    machine: cost.Machine | None = None,
    half_grads: bool = False,
) -> tuple[tuple[int, int, int], int]:
    """The ``(px, py, pz)`` and dp of a world of ``world`` ranks in ``pipeline_size`` stages.

    Each stage holds ``world / pipeline_size`` ranks, ``dp × px × py × pz`` (stages are the outermost
    axis of the rank order, :func:`lightning_3d.grid.init_grid`). ``grid="auto"`` with dp ``"auto"``
    and a ``model_shape`` takes the cost model's fastest grid that fits
    (:func:`lightning_3d.cost.best_grid`, nodes of ``devices_per_node`` GPUs, links between them
    priced as such), on ``machine``'s rates (:func:`lightning_3d.cost.measure_machine`; default
    :data:`~lightning_3d.cost.DEFAULT_MACHINE`; ``half_grads``: the gradient reduction over dp runs
    in half precision, :func:`halves_gradients`), with ``options``' ``async_tp`` and
    ``grads_at_end`` (default ``RuntimeOptions()``); with ``pipeline_size > 1``, as stages run under
    ``pipeline``'s schedule and micro-batches (default ``PipelineOptions()``), split where it says or
    where the stages balance (:func:`priced_split`; the shape needs ``vocab``). Without a shape it
    factors the devices of one node (of one stage's ranks), so that each cube lies inside a node and
    dp spans the nodes (or ``world / (pp·dp)`` when dp is given). ``data_parallel_size="auto"`` takes
    the rest.

    Raises:
        ValueError: the numbers do not multiply to the world size; the message names the fix.
    """
    pp = arguments.positive_int(pipeline_size, "pipeline_size")
    if world % pp:
        raise ValueError(
            f"pipeline_size={pp} does not divide the world size {world}; launch a multiple of {pp} processes "
            f"or pick a pipeline_size that divides {world}"
        )
    ranks = world // pp
    if grid == "auto":
        if dp == "auto" and model_shape is not None:
            shape = cost.best_grid(
                **dataclasses.asdict(model_shape),
                world=world,
                machine=on_nodes(machine, devices_per_node),
                **job_options(options, half_grads),
                **_stages(pipeline, pp),
            )
            return shape, ranks // math.prod(shape)
        if dp == "auto":
            cube = math.gcd(devices_per_node, ranks)
        elif ranks % dp:
            raise ValueError(
                f"data_parallel_size={dp} does not divide {_stage_ranks(world, pp)}; "
                f"pick a divisor of {ranks} or launch a multiple of {pp * dp} processes"
            )
        else:
            cube = ranks // dp
        return auto_shape(cube), ranks // cube
    cube = math.prod(grid)
    if dp == "auto":
        if ranks % cube:
            raise ValueError(
                f"{_stage_ranks(world, pp)} is not divisible by px·py·pz = {cube} of grid {grid}; "
                f"launch a multiple of {pp * cube} processes or pick a grid whose product divides {ranks}"
            )
        return grid, ranks // cube
    if pp * dp * cube != world:
        names, sizes, knob = ("pipeline_size·", f"{pp}·", " / pipeline_size") if pp > 1 else ("", "", "")
        raise ValueError(
            f"world size {world} != {names}data_parallel_size·px·py·pz = {sizes}{dp}·{cube} = {pp * dp * cube} "
            f"(grid {grid}); launch {pp * dp * cube} processes or change grid / data_parallel_size{knob}"
        )
    return grid, dp


def on_nodes(machine: cost.Machine | None, devices_per_node: int) -> cost.Machine:
    """``machine`` (default :data:`~lightning_3d.cost.DEFAULT_MACHINE`) on nodes of ``devices_per_node`` devices."""
    return dataclasses.replace(machine or cost.DEFAULT_MACHINE, gpus_per_node=devices_per_node)


def job_options(options: RuntimeOptions | None, half_grads: bool) -> dict:
    """The keyword arguments :func:`lightning_3d.cost.predict_job` prices ``options`` (default
    ``RuntimeOptions()``: the model's are made after the grid) and the dp reduction's precision with."""
    options = options if options is not None else RuntimeOptions()
    return dict(
        async_tp=options.async_tp, half_grads=half_grads, grads_at_end=options.grads_at_end, rows=options.rows
    )


def _stages(pipeline: PipelineOptions | None, pp: int) -> dict:
    """The keyword arguments :func:`lightning_3d.cost.best_grid` prices ``pp`` stages under ``pipeline`` with."""
    if pp == 1:
        return {}
    pipeline = pipeline if pipeline is not None else PipelineOptions()
    return dict(
        pipeline_size=pp,
        n_microbatches=pipeline.microbatches(pp),
        schedule=pipeline.schedule,
        stages_per_rank=stages_per_rank(pipeline.schedule, pipeline.stages_per_rank),
        split_points=pipeline.split_points,
    )


def priced_split(
    pipeline: PipelineOptions,
    model_shape: cost.ModelShape | None,
    grid: tuple[int, int, int],
    dp: int,
    pipeline_size: int,
    devices_per_node: int,
    *,
    options: RuntimeOptions | None = None,
    machine: cost.Machine | None = None,
    half_grads: bool = False,
) -> PipelineOptions:
    """``pipeline`` with the split points that balance its stages on ``grid`` by the cost model
    (:func:`lightning_3d.cost.split_points`: the first stage's embedding and the last's head and loss
    weighed against the layers), priced as :func:`resolve` prices; ``pipeline`` as it is where it gives
    split points, or without a ``model_shape`` of the whole model (``vocab``)."""
    if pipeline.split_points is not None or model_shape is None or model_shape.vocab is None:
        return pipeline
    stages = pipeline_size * stages_per_rank(pipeline.schedule, pipeline.stages_per_rank)
    points = cost.split_points(
        model_shape, grid, dp, stages, on_nodes(machine, devices_per_node), **job_options(options, half_grads)
    )
    return dataclasses.replace(pipeline, split_points=points)


def _stage_ranks(world: int, pp: int) -> str:
    """The ranks of one stage, as :func:`resolve`'s errors name them."""
    if pp == 1:
        return f"the world size {world}"
    return f"the stage size {world // pp} (world size {world} / pipeline_size {pp})"


def halves_gradients(ddp_comm_hook: Callable | None) -> bool:
    """Whether ``ddp_comm_hook`` is one of PyTorch's hooks that reduce gradients in half precision
    (``default_hooks.bf16_compress_hook``, ``fp16_compress_hook``): half the bytes over dp, as the
    cost model prices with ``half_grads``."""
    return ddp_comm_hook in HALF_PRECISION_HOOKS
