"""The machine's rates, measured on the running process group: the :class:`~lightning_3d.planner.Machine`
``grid="auto"`` prices with.

``measure_machine()`` runs on every rank (every collective inside is matched across ranks) and
measures the matmul rate and device copy bandwidth (the slowest rank's), and the bus bandwidth and
latency of all-gather, reduce-scatter and all-reduce in groups of every size a grid of this world
can use: consecutive ranks inside a node, and with several nodes one rank per node (the links
between nodes). Slow links (another network, ``NCCL_P2P_DISABLE=1``) show in the result, and the
planner's choice follows them. It works on CUDA (NCCL) and at tiny sizes on CPU (gloo).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from . import comm
from .planner import DEFAULT_MACHINE, OPS, Link, Machine


@dataclass(frozen=True)
class Sizes:
    """What ``measure_machine`` times: ``matmul_n``³ products, copies of ``copy_bytes``, collectives of
    ``large`` bytes (bandwidth: the slope between ``large[0]`` and ``large[1]``) and bursts of ``burst``
    collectives of ``small`` bytes (latency), each the median of ``iters`` runs."""

    matmul_n: int
    copy_bytes: int
    large: tuple[int, int]
    small: int
    iters: int
    burst: int = 20


GPU = Sizes(matmul_n=8192, copy_bytes=2**30, large=(2**20, 2**28), small=2**16, iters=10)
CPU = Sizes(matmul_n=128, copy_bytes=2**20, large=(2**10, 2**14), small=2**8, iters=2, burst=4)


def median_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median time of ``fn()`` over ``iters`` runs after ``warmup``: CUDA events, or the host clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def slowest(values: list[float], device: torch.device, group=None) -> list[float]:
    """Each value's maximum over the ranks of ``group`` (default: the world)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, iters: int = 20) -> float:
    """Rate of an ``n³`` product on this device, TFLOP/s (random operands)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn_like(a)
    return 2 * n**3 / median_ms(lambda: a @ b, device, 3, iters) / 1e9


def copy_gbps(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """Device memory bandwidth of a copy of ``nbytes``, GB/s (bytes read + written)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / median_ms(lambda: y.copy_(x), device, 3, iters) / 1e6


def collective_rates(device: torch.device, group, size: int, large: tuple[int, int], iters: int, small: int,
                     burst: int = 20) -> dict:
    """Latency (µs) and bus bandwidth (GB/s) of all-gather, reduce-scatter and all-reduce in ``group``
    (``size`` ranks; every rank calls with its own group, all groups at once). Bandwidth: the slope
    ``moved / t`` between the two ``large`` message sizes (bytes of the full, gathered tensor);
    latency: the time per collective of ``burst`` back-to-back ones of ``small`` bytes, as a step
    issues them (the intercept of the two-point fit is kept as ``intercept_us``). Times are the
    slowest rank's."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = size
    out = {}
    for op in OPS:
        def timed(nbytes: int, repeat: int) -> tuple[float, float]:
            full = torch.randn(max(nbytes // dtype.itemsize // g, 1) * g, dtype=dtype, device=device)
            part = full[: full.numel() // g].clone()
            moved = full.numel() * dtype.itemsize * (g - 1) / g * (2 if op == "all_reduce" else 1)
            fn = {"all_gather": lambda: comm.all_gather_dim0(part, group), "reduce_scatter": lambda: comm.reduce_scatter_dim0(full, group),
                  "all_reduce": lambda: comm.all_reduce(full, group)}[op]

            def run() -> None:
                for _ in range(repeat):
                    fn()

            return moved, slowest([median_ms(run, device, 2, iters)], device)[0] * 1e-3 / repeat

        (m0, t0), (m1, t1) = (timed(n, 1) for n in large)
        beta = (m1 - m0) / max(t1 - t0, 1e-9)
        _, t_small = timed(small, burst)
        out[op] = {"latency_us": t_small * 1e6, "busbw_GBps": beta / 1e9, "intercept_us": max(t0 - m0 / beta, 0.0) * 1e6,
                   "points": [{"moved_bytes": m, "ms": t * 1e3} for m, t in ((m0, t0), (m1, t1))]}
    return out


def _links(rates: dict) -> dict[str, Link]:
    return {op: Link(r["busbw_GBps"], r["latency_us"]) for op, r in rates.items()}


def _rates_then_destroy(device: torch.device, group, size: int, sizes: Sizes) -> dict:
    """:func:`collective_rates` in ``group``, which is then destroyed: a measuring group held on
    would keep its NCCL communicators' memory, or a gloo thread, for the rest of the run."""
    try:
        return collective_rates(device, group, size, sizes.large, sizes.iters, sizes.small, sizes.burst)
    finally:
        dist.destroy_process_group(group)


def measure_machine(device: torch.device | None = None, gpus_per_node: int | None = None, sizes: Sizes | None = None) -> Machine:
    """The :class:`~lightning_3d.planner.Machine` of this world, measured; call on every rank.

    Args:
        device: default: this rank's CUDA device, or the CPU.
        gpus_per_node: ranks per node (numbered node by node); default: the CUDA devices of this host,
            or the whole world on CPU.
        sizes: :data:`GPU` on CUDA, :data:`CPU` otherwise.

    Groups: every divisor ≥ 2 of ``gpus_per_node`` that divides the world (consecutive ranks:
    ``Machine.intra``) and, with several nodes, one rank per node (``Machine.inter``). The
    calibration is :data:`~lightning_3d.planner.DEFAULT_MACHINE`'s; an op measured in no group (one
    rank) keeps its links.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cuda = device.type == "cuda"
    sizes = sizes or (GPU if cuda else CPU)
    world = dist.get_world_size()
    per_node = gpus_per_node or (min(torch.cuda.device_count(), world) if cuda else world)
    if world % per_node:
        raise ValueError(f"gpus_per_node={per_node} does not divide the world of {world} ranks; pass the ranks each node runs")
    matmul = matmul_tflops(device, torch.bfloat16 if cuda else torch.float32, sizes.matmul_n, sizes.iters)
    copy = copy_gbps(device, sizes.copy_bytes, sizes.iters)
    matmul, copy = (-v for v in slowest([-matmul, -copy], device))
    intra = {op: {} for op in OPS}
    for g in (g for g in range(2, per_node + 1) if per_node % g == 0):
        group, _ = dist.new_subgroups(g)
        for op, link in _links(_rates_then_destroy(device, group, g, sizes)).items():
            intra[op][g] = link
    inter = dict(DEFAULT_MACHINE.inter)
    nodes = world // per_node
    if nodes > 1:
        group, _ = dist.new_subgroups_by_enumeration([[i + n * per_node for n in range(nodes)] for i in range(per_node)])
        inter = _links(_rates_then_destroy(device, group, nodes, sizes))
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else DEFAULT_MACHINE.memory_GiB
    return replace(DEFAULT_MACHINE, matmul_tflops=matmul, hbm_GBps=copy, gpus_per_node=per_node, memory_GiB=memory,
                   intra={op: table or DEFAULT_MACHINE.intra[op] for op, table in intra.items()}, inter=inter)
