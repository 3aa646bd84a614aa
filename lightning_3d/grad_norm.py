"""The global gradient norm of a 3-D model, and clipping by it: each distinct shard counted once.

A parameter's shards differ along the grid axes that cut it and repeat along the others: the
:class:`~lightning_3d.sharding.ShardSpec`'s replicated axes inside the cube, and ``dp`` (after
the data-parallel all-reduce every replica holds the same gradients). So the squared norm of the
whole model is the sum, over the cube, of the squared norms of the shards this rank *represents*
(coordinate 0 on every replicating axis); ``dp`` adds nothing. With pipeline stages, each
stage's cube holds its own layers, so the sum runs over the ``"replica"`` group (every stage's cube
of one replica; the cube itself with one stage). When the dp ranks hold gradients
of different parameters (a ZeRO partition), sum over the world instead, each rank counting its
own parameters. Any integration (Lightning, DeepSpeed) clips with these two functions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from . import comm
from .grid import CUBE_AXES, Grid
from .sharding import get_spec

_REPLICATED_EVERYWHERE = "".join(CUBE_AXES)


def counts_once(param: torch.Tensor, grid: Grid) -> bool:
    """True on exactly one rank of each set of cube ranks that hold the same values of ``param``.

    3-D parameters follow their ShardSpec (:meth:`~lightning_3d.sharding.ShardSpec.is_representative`).
    A plain parameter (no ShardSpec) is taken to be replicated over the whole cube, so only cube
    rank 0 counts it.
    """
    spec = get_spec(param)
    if spec is not None:
        return spec.is_representative(grid)
    return all(grid.coord(a) == 0 for a in _REPLICATED_EVERYWHERE)


def _unique_with_grad(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _local_norm(grads: list[torch.Tensor], norm_type: float, dtype: torch.dtype) -> torch.Tensor:
    """The ``norm_type``-norm of ``grads`` together, in ``dtype``: float32 and float64 gradients
    through one multi-tensor kernel per device and dtype; lower precision ones one by one,
    accumulated in ``dtype`` (a bf16 norm per tensor would round each to 8 bits)."""
    exact = [g for g in grads if g.dtype in (torch.float32, torch.float64)]
    norms = [torch.nn.utils.get_total_norm(exact, norm_type).to(dtype)] if exact else []
    norms += [
        torch.linalg.vector_norm(g, norm_type, dtype=dtype)
        for g in grads
        if g.dtype not in (torch.float32, torch.float64)
    ]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)


def grad_norm(
    params: Iterable[torch.Tensor],
    grid: Grid,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients of the whole model, the same on every rank.

    Args:
        params: this rank's parameters (shards); those without a gradient are skipped, tied ones
            counted once.
        grid: the grid the parameters live on.
        norm_type: any p > 0, or ``inf``.
        group: the ranks whose counted shards together make up the model once. Default: the
            ``"replica"`` group, every stage's cube (every dp replica holds all gradients, equal
            across dp). Pass the world group when each dp rank passes a different part of the
            parameters.

    Returns:
        A float32 scalar (float64 when a gradient is float64) on the gradients' device.
    """
    params = _unique_with_grad(params)
    group = group if group is not None else grid.group("replica")
    device = params[0].grad.device if params else torch.device(grid.mesh.device_type)
    dtype = torch.float64 if any(p.grad.dtype == torch.float64 for p in params) else torch.float32
    counted = [p.grad.detach() for p in params if counts_once(p, grid)]
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    local = (
        _local_norm(counted, norm_type, dtype).to(device)
        if counted
        else torch.zeros((), dtype=dtype, device=device)
    )
    if math.isinf(norm_type):
        total, _ = comm.all_reduce(local, group, op=dist.ReduceOp.MAX)
        return total
    total, _ = comm.all_reduce(local.pow(norm_type), group)
    return total.pow(1.0 / norm_type)


def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    grid: Grid,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale the gradients of ``params`` in place so the global norm is at most ``max_norm``.

    The same rule as :func:`torch.nn.utils.clip_grad_norm_` (factor ``max_norm / (norm + 1e-6)``,
    capped at 1), applied to the global norm of :func:`grad_norm`, so a 3-D model clips exactly as
    its dense twin does. Returns the global norm before clipping.
    """
    params = _unique_with_grad(params)
    total = grad_norm(params, grid, norm_type, group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
            "set error_if_nonfinite=False to clip anyway"
        )
    torch.nn.utils.clip_grads_with_norm_(
        params, max_norm, total
    )  # scaled by one foreach kernel per device and dtype
    return total
