"""The machine: its measured rates (:class:`Machine`) and how they are measured (:func:`measure_machine`).

A :class:`Machine` holds one kind of node's matmul rate, copy bandwidth and, per collective and
group size, a bus bandwidth and a latency (inside a node and between nodes), and the cost model's
calibration. ``measure_machine()`` runs on every rank (every collective inside is matched across
ranks) and measures the matmul rate and device copy bandwidth (the slowest rank's), and the bus
bandwidth and latency of all-gather, reduce-scatter and all-reduce in groups of every size a grid
of this world can use: consecutive ranks inside a node, and with several nodes one rank per node
(the links between nodes). Slow links (another network, ``NCCL_P2P_DISABLE=1``) show in the
result, and ``grid="auto"``'s choice follows them. It works on CUDA (NCCL) and at tiny sizes on CPU (gloo).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .. import comm

OPS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Link:
    """A collective's cost in one group: ``latency + moved_bytes / busbw`` (NCCL bus bandwidth)."""

    busbw_GBps: float
    latency_us: float

    def seconds(self, moved_bytes: float) -> float:
        return self.latency_us * 1e-6 + moved_bytes / (self.busbw_GBps * 1e9)


@dataclass(frozen=True)
class Machine:
    """Measured rates of one kind of node, and the model's calibration.

    Args:
        matmul_tflops: bf16 GEMM rate of one GPU (8192³ product).
        hbm_GBps: device copy bandwidth (bytes read + written).
        intra: per collective op, ``{group size: Link}`` inside a node (NVLink).
        inter: per collective op, the Link of a group that spans nodes (per-GPU network).
        gpus_per_node: GPUs that share NVLink.
        memory_GiB: memory per GPU, for :func:`~lightning_3d.cost.search.fits`.
        gemm_efficiency: fraction of ``matmul_tflops`` the model's GEMMs and attention reach.
        passes_fwd, passes_bwd: memory-bound traffic per layer, in bytes per element of the
            local ``[tokens, hidden]`` activation (norms, residuals, GELU, copies, loss).
        overhead_ms: fixed cost per layer and step (launches, small kernels, synchronisation).
        overlap_cost: fraction of a hidden collective's time still paid by the compute it
            overlaps (NCCL's SMs and memory traffic slow the GEMM; fitted: 0.4).
        pipeline_us: what a collective matmul (``async_tp``) exposes besides its copies' excess
            over the product: its barriers and the ranks' skew, µs per product (fitted).
        job_gemm_efficiency: ``gemm_efficiency`` of the blocks in the whole training job
            (:func:`~lightning_3d.cost.formulas.predict_job`: fp32 master weights under autocast, sustained clocks).
        compiled_job_gemm_efficiency: the same with compiled blocks (each one graph, its
            elementwise work fused around the products).
        eager_gated_passes: ``passes_fwd, passes_bwd`` added to gated (Llama-style: SwiGLU,
            RMSNorm, rotary embedding) blocks run eagerly; compiled blocks fuse them away.
        compiled_passes: ``passes_fwd, passes_bwd`` of blocks run through ``torch.compile``.
        activation_fraction: the share of the activations an eager block keeps for backward that
            a block keeps (1 eagerly; :func:`~lightning_3d.cost.formulas.predict_job` uses
            ``compiled_activation_fraction`` for compiled blocks, whose graphs recompute elementwise results
            instead of keeping them; fitted).
        optimizer_bytes: bytes moved per parameter shard and step by the gradient-norm clipping,
            the fused AdamW step (fp32 parameter, gradient and two moments), the fp32 gradient
            accumulation and the bf16 casts of the weights.
        logit_bytes: bytes moved per fp32 logit element by the vocabulary-parallel cross-entropy,
            forward and backward together.
        logit_memory_bytes: bytes per logit element alive at the loss (bf16 logits, fp32 copies).
        dp_busbw_GBps: the most bus bandwidth DDP's gradient all-reduce reaches while backward runs
            beside it (NCCL's kernels share the GPU with the compute), however fast the link.
        dp_overlap: fraction of the blocks' backward that hides the data-parallel all-reduce.
        ddp_bytes: bytes per parameter shard DDP holds with dp > 1 (its fp32 buckets beside the gradients).
        host_layer_ms: host time per layer and step (eager, ``async_tp``, compiled): a step is
            never shorter than the host takes to issue it.
        collective_host_us: host time added per collective of a layer over the cube (8 per layer and
            split axis): its launch, and the wait at it for the ranks, which drift apart while
            the host sets the pace (the slowest rank's host decides each collective).
        late_scatter_fraction: the share of the weight gradients' reduce-scatters over x that
            ``grads_at_end`` takes off the step. Waited for in its product's backward, such a
            reduce-scatter does not hide behind the next GEMM as the model's overlap assumes (its
            kernel waits for SMs the GEMM holds), and about this share of it runs alone; left for
            the end of backward, it runs beside the rest, as far as the blocks' backward compute
            reaches (on slow links the scatters outlast it) (fitted).
    """

    matmul_tflops: float
    hbm_GBps: float
    intra: dict[str, dict[int, Link]]
    inter: dict[str, Link]
    gpus_per_node: int = 8
    memory_GiB: float = 80.0
    gemm_efficiency: float = 0.84
    passes_fwd: float = 14.0
    passes_bwd: float = 24.0
    overhead_ms: float = 0.05
    overlap_cost: float = 0.4
    pipeline_us: float = 60.0
    job_gemm_efficiency: float = 0.66
    compiled_job_gemm_efficiency: float = 0.72
    eager_gated_passes: tuple[float, float] = (10.0, 20.0)
    compiled_passes: tuple[float, float] = (4.0, 8.0)
    activation_fraction: float = 1.0
    compiled_activation_fraction: float = 0.7
    optimizer_bytes: float = 50.0
    logit_bytes: float = 52.0
    logit_memory_bytes: float = 12.0
    dp_busbw_GBps: float = 120.0
    dp_overlap: float = 0.5
    host_layer_ms: tuple[float, float, float] = (6.0, 9.0, 6.0)
    ddp_bytes: float = 6.0
    collective_host_us: float = 150.0
    late_scatter_fraction: float = 0.5

    def link(self, op: str, size: int, spans_nodes: bool) -> Link:
        """The Link of ``op`` in a group of ``size`` ranks (the nearest measured size inside a node)."""
        if spans_nodes:
            return self.inter[op]
        table = self.intra[op]
        if size in table:
            return table[size]
        return table[min(table, key=lambda g: (abs(math.log(g / size)), -g))]

    def rates(self) -> dict:
        """The measured part as JSON (no calibration): rates, links by op and group size, node size, memory."""

        def as_dict(link: Link) -> dict:
            return {"busbw_GBps": link.busbw_GBps, "latency_us": link.latency_us}

        return {
            "matmul_tflops": self.matmul_tflops,
            "hbm_GBps": self.hbm_GBps,
            "gpus_per_node": self.gpus_per_node,
            "memory_GiB": self.memory_GiB,
            "intra": {
                op: {str(g): as_dict(link) for g, link in sorted(t.items())} for op, t in self.intra.items()
            },
            "inter": {op: as_dict(link) for op, link in self.inter.items()},
        }

    @classmethod
    def from_rates(cls, rates: dict) -> Machine:
        """The inverse of :meth:`rates`, with :data:`DEFAULT_MACHINE`'s calibration (and its links for an
        op measured in no group, as on one GPU)."""
        return replace(
            DEFAULT_MACHINE,
            matmul_tflops=rates["matmul_tflops"],
            hbm_GBps=rates["hbm_GBps"],
            gpus_per_node=rates["gpus_per_node"],
            memory_GiB=rates["memory_GiB"],
            intra={
                op: {int(g): Link(**v) for g, v in t.items()} or DEFAULT_MACHINE.intra[op]
                for op, t in rates["intra"].items()
            },
            inter={op: Link(**v) for op, v in rates["inter"].items()},
        )


