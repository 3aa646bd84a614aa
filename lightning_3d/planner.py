"""Cost model: step time and memory per GPU of a GPT block stack on every 3-D grid and under 1-D
tensor parallelism, and of the whole training step on every 3-D grid (:func:`predict_job`), from
the model's shape and the machine's measured rates (:mod:`lightning_3d.machine`); picks the best grid.

The model counts, per rank and per layer, the GEMM and attention FLOPs, the bytes of the
memory-bound ops, and the bytes every collective moves, and prices them with the machine's
measured matmul rate, memory bandwidth and per-group-size collective bandwidth and latency. It
then charges only the communication the implementation cannot hide:

- 3-D forward: the input all-gather and the output reduce-scatter of each product; the weight
  all-gather is prefetched products ahead (:class:`~lightning_3d.ops.prefetch.WeightPrefetch`)
  and costs only what the product's own time does not cover (all of it for the first product of a step).
- 3-D backward: the gradient all-gather; the larger of the two reduce-scatters hides behind the
  other product, the smaller is exposed; when gathered operands are not saved, the activation's
  re-gather, and the weight's as far as the previous product's backward does not cover it (prefetched).
- With ``async_tp`` (collective matmuls, :mod:`~lightning_3d.ops.async_tp`): a fused gather or
  scatter exposes only its copies' excess over the product's other blocks and a fixed cost per
  product (barriers, skew); dC's gather fuses into dA's product, or dA's scatter into its own.
- 1-D (Megatron, DTensor Colwise/Rowwise): two all-reduces of the activations per block in
  forward and two in backward, none hidden; LayerNorms and residuals run replicated on every rank.
- Data parallelism: one all-reduce of the gradients after backward (the whole job: DDP's fp32
  buckets beside backward, charged where backward does not cover them).
- ``grads_at_end`` (whole job): a fitted share of the weight gradients' reduce-scatters comes off
  the step (:attr:`Machine.late_scatter_fraction`).

Ranks are placed dp-major then x, y, z (z fastest), as :func:`~lightning_3d.grid.init_grid` does,
and numbered node by node, as launchers number them: :func:`node_axes` derives from that order
which axes' groups span nodes, and a collective over such a group is priced with the inter-node
link (``Machine.inter``), any other with the NVLink of its group size (``Machine.intra``).

``best_grid(...)`` is what ``grid="auto"`` calls once the model's shape is known.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from .grid import axes_across_nodes

BYTES = 2  # bf16 activations, weights and gradients
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
        memory_GiB: memory per GPU, for :func:`fits`.
        gemm_efficiency: fraction of ``matmul_tflops`` the model's GEMMs and attention reach.
        passes_fwd, passes_bwd: memory-bound traffic per layer, in bytes per element of the
            local ``[tokens, hidden]`` activation (norms, residuals, GELU, copies, loss).
        replicated_passes: the part of that traffic 1-D TP runs on the whole activation on every
            rank (LayerNorms, residual adds: not split by TP).
        overhead_ms: fixed cost per layer and step (launches, small kernels, synchronisation).
        overlap_cost: fraction of a hidden collective's time still paid by the compute it
            overlaps (NCCL's SMs and memory traffic slow the GEMM; fitted: 0.4).
        peer_overhead_ms: per layer and step, the DTensor peer's dispatch cost not hidden
            behind its kernels (``predict_1d(..., anchor=True)``).
        pipeline_us: what a collective matmul (``async_tp``) exposes besides its copies' excess
            over the product: its barriers and the ranks' skew, µs per product (fitted).
        job_gemm_efficiency: ``gemm_efficiency`` of the blocks in the whole training job
            (:func:`predict_job`: fp32 master weights under autocast, sustained clocks).
        compiled_job_gemm_efficiency: the same with compiled blocks (each one graph, its
            elementwise work fused around the products).
        eager_gated_passes: ``passes_fwd, passes_bwd`` added to gated (Llama-style: SwiGLU,
            RMSNorm, rotary embedding) blocks run eagerly; compiled blocks fuse them away.
        compiled_passes: ``passes_fwd, passes_bwd`` of blocks run through ``torch.compile``.
        activation_fraction: the share of the activations an eager block keeps for backward that
            a block keeps (1 eagerly; :func:`predict_job` uses ``compiled_activation_fraction`` for
            compiled blocks, whose graphs recompute elementwise results instead of keeping them; fitted).
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
    replicated_passes: float = 10.0
    overhead_ms: float = 0.05
    overlap_cost: float = 0.4
    peer_overhead_ms: float = 1.5
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

        return {"matmul_tflops": self.matmul_tflops, "hbm_GBps": self.hbm_GBps, "gpus_per_node": self.gpus_per_node,
                "memory_GiB": self.memory_GiB, "intra": {op: {str(g): as_dict(link) for g, link in sorted(t.items())} for op, t in self.intra.items()},
                "inter": {op: as_dict(link) for op, link in self.inter.items()}}

    @classmethod
    def from_rates(cls, rates: dict) -> Machine:
        """The inverse of :meth:`rates`, with :data:`DEFAULT_MACHINE`'s calibration (and its links for an
        op measured in no group, as on one GPU)."""
        return replace(DEFAULT_MACHINE, matmul_tflops=rates["matmul_tflops"], hbm_GBps=rates["hbm_GBps"],
                       gpus_per_node=rates["gpus_per_node"], memory_GiB=rates["memory_GiB"],
                       intra={op: {int(g): Link(**v) for g, v in t.items()} or DEFAULT_MACHINE.intra[op] for op, t in rates["intra"].items()},
                       inter={op: Link(**v) for op, v in rates["inter"].items()})

    @classmethod
    def from_bench(cls, hardware: dict, **overrides) -> Machine:
        """From the ``hardware`` block of ``benchmarks/bench_gpt.py``'s JSON (inter-node links: defaults)."""
        intra = {op: dict(DEFAULT_MACHINE.intra[op]) for op in OPS}
        for g, ops in hardware.get("collectives", {}).items():
            for op, v in ops.items():
                intra[op][int(g)] = Link(v["busbw_GBps"], v["latency_us"])
        return replace(DEFAULT_MACHINE, matmul_tflops=hardware["matmul_tflops"], hbm_GBps=hardware["copy_GBps"], intra=intra, **overrides)


