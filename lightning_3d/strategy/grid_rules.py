"""How :class:`Tensor3DStrategy` picks the grid: ``"auto"`` factoring and the checks of explicit values."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import arguments, cost
from ..options import RuntimeOptions

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
    options: RuntimeOptions | None = None,
    machine: cost.Machine | None = None,
    half_grads: bool = False,
) -> tuple[tuple[int, int, int], int]:
    """The ``(px, py, pz)`` and dp of a world of ``world`` ranks.

    ``grid="auto"`` with dp ``"auto"`` and a ``model_shape`` takes the cost model's fastest grid
    that fits (:func:`lightning_3d.cost.best_grid`, nodes of ``devices_per_node`` GPUs, links
    between them priced as such), on ``machine``'s rates (:func:`lightning_3d.cost.measure_machine`;
    default :data:`~lightning_3d.cost.DEFAULT_MACHINE`; ``half_grads``: the gradient reduction over
    dp runs in half precision, :func:`halves_gradients`), with ``options``' ``async_tp`` and
    ``grads_at_end`` (default ``RuntimeOptions()``); without a shape it factors
    the devices of one node, so that each cube lies inside a node and dp spans the nodes (or
    ``world / dp`` when dp is given).
    ``data_parallel_size="auto"`` takes the rest.

    Raises:
        ValueError: the numbers do not multiply to the world size; the message names the fix.
    """
    if grid == "auto":
        if dp == "auto" and model_shape is not None:
            options = options if options is not None else RuntimeOptions()
            machine = dataclasses.replace(machine or cost.DEFAULT_MACHINE, gpus_per_node=devices_per_node)
            shape = cost.best_grid(
                **dataclasses.asdict(model_shape),
                world=world,
                machine=machine,
                async_tp=options.async_tp,
                half_grads=half_grads,
                grads_at_end=options.grads_at_end,
                rows=options.rows,
            )
            return shape, world // math.prod(shape)
        if dp == "auto":
            cube = math.gcd(devices_per_node, world)
        elif world % dp:
            raise ValueError(
                f"data_parallel_size={dp} does not divide the world size {world}; "
                f"pick a divisor of {world} or launch a multiple of {dp} processes"
            )
        else:
            cube = world // dp
        return auto_shape(cube), world // cube
    cube = math.prod(grid)
    if dp == "auto":
        if world % cube:
            raise ValueError(
                f"the world size {world} is not divisible by px·py·pz = {cube} of grid {grid}; "
                f"launch a multiple of {cube} processes or pick a grid whose product divides {world}"
            )
        return grid, world // cube
    if dp * cube != world:
        raise ValueError(
            f"world size {world} != data_parallel_size·px·py·pz = {dp}·{cube} = {dp * cube} (grid {grid}); "
            f"launch {dp * cube} processes or change grid / data_parallel_size"
        )
    return grid, dp


def halves_gradients(ddp_comm_hook: Callable | None) -> bool:
    """Whether ``ddp_comm_hook`` is one of PyTorch's hooks that reduce gradients in half precision
    (``default_hooks.bf16_compress_hook``, ``fp16_compress_hook``): half the bytes over dp, as the
    cost model prices with ``half_grads``."""
    return ddp_comm_hook in HALF_PRECISION_HOOKS