# 4× H200 SXM, measured (latency: bursts of small collectives); 8 ranks: the bus bandwidth of a 1 GiB
# all-reduce on an 8×H100 NVLink host (360 GB/s) with an assumed 40 µs; inter-node: an assumed 400 Gb/s NIC
# per GPU (≈45 GB/s bus bandwidth, 20 µs), not measured.
DEFAULT_MACHINE = Machine(
    matmul_tflops=760.0,
    hbm_GBps=4100.0,
    intra={
        "all_gather": {2: Link(246.0, 59.0), 4: Link(347.0, 34.0), 8: Link(360.0, 40.0)},
        "reduce_scatter": {2: Link(222.0, 53.0), 4: Link(292.0, 35.0), 8: Link(360.0, 40.0)},
        "all_reduce": {2: Link(276.0, 38.0), 4: Link(319.0, 31.0), 8: Link(361.0, 40.0)},
    },
    inter={op: Link(45.0, 20.0) for op in OPS},
    memory_GiB=80.0,
)


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


def collective_rates(
    device: torch.device, group, size: int, large: tuple[int, int], iters: int, small: int, burst: int = 20
) -> dict:
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

        def timed(op: str, nbytes: int, repeat: int) -> tuple[float, float]:
            full = torch.randn(max(nbytes // dtype.itemsize // g, 1) * g, dtype=dtype, device=device)
            part = full[: full.numel() // g].clone()
            moved = full.numel() * dtype.itemsize * (g - 1) / g * (2 if op == "all_reduce" else 1)
            fn = {
                "all_gather": lambda: comm.all_gather_dim0(part, group),
                "reduce_scatter": lambda: comm.reduce_scatter_dim0(full, group),
                "all_reduce": lambda: comm.all_reduce(full, group),
            }[op]

            def run() -> None:
                for _ in range(repeat):
                    fn()

            return moved, slowest([median_ms(run, device, 2, iters)], device)[0] * 1e-3 / repeat

        (m0, t0), (m1, t1) = (timed(op, n, 1) for n in large)
        beta = (m1 - m0) / max(t1 - t0, 1e-9)
        _, t_small = timed(op, small, burst)
        out[op] = {
            "latency_us": t_small * 1e6,
            "busbw_GBps": beta / 1e9,
            "intercept_us": max(t0 - m0 / beta, 0.0) * 1e6,
            "points": [{"moved_bytes": m, "ms": t * 1e3} for m, t in ((m0, t0), (m1, t1))],
        }
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


def measure_machine(
    device: torch.device | None = None, gpus_per_node: int | None = None, sizes: Sizes | None = None
) -> Machine:
    """The :class:`Machine` of this world, measured; call on every rank.

    Args:
        device: default: this rank's CUDA device, or the CPU.
        gpus_per_node: ranks per node (numbered node by node); default: the CUDA devices of this host,
            or the whole world on CPU.
        sizes: :data:`GPU` on CUDA, :data:`CPU` otherwise.

    Groups: every divisor ≥ 2 of ``gpus_per_node`` that divides the world (consecutive ranks:
    ``Machine.intra``) and, with several nodes, one rank per node (``Machine.inter``). The
    calibration is :data:`DEFAULT_MACHINE`'s; an op measured in no group (one
    rank) keeps its links.
    """
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    cuda = device.type == "cuda"
    sizes = sizes or (GPU if cuda else CPU)
    world = dist.get_world_size()
    per_node = gpus_per_node or (min(torch.cuda.device_count(), world) if cuda else world)
    if world % per_node:
        raise ValueError(
            f"gpus_per_node={per_node} does not divide the world of {world} ranks; pass the ranks each node runs"
        )
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
        group, _ = dist.new_subgroups_by_enumeration(
            [[i + n * per_node for n in range(nodes)] for i in range(per_node)]
        )
        inter = _links(_rates_then_destroy(device, group, nodes, sizes))
    memory = (
        torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else DEFAULT_MACHINE.memory_GiB
    )
    return replace(
        DEFAULT_MACHINE,
        matmul_tflops=matmul,
        hbm_GBps=copy,
        gpus_per_node=per_node,
        memory_GiB=memory,
        intra={op: table or DEFAULT_MACHINE.intra[op] for op, table in intra.items()},
        inter=inter,
    )
