"""The grid search: every feasible 3-D layout of a world priced by :mod:`~lightning_3d.cost.formulas`
(in pipeline stages by :mod:`~lightning_3d.cost.pipeline`), and the fastest that fits
(:func:`best_grid`, what ``grid="auto"`` calls once the model's shape is known)."""

from __future__ import annotations

from collections.abc import Sequence

from .formulas import ModelShape, Prediction, grid_error, predict_3d, predict_job
from .machine import DEFAULT_MACHINE, Machine
from .pipeline import pipeline_error, predict_pipeline


def cube_grids(n: int) -> list[tuple[int, int, int]]:
    """Every ``(px, py, pz)`` with ``px·py·pz == n``."""
    return [
        (px, py, n // (px * py))
        for px in range(1, n + 1)
        if n % px == 0
        for py in range(1, n // px + 1)
        if (n // px) % py == 0
    ]


def candidates(
    shape: ModelShape,
    world: int,
    machine: Machine = None,
    *,
    async_tp: bool = False,
    compiled: bool = False,
    half_grads: bool = False,
    grads_at_end: bool = False,
    rows: str = "auto",
    pipeline_size: int = 1,
    n_microbatches: int = 1,
    schedule: str = "1F1B",
    stages_per_rank: int = 2,
    split_points: Sequence[int] | None = None,
) -> list[Prediction]:
    """Every feasible 3-D grid (any cube size dividing ``world / pipeline_size``, dp filling the rest;
    with ``async_tp`` as collective matmuls, on cubes inside one node only), sorted by predicted step
    time. With ``shape.vocab`` the grids are priced as whole training steps
    (:func:`~lightning_3d.cost.formulas.predict_job`, blocks ``compiled`` or not, the gradient reduction over
    dp in bf16 with ``half_grads``, the weight gradients handed on at the end of backward with
    ``grads_at_end``, the rows as ``rows``: ``RuntimeOptions.rows``), else as block stacks
    (:func:`~lightning_3d.cost.formulas.predict_3d`). With ``pipeline_size > 1`` (``vocab`` required),
    as that many stages of the cube, each replica's batch in ``n_microbatches`` under ``schedule``
    (:func:`~lightning_3d.cost.pipeline.predict_pipeline`: the layers split at ``split_points``, or
    where the stages balance), a grid feasible where a micro-batch splits on it."""
    m = machine or DEFAULT_MACHINE
    if pipeline_size > 1 and shape.vocab is None:
        raise ValueError(
            f"pricing {pipeline_size} pipeline stages needs the whole model (the embedding on the first stage, the "
            f"LM head and loss on the last): pass ModelShape(..., vocab=V); got {shape}"
        )
    ranks = world // pipeline_size
    job = dict(async_tp=async_tp, rows=rows)
    if shape.vocab is not None:
        job.update(compiled=compiled, half_grads=half_grads, grads_at_end=grads_at_end)
    out = []
    for cube in (c for c in range(1, ranks + 1) if ranks % c == 0):
        if async_tp and m.gpus_per_node % cube and ranks > m.gpus_per_node:
            continue  # collective matmuls need every cube inside one node (its NVLink domain)
        for grid in cube_grids(cube):
            dp = ranks // cube
            if pipeline_size > 1:
                if pipeline_error(shape, grid, dp, n_microbatches, rows) is None:
                    out.append(
                        predict_pipeline(
                            shape,
                            grid,
                            dp,
                            pipeline_size,
                            n_microbatches,
                            schedule,
                            stages_per_rank,
                            m,
                            split_points,
                            **job,
                        )
                    )
            elif grid_error(shape, grid, dp, rows) is None:
                price = predict_3d if shape.vocab is None else predict_job
                out.append(price(shape, grid, dp, m, **job))
    return sorted(out, key=lambda p: p.step_ms)


def fits(p: Prediction, machine: Machine = None) -> bool:
    return p.memory_GiB <= (machine or DEFAULT_MACHINE).memory_GiB


def best_grid(
    hidden: int,
    heads: int,
    seq: int,
    batch: int,
    layers: int,
    world: int,
    machine: Machine = None,
    ffn: int | None = None,
    async_tp: bool = False,
    kv_heads: int | None = None,
    gated: bool = False,
    vocab: int | None = None,
    compiled: bool = False,
    half_grads: bool = False,
    grads_at_end: bool = False,
    rows: str = "auto",
    pipeline_size: int = 1,
    n_microbatches: int = 1,
    schedule: str = "1F1B",
    stages_per_rank: int = 2,
    split_points: Sequence[int] | None = None,
) -> tuple[int, int, int]:
    """The ``(px, py, pz)`` with the lowest predicted step time that fits in memory (dp = world /
    (pipeline_size·px·py·pz)); the model is the global-batch GPT stack of ``hidden``, ``heads``, ``seq``,
    ``batch`` and ``layers`` (``ffn``, ``kv_heads``, ``gated`` and ``vocab`` as :class:`ModelShape`: with
    ``vocab``, the whole training step of :func:`~lightning_3d.cost.formulas.predict_job`, its blocks
    ``compiled`` or not, its gradient reduction over dp in bf16 with ``half_grads``, its weight gradients
    handed on at the end of backward with ``grads_at_end``), its products collective matmuls with
    ``async_tp``, its rows as ``rows`` (``RuntimeOptions.rows``: ``"auto"`` lets a batch that whole
    sequences cannot split run on token rows, ``"sequences"`` keeps only the grids they split on); in
    ``pipeline_size`` stages as :func:`candidates` prices them. This is what ``grid="auto"`` uses when
    the model's shape is known.

    Raises:
        ValueError: no grid divides the shape, or none fits in memory; stages without ``vocab``.
    """
    m = machine or DEFAULT_MACHINE
    shape = ModelShape(hidden, heads, seq, batch, layers, ffn, kv_heads, gated, vocab)
    options = candidates(
        shape,
        world,
        m,
        async_tp=async_tp,
        compiled=compiled,
        half_grads=half_grads,
        grads_at_end=grads_at_end,
        rows=rows,
        pipeline_size=pipeline_size,
        n_microbatches=n_microbatches,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        split_points=split_points,
    )
    if not options:
        stages = (
            f" in {pipeline_size} pipeline stages, micro-batches of batch / (dp·{n_microbatches}) sequences"
            if pipeline_size > 1
            else ""
        )
        raise ValueError(
            f"no px·py·pz grid with dp filling {world // pipeline_size} ranks{stages} splits hidden={hidden}, "
            f"heads={heads}, batch={batch}, seq={seq}; use heads and hidden divisible by the grid, and a batch "
            f"divisible by dp with whole sequences per rank or a sequence length divisible by 2·px·pz (token rows)"
        )
    fitting = [p for p in options if fits(p, m)]
    if not fitting:
        least = min(options, key=lambda p: p.memory_GiB)
        raise ValueError(
            f"no grid fits {m.memory_GiB:.0f} GiB per GPU: the least, {least.label}, needs {least.memory_GiB:.1f} GiB; "
            f"use more GPUs, a smaller batch or activation checkpointing"
        )
    return fitting[0].grid