# H200 SXM ×4 measured by benchmarks/bench_gpt.py (docs/benchmarks.md, run 5: latency of bursts of
# small collectives); 8 ranks: the bus bandwidth of a 1 GiB all-reduce on an 8×H100 NVLink host
# (360 GB/s) with an assumed 40 µs; inter-node: an assumed 400 Gb/s NIC per GPU (≈45 GB/s bus
# bandwidth, 20 µs), not measured.
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
class ModelShape:
    """A stack of ``layers`` GPT blocks (fused q/k/v, then an MLP of ``ffn`` hidden units) on
    ``batch`` sequences of ``seq`` tokens: the global batch of one step. ``kv_heads`` (default
    ``heads``) below ``heads`` is grouped-query attention; ``gated`` is a SwiGLU MLP (gate and up).
    ``vocab`` (tokens of an untied embedding and LM head) makes it a whole model: :func:`predict_job`
    prices its training step, and :func:`best_grid` ranks grids by that."""

    hidden: int
    heads: int
    seq: int
    batch: int
    layers: int
    ffn: int | None = None
    kv_heads: int | None = None
    gated: bool = False
    vocab: int | None = None

    @property
    def ffn_hidden(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def kv_width(self) -> int:
        """Features of k (and of v): key/value heads × head dim."""
        return (self.kv_heads if self.kv_heads is not None else self.heads) * (self.hidden // self.heads)

    @property
    def qkv_out(self) -> int:
        return self.hidden + 2 * self.kv_width

    @property
    def fc1_out(self) -> int:
        return self.ffn_hidden * (2 if self.gated else 1)

    @property
    def block_weights(self) -> int:
        """Matmul weights of one block: q/k/v, the attention projection, the MLP's two."""
        h = self.hidden
        return h * self.qkv_out + h * h + h * self.fc1_out + self.ffn_hidden * h

    @property
    def params(self) -> int:
        """Parameters that train: the blocks' matmul weights, and with ``vocab`` the embedding and LM head
        (norms, biases and learned positions are under 0.5% of these)."""
        return self.layers * self.block_weights + 2 * (self.vocab or 0) * self.hidden

    @property
    def flops(self) -> float:
        """Forward + backward FLOPs of a step (3 × the forward's GEMMs and attention scores)."""
        h, b, s = self.hidden, self.batch, self.seq
        return 3 * self.layers * (2 * b * s * self.block_weights + 4 * b * s * s * h)


@dataclass
class Prediction:
    """Predicted cost of one layout of the ranks (times in ms, memory in GiB per GPU)."""

    method: str  # "3d" or "1d"
    grid: tuple[int, int, int]  # (px, py, pz); (tp, 1, 1) for 1-D
    dp: int
    fwd_ms: float
    bwd_ms: float
    comm_ms: float  # every collective, hidden or not
    exposed_comm_ms: float
    memory_GiB: float
    detail: dict = field(default_factory=dict)

    @property
    def step_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def label(self) -> str:
        where = f"TP={self.grid[0]}" if self.method == "1d" else "×".join(map(str, self.grid))
        return where + (f" dp{self.dp}" if self.dp > 1 else "")


# ------------------------------------------------------------------ feasibility


def grid_error(shape: ModelShape, grid: tuple[int, int, int], dp: int) -> str | None:
    """Why ``shape`` cannot run on ``grid`` with ``dp`` replicas, or None."""
    px, py, pz = grid
    h, f = shape.hidden, shape.ffn_hidden
    if shape.batch % dp:
        return f"batch {shape.batch} % dp {dp}"
    b = shape.batch // dp
    grouped = shape.kv_heads not in (None, shape.heads)
    heads = [(shape.kv_heads, py, "kv_heads % py"), (shape.kv_width, px * py, "kv width % px·py")] if grouped else [(shape.heads, py, "heads % py")]
    checks = heads + [(h, px * py, "hidden % px·py"), (h, px * pz, "hidden % px·pz"),
                      (f, px * py, "ffn % px·py"), (f, py, "ffn % py"), (b, px * py, "batch/dp % px·py"), (b, px * pz, "batch/dp % px·pz")]
    for value, parts, what in checks:
        if value % parts:
            return what
    return None


def node_axes(grid: tuple[int, int, int], dp: int, machine: Machine = None) -> tuple[str, ...]:
    """The axes (``"dp"``, ``"x"``, ``"y"``, ``"z"``) whose groups span nodes of ``machine.gpus_per_node``
    GPUs, for ranks laid out as :func:`~lightning_3d.init_grid` lays them and numbered node by node."""
    gpus = (machine or DEFAULT_MACHINE).gpus_per_node
    return axes_across_nodes((dp, *grid), [r // gpus for r in range(dp * math.prod(grid))])


# ------------------------------------------------------------------ 3-D


class _Collectives:
    """Seconds of the collectives of ``grid`` × ``dp`` ranks on ``machine``, by axis (``"x"``, ``"y"``, ``"z"``, ``"dp"``)."""

    def __init__(self, grid: tuple[int, int, int], dp: int, machine: Machine):
        px, py, pz = grid
        self.machine = machine
        self.sizes = {"x": px, "y": py, "z": pz, "dp": dp}
        self.across = node_axes(grid, dp, machine)

    def seconds(self, op: str, axis: str, full_elements: float, element_bytes: int = BYTES) -> float:
        """``op`` over ``axis`` whose gathered (or pre-scatter) tensor has ``full_elements``."""
        g = self.sizes[axis]
        if g == 1:
            return 0.0
        moved = full_elements * element_bytes * (g - 1) / g * (2 if op == "all_reduce" else 1)
        return self.machine.link(op, g, axis in self.across).seconds(moved)


def _product(c: _Collectives, tokens: float, r: str, fa: str, n: int, k: int, rate: float, save_gathered: bool,
             async_tp: bool) -> tuple[float, float, float, float, float]:
    """One 3-D product ``[tokens, n] @ [n, k]`` whose input is split over ``r`` and features over ``fa``:
    seconds of its forward GEMM, of the communication forward and backward expose, of all its
    communication, and of its weight gradient's reduce-scatter over x."""
    m, sizes = c.machine, c.sizes
    px = sizes["x"]

    def exposed(t_coll: float, axis: str, t_mm: float) -> float:
        """What a gather or scatter over ``axis`` next to a product of ``t_mm`` exposes: all of it,
        or as a collective matmul its copies' excess over the product's other blocks and its barriers."""
        g = sizes[axis]
        if not async_tp or g == 1:
            return t_coll
        return max(0.0, t_coll - t_mm * (g - 1) / g) + m.pipeline_us * 1e-6

    a_full = tokens / px * n / sizes[fa]  # A gathered over r
    w_full = k / sizes[r] * n / sizes[fa]  # W gathered over x
    c_full = tokens / px * k / sizes[r]  # C before the reduce-scatter over f
    t_mm = 2 * a_full * k / sizes[r] / rate
    ag_a, ag_w, rs_c = c.seconds("all_gather", r, a_full), c.seconds("all_gather", "x", w_full), c.seconds("reduce_scatter", fa, c_full)
    ag_dc, rs_da, rs_dw = c.seconds("all_gather", fa, c_full), c.seconds("reduce_scatter", r, a_full), c.seconds("reduce_scatter", "x", w_full)
    # backward re-gathers A where it did not keep it; W's re-gather is prefetched behind the previous product's backward
    regather = 0.0 if save_gathered else max(ag_a, max(0.0, ag_w - 2 * t_mm))
    comm = ag_a + ag_w + rs_c + ag_dc + rs_da + rs_dw + (0.0 if save_gathered else ag_a + ag_w)
    # forward: the gather of A is fused with the product where r > 1, else the scatter of C
    fused_ag = async_tp and sizes[r] > 1
    fwd = exposed(ag_a, r, t_mm) + max(0.0, ag_w - t_mm) + (rs_c if fused_ag else exposed(rs_c, fa, t_mm))
    if async_tp and sizes[fa] > 1:  # dC's gather fused into dA's product; dA's scatter hides behind dW's
        bwd = max(exposed(ag_dc, fa, t_mm), regather) + max(0.0, rs_da - t_mm) + rs_dw
    elif async_tp and sizes[r] > 1:  # dA's scatter fused; dW's hides behind it when dW runs first
        bwd = max(ag_dc, regather) + exposed(rs_da, r, t_mm) + (max(0.0, rs_dw - t_mm) if rs_dw >= rs_da else rs_dw)
    else:  # the larger scatter hides behind the other product, the smaller is exposed
        larger, smaller = max(rs_da, rs_dw), min(rs_da, rs_dw)
        bwd = max(ag_dc, regather) + max(0.0, larger - t_mm) + smaller
    return t_mm, fwd, bwd, comm, rs_dw


def predict_3d(shape: ModelShape, grid: tuple[int, int, int], dp: int = 1, machine: Machine = None,
               save_gathered: bool = True, async_tp: bool = False) -> Prediction:
    """Predicted step of ``shape``'s block stack on ``grid`` with ``dp`` replicas (weight prefetch on);
    with ``async_tp``, the activation gathers and scatters next to a product run as collective matmuls."""
    m = machine or DEFAULT_MACHINE
    px, py, pz = grid
    cube = px * py * pz
    c = _Collectives(grid, dp, m)
    across = c.across
    h, f, L = shape.hidden, shape.ffn_hidden, shape.layers
    tokens = shape.batch * shape.seq / dp  # per replica

    rate = m.matmul_tflops * 1e12 * m.gemm_efficiency
    # the four products of a block: (input axis r, feature axis f, in N, out K)
    products = [("y", "z", h, shape.qkv_out), ("z", "y", h, h), ("y", "z", h, shape.fc1_out), ("z", "y", f, h)]
    fwd_exposed = bwd_exposed = comm = weight_scatters = 0.0
    mm_fwd = []
    for r, fa, n, k in products:
        t_mm, fwd_p, bwd_p, comm_p, rs_dw = _product(c, tokens, r, fa, n, k, rate, save_gathered, async_tp)
        mm_fwd.append(t_mm)
        comm += comm_p
        fwd_exposed += fwd_p
        bwd_exposed += bwd_p
        weight_scatters += L * rs_dw
    fwd_exposed = fwd_exposed * L + c.seconds("all_gather", "x", products[0][3] / py * h / pz)  # first weight of the step
    bwd_exposed *= L
    # latency-bound all-reduces: the biases' gradients (replicated over x and the feature axis),
    # the norms' (over x and y), and with pz > 1 the norms' statistics (4 in forward, 2 in backward)
    latency = m.link("all_reduce", cube, any(a in across for a in "xyz")).latency_us * 1e-6
    grad_reductions = 4 * (px > 1) + 2 * (px * py > 1)
    bwd_exposed += L * (grad_reductions + 2 * (pz > 1)) * latency
    fwd_exposed += L * 4 * (pz > 1) * latency
    comm += (grad_reductions + 6 * (pz > 1)) * latency

    local = tokens * h / cube  # elements of a local [tokens, hidden] activation
    ln_extra = 8.0 if pz > 1 else 0.0  # the distributed normalize's fp32 passes against the fused kernel
    regroup = 3.0 if px > 1 else 0.0  # q, k, v copied into head order after the x gather
    hbm = m.hbm_GBps * 1e9
    t_mem_fwd = local * BYTES * (m.passes_fwd + ln_extra + regroup) / hbm
    t_mem_bwd = local * BYTES * (m.passes_bwd + 1.5 * ln_extra + regroup) / hbm
    attn = 4 * shape.batch / dp * shape.seq**2 * h / cube / rate
    comm *= L
    hidden = max(0.0, comm - fwd_exposed - bwd_exposed)
    fwd = L * (sum(mm_fwd) + attn + t_mem_fwd) + fwd_exposed + m.overlap_cost * hidden / 2
    bwd = L * (2 * (sum(mm_fwd) + attn) + t_mem_bwd) + bwd_exposed + m.overlap_cost * hidden / 2
    dp_sync = _dp_all_reduce(m, shape, cube, dp, "dp" in across)
    bwd += dp_sync + L * m.overhead_ms * 1e-3

    weights = L * shape.block_weights
    gathered = (lambda by: by) if save_gathered else (lambda by: 1)
    saved_w = weights / (py * pz) if save_gathered and px > 1 else 0.0  # gathered copies kept for backward
    norm_saved = 2 + (5 if pz > 1 else 0)  # the distributed normalize keeps fp32 x̂, rstd and the affine inputs
    act = m.activation_fraction * L * tokens * h / cube * (norm_saved + (shape.qkv_out + h) / h + shape.fc1_out / h  # norms, q/k/v and attention out, MLP input
                                   + 2 * gathered(py)  # qkv and fc1 inputs (gathered over y)
                                   + (1 + f / h) * gathered(pz))  # proj and fc2 inputs (gathered over z)
    transient = tokens * h / cube * 5  # the input block and the loss's fp32 copies
    memory = _peak(weights / cube, saved_w + act + transient, L)
    return Prediction("3d", grid, dp, fwd * 1e3, bwd * 1e3, (comm + dp_sync) * 1e3, (fwd_exposed + bwd_exposed + dp_sync) * 1e3,
                      memory, {"dp_sync_ms": dp_sync * 1e3, "hidden_comm_ms": hidden * 1e3, "weight_scatter_ms": weight_scatters * 1e3,
                               "backward_compute_ms": L * (2 * (sum(mm_fwd) + attn) + t_mem_bwd) * 1e3,
                               "activations_GiB": (saved_w + act + transient) * BYTES / 2**30})


def _peak(params: float, saved: float, layers: int) -> float:
    """GiB during the last layer's backward (parameters, everything saved, about half a layer's
    gradients) or at the end of backward (parameters and all gradients), whichever is more."""
    return max(params + saved + params / (2 * layers), 2 * params) * BYTES / 2**30


def _dp_all_reduce(m: Machine, shape: ModelShape, model_parallel: int, dp: int, spans_nodes: bool) -> float:
    if dp == 1:
        return 0.0
    grads = shape.layers * shape.block_weights / model_parallel
    link = m.link("all_reduce", dp, spans_nodes)
    return link.seconds(grads * BYTES * 2 * (dp - 1) / dp)


# ------------------------------------------------------------------ the whole training job

FP32 = 4  # master weights, their gradients, Adam's moments, embedding outputs, loss arithmetic


def predict_job(shape: ModelShape, grid: tuple[int, int, int], dp: int = 1, machine: Machine = None, *,
                async_tp: bool = False, compiled: bool = False, save_gathered: bool = True, half_grads: bool = False,
                grads_at_end: bool = False) -> Prediction:
    """Predicted whole training step of ``shape`` (``vocab`` required) on ``grid`` with ``dp`` replicas,
    as ``Tensor3DStrategy`` trains it under bf16 mixed precision with fp32 master weights.

    The step is :func:`predict_3d`'s blocks (``compiled``: with :attr:`Machine.compiled_passes`) and
    the embedding lookup (fp32 weight ``[V/py, h/pz]`` gathered over x, output scattered over y), the
    final norm, the LM head as a 3-D product (weight ``[V, h]``, z→y), the cross-entropy over the fp32
    logits ``[tokens/(px·pz), V/py]`` with its three small all-reduces, the fp32 gradient all-reduce
    over dp (bf16 with ``half_grads``; DDP's buckets overlap the blocks' backward: only the rest is charged), the
    gradient-norm all-reduce, clipping, AdamW and the weight casts; never less than the host takes to
    issue the step (:attr:`Machine.host_layer_ms`). ``grads_at_end`` (``RuntimeOptions.grads_at_end``)
    takes :attr:`Machine.late_scatter_fraction` of the weight gradients' reduce-scatters (at most of
    the blocks' backward compute) off the step and, where px > 1, leaves the whole dp reduction after backward (those gradients reach DDP's
    buckets at its end). Memory: the fp32 parameters and
    Adam's two moments of each shard (and DDP's gradient buckets with dp > 1), the bf16 weight
    copies autocast keeps, the activations, and the logits at the loss.
    """
    if shape.vocab is None:
        raise ValueError(f"predict_job needs the vocabulary: ModelShape(..., vocab=V) (the tokens of the embedding and LM head); "
                         f"{shape} prices the block stack only (predict_3d)")
    m = machine or DEFAULT_MACHINE
    px, py, pz = grid
    cube = px * py * pz
    h, V = shape.hidden, shape.vocab
    passes = m.compiled_passes if compiled else (m.passes_fwd + m.eager_gated_passes[0] * shape.gated,
                                                  m.passes_bwd + m.eager_gated_passes[1] * shape.gated)
    efficiency = m.compiled_job_gemm_efficiency if compiled else m.job_gemm_efficiency
    activations = m.compiled_activation_fraction if compiled else m.activation_fraction
    blocks = predict_3d(shape, grid, dp, replace(m, gemm_efficiency=efficiency, passes_fwd=passes[0], passes_bwd=passes[1],
                                                 activation_fraction=activations), save_gathered, async_tp)
    c = _Collectives(grid, dp, m)
    rate, hbm = m.matmul_tflops * 1e12 * efficiency, m.hbm_GBps * 1e9
    tokens = shape.batch * shape.seq / dp  # per replica
    latency = m.link("all_reduce", cube, any(a in c.across for a in "xyz")).latency_us * 1e-6

    emb_w, emb_out = V / py * h / pz, tokens / px * h / pz
    embedding_fwd = c.seconds("all_gather", "x", emb_w, FP32) + c.seconds("reduce_scatter", "y", emb_out, FP32)
    embedding_bwd_comm = c.seconds("all_gather", "y", emb_out, FP32) + c.seconds("reduce_scatter", "x", emb_w, FP32)
    embedding_bwd = embedding_bwd_comm + 2 * emb_w * FP32 / hbm  # the zeroed gradient block, written and scattered into
    t_head, head_fwd, head_bwd, head_comm, head_scatter = _product(c, tokens, "z", "y", h, V, rate, save_gathered, async_tp)
    logits = tokens * V / cube
    loss = logits * m.logit_bytes / hbm + (2 * (py > 1) + (px * pz > 1)) * latency  # row max and sums over y, the totals over x·z
    final_norm = tokens * h / cube * BYTES * (m.passes_fwd + m.passes_bwd) / shape.layers / hbm

    params = shape.params / cube
    optimizer = params * m.optimizer_bytes / hbm + (cube * dp > 1) * latency  # the global norm's all-reduce
    ddp = m.link("all_reduce", dp, "dp" in c.across)
    ddp = replace(ddp, busbw_GBps=min(ddp.busbw_GBps, m.dp_busbw_GBps))
    dp_sync = ddp.seconds(params * (BYTES if half_grads else FP32) * 2 * (dp - 1) / dp) if dp > 1 else 0.0
    # weight gradients handed on at the end of backward (gathered over x) reach DDP's buckets only then
    dp_hidden = 0.0 if grads_at_end and px > 1 else m.dp_overlap * blocks.detail["backward_compute_ms"] * 1e-3
    dp_exposed = max(0.0, dp_sync - dp_hidden)

    fwd = blocks.fwd_ms * 1e-3 + embedding_fwd + t_head + head_fwd + final_norm / 2 + loss / 2
    bwd = ((blocks.bwd_ms - blocks.detail["dp_sync_ms"]) * 1e-3 + embedding_bwd + 2 * t_head + head_bwd + final_norm / 2
           + loss / 2 + dp_exposed + optimizer)
    late = 0.0
    if grads_at_end:  # the weight gradients' reduce-scatters newly hide behind the blocks' backward compute, at most
        scatters = blocks.detail["weight_scatter_ms"] * 1e-3 + head_scatter
        late = m.late_scatter_fraction * min(scatters, blocks.detail["backward_compute_ms"] * 1e-3)
    bwd -= late
    pipelined = async_tp and py * pz > 1  # collective matmuls need an activation axis
    collectives = 8 * sum(p > 1 for p in grid)  # per layer: 4 products, each a gather and a scatter per split axis
    host = shape.layers * (m.host_layer_ms[2 if compiled else 1 if pipelined else 0] + collectives * m.collective_host_us * 1e-3) * 1e-3
    bwd += max(0.0, host - fwd - bwd)  # the GPU waits for the host
    static = params * (3 * FP32 + (m.ddp_bytes if dp > 1 else 0)) + shape.layers * shape.block_weights / cube * BYTES
    memory = static / 2**30 + blocks.detail["activations_GiB"] + logits * m.logit_memory_bytes / 2**30
    exposed = blocks.exposed_comm_ms - blocks.detail["dp_sync_ms"] + (embedding_fwd + embedding_bwd_comm + head_fwd + head_bwd + dp_exposed - late) * 1e3
    detail = {"blocks_ms": blocks.step_ms - blocks.detail["dp_sync_ms"], "embedding_ms": (embedding_fwd + embedding_bwd) * 1e3,
              "head_ms": (3 * t_head + head_fwd + head_bwd) * 1e3, "loss_ms": loss * 1e3, "optimizer_ms": optimizer * 1e3,
              "dp_sync_ms": dp_sync * 1e3, "dp_exposed_ms": dp_exposed * 1e3}
    comm = blocks.comm_ms - blocks.detail["dp_sync_ms"] + (embedding_fwd + embedding_bwd_comm + head_comm + dp_sync) * 1e3
    return Prediction("3d", grid, dp, fwd * 1e3, bwd * 1e3, comm, exposed, memory, detail)


# ------------------------------------------------------------------ 1-D


def predict_1d(shape: ModelShape, tp: int, dp: int = 1, machine: Machine = None, anchor: bool = False) -> Prediction:
    """Predicted step of ``shape`` under Megatron 1-D TP over ``tp`` ranks with ``dp`` replicas.

    ``anchor=True`` models the measured peer (``benchmarks/peer.py``): separate q, k, v
    projections (three backward all-reduces instead of one) and DTensor's dispatch overhead.
    """
    m = machine or DEFAULT_MACHINE
    h, f, L = shape.hidden, shape.ffn_hidden, shape.layers
    tokens = shape.batch * shape.seq / dp
    across = node_axes((tp, 1, 1), dp, m)
    rate = m.matmul_tflops * 1e12 * m.gemm_efficiency
    mm = 2 * tokens * shape.block_weights / tp / rate
    attn = 4 * shape.batch / dp * shape.seq**2 * h / tp / rate
    full = tokens * h
    hbm = m.hbm_GBps * 1e9
    rep, rest = m.replicated_passes, (m.passes_fwd - m.replicated_passes)
    t_mem_fwd = full * BYTES * (rep + (rest / tp if tp > 1 else rest)) / hbm
    t_mem_bwd = full * BYTES * (1.5 * rep + (m.passes_bwd - 1.5 * rep) / tp) / hbm
    ar = 0.0
    if tp > 1:
        ar = m.link("all_reduce", tp, "x" in across).seconds(full * BYTES * 2 * (tp - 1) / tp)
    dp_sync = _dp_all_reduce(m, shape, tp, dp, "dp" in across)
    bwd_ars = 4 if anchor and tp > 1 else 2
    overhead = (m.peer_overhead_ms if anchor and tp > 1 else m.overhead_ms) * 1e-3
    fwd = L * (mm + attn + t_mem_fwd + 2 * ar)
    bwd = L * (2 * (mm + attn) + t_mem_bwd + bwd_ars * ar + overhead) + dp_sync
    params = L * shape.block_weights / tp
    act = L * (full * 4 + full / tp * (4 + 1 + 2 * f / h))  # replicated: norm inputs and outputs
    transient = full * 5  # the input and the loss's fp32 copies, whole on every rank
    memory = _peak(params, act + transient, L)
    comm = L * (2 + bwd_ars) * ar + dp_sync
    return Prediction("1d", (tp, 1, 1), dp, fwd * 1e3, bwd * 1e3, comm * 1e3, comm * 1e3, memory, {"dp_sync_ms": dp_sync * 1e3})


# ------------------------------------------------------------------ choice


def cube_grids(n: int) -> list[tuple[int, int, int]]:
    """Every ``(px, py, pz)`` with ``px·py·pz == n``."""
    return [(px, py, n // (px * py)) for px in range(1, n + 1) if n % px == 0
            for py in range(1, n // px + 1) if (n // px) % py == 0]


def candidates(shape: ModelShape, world: int, machine: Machine = None, include_1d: bool = True,
               async_tp: bool = False, compiled: bool = False, half_grads: bool = False,
               grads_at_end: bool = False) -> list[Prediction]:
    """Every feasible 3-D grid (any cube size dividing ``world``, dp filling the rest; with
    ``async_tp`` as collective matmuls, on cubes inside one node only) and, with ``include_1d``,
    every 1-D TP size up to a node with dp, sorted by predicted step time. With ``shape.vocab`` the
    3-D grids are priced as whole training steps (:func:`predict_job`, blocks ``compiled`` or not,
    the gradient reduction over dp in bf16 with ``half_grads``, the weight gradients handed on at the
    end of backward with ``grads_at_end``) and no 1-D layout is offered (its model prices block
    stacks only)."""
    m = machine or DEFAULT_MACHINE
    out = []
    for cube in (c for c in range(1, world + 1) if world % c == 0):
        if async_tp and m.gpus_per_node % cube and world > m.gpus_per_node:
            continue  # collective matmuls need every cube inside one node (its NVLink domain)
        for grid in cube_grids(cube):
            if grid_error(shape, grid, world // cube) is None:
                if shape.vocab is None:
                    out.append(predict_3d(shape, grid, world // cube, m, async_tp=async_tp))
                else:
                    out.append(predict_job(shape, grid, world // cube, m, async_tp=async_tp, compiled=compiled,
                                           half_grads=half_grads, grads_at_end=grads_at_end))
    if include_1d and shape.vocab is None:
        for tp in (t for t in range(1, min(world, m.gpus_per_node) + 1) if world % t == 0):
            kv_heads = shape.kv_heads if shape.kv_heads is not None else shape.heads
            if kv_heads % tp == 0 and shape.batch % (world // tp) == 0:
                out.append(predict_1d(shape, tp, world // tp, m))
    return sorted(out, key=lambda p: p.step_ms)


def fits(p: Prediction, machine: Machine = None) -> bool:
    return p.memory_GiB <= (machine or DEFAULT_MACHINE).memory_GiB


def best_grid(hidden: int, heads: int, seq: int, batch: int, layers: int, world: int,
              machine: Machine = None, ffn: int | None = None, async_tp: bool = False,
              kv_heads: int | None = None, gated: bool = False, vocab: int | None = None,
              compiled: bool = False, half_grads: bool = False, grads_at_end: bool = False) -> tuple[int, int, int]:
    """The ``(px, py, pz)`` with the lowest predicted step time that fits in memory (dp = world /
    px·py·pz); the model is the global-batch GPT stack of ``hidden``, ``heads``, ``seq``, ``batch``
    and ``layers`` (``ffn``, ``kv_heads``, ``gated`` and ``vocab`` as :class:`ModelShape`: with
    ``vocab``, the whole training step of :func:`predict_job`, its blocks ``compiled`` or not, its
    gradient reduction over dp in bf16 with ``half_grads``, its weight gradients handed on at the end
    of backward with ``grads_at_end``), its products collective matmuls with ``async_tp``. This is
    what ``grid="auto"`` uses when the model's shape is known.

    Raises:
        ValueError: no grid divides the shape, or none fits in memory.
    """
    m = machine or DEFAULT_MACHINE
    shape = ModelShape(hidden, heads, seq, batch, layers, ffn, kv_heads, gated, vocab)
    options = candidates(shape, world, m, include_1d=False, async_tp=async_tp, compiled=compiled, half_grads=half_grads,
                         grads_at_end=grads_at_end)
    if not options:
        raise ValueError(f"no px·py·pz grid with dp filling {world} ranks divides hidden={hidden}, heads={heads}, batch={batch}; "
                         f"use a batch that is a multiple of {world} and heads/hidden divisible by the grid")
    fitting = [p for p in options if fits(p, m)]
    if not fitting:
        least = min(options, key=lambda p: p.memory_GiB)
        raise ValueError(f"no grid fits {m.memory_GiB:.0f} GiB per GPU: the least, {least.label}, needs {least.memory_GiB:.1f} GiB; "
                         f"use more GPUs, a smaller batch or activation checkpointing")
    return fitting[0].grid


def scaling_candidates(world: int) -> list[tuple[tuple[int, int, int], int]]:
    """``(grid, dp)`` pairs of powers of two with ``px·py·pz·dp == world``."""
    k = int(math.log2(world))
    out = []
    for a, b, c in itertools.product(range(k + 1), repeat=3):
        if a + b + c <= k:
            out.append(((2**a, 2**b, 2**c), 2 ** (k - a - b - c)))
    return out
