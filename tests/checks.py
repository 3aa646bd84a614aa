"""Comparison helpers that run inside the workers: a 3-D computation against its dense twin."""

from __future__ import annotations

import glob
import os

import harness
import torch

from lightning_3d.layout import as_layout
from lightning_3d.sharding import ShardSpec, get_spec, shard_tensor

# Every grid of the cube shapes the standards name, each in a world of 8 (the rest is dp).
GRIDS_8 = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]
TOL = 1e-10


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a − ref‖ / ‖ref‖; fails loudly on a zero reference (a test that could not fail)."""
    ref_norm = ref.norm()
    if ref_norm == 0:
        raise AssertionError("reference is all zeros: this comparison could not fail")
    if a.shape != ref.shape:
        raise AssertionError(f"shape {list(a.shape)} != reference {list(ref.shape)}")
    return float((a.double() - ref.double()).norm() / ref_norm)


def local(full: torch.Tensor, layout, grid) -> torch.Tensor:
    """This rank's block of a full activation."""
    return shard_tensor(full, as_layout(layout).spec(tuple(full.shape)), grid)


def seed_for(grid, seed: int) -> int:
    """Fresh data per dp replica: replicas see different inputs, as data parallelism does."""
    return seed * 1009 + grid.coord("dp")


def compare_module(mod3d, dense, x_full, in_layout, out_layout, grid, seed) -> dict[str, float]:
    """Output, input gradient and every parameter gradient of ``mod3d`` against ``dense``."""
    torch.manual_seed(seed_for(grid, seed) + 1)
    x_full = x_full.detach().requires_grad_()
    x = local(x_full, in_layout, grid).detach().clone().requires_grad_()
    y_ref = dense(x_full)
    w = torch.randn_like(y_ref)
    (y_ref * w).sum().backward()
    y = mod3d(x)
    (y * local(w, out_layout, grid)).sum().backward()
    errs = {
        "out": rel(y, local(y_ref, out_layout, grid)),
        "dx": rel(x.grad, local(x_full.grad, in_layout, grid)),
    }
    dense_params = dict(dense.named_parameters())
    for name, p in mod3d.named_parameters():
        ref = dense_params[name].grad
        spec = get_spec(p)
        errs["d" + name] = rel(p.grad, shard_tensor(ref, spec, grid) if spec is not None else ref)
    return errs


def on_grids(grids, job, *args) -> dict:
    """Run ``job(grid, *args)`` on each grid shape in ``grids`` (the rest of the world is dp); {shape: result}."""
    return {shape: job(harness.grid(shape), *args) for shape in grids}


def assert_close(results: list, tol: float = TOL) -> None:
    """Per-rank {grid: {what: err}} → assert every error below ``tol``."""
    bad = [
        (rank, g, k, e)
        for rank, r in enumerate(results)
        for g, errs in r.items()
        for k, e in errs.items()
        if not e < tol
    ]
    assert not bad, f"errors above {tol}: {bad[:10]}"


def nodes_named(t: torch.Tensor, name: str) -> int:
    """How many nodes of the autograd graph behind ``t`` are named ``name``."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [nxt for nxt, _ in node.next_functions]
    return sum(type(node).__name__ == name for node in seen)


def sums_replicas(modules, grid) -> bool:
    """Whether any of the 3-D ``modules`` has a parameter whose gradient is summed over replicas on ``grid``."""
    from lightning_3d.layers.base import Module3D
    from lightning_3d.sharding import replicated_grad_axes

    return any(
        replicated_grad_axes(get_spec(p), grid, summed)
        for m in modules
        if isinstance(m, Module3D)
        for p, summed in m.replicated_parameters()
    )


__all__ = [
    "GRIDS_8",
    "ShardSpec",
    "TOL",
    "assert_close",
    "compare_module",
    "local",
    "nodes_named",
    "on_grids",
    "rel",
    "seed_for",
    "sums_replicas",
]


def value_error(fn) -> str:
    """The message of the ``ValueError`` that ``fn()`` raises, or ``"no ValueError"`` (which no check expects)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no ValueError"


def gloo_threads() -> int:
    """This process's gloo transport threads: one per gloo process group it belongs to, each waking every 10 ms."""
    return sum(
        open(f).read().strip() == "gloo_tcp_loop" for f in glob.glob(f"/proc/{os.getpid()}/task/*/comm")
    )
