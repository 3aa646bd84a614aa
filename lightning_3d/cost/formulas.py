"""The cost model's formulas: step time, memory and bytes sent per rank of a GPT training step on a
3-D grid, from the model's shape and a :class:`~lightning_3d.cost.machine.Machine`'s rates.

The model counts, per rank and per layer, the GEMM and attention FLOPs, the bytes of the
memory-bound ops, and the bytes every collective moves, and prices them with the machine's
measured matmul rate, memory bandwidth and per-group-size collective bandwidth and latency. It
then charges only the communication the implementation cannot hide:

- 3-D forward: the input all-gather and the output reduce-scatter of each product; the weight
  all-gather is prefetched products ahead (:class:`~lightning_3d.runtime.WeightPrefetch`)
  and costs only what the product's own time does not cover (all of it for the first product of a step).
- 3-D backward: the gradient all-gather; the larger of the two reduce-scatters hides behind the
  other product, the smaller is exposed; when gathered operands are not saved, the activation's
  re-gather, and the weight's as far as the previous product's backward does not cover it (prefetched).
- With ``async_tp`` (collective matmuls, :mod:`~lightning_3d.ops.async_tp`): a fused gather or
  scatter exposes only its copies' excess over the product's other blocks and a fixed cost per
  product (barriers, skew); dC's gather fuses into dA's product, or dA's scatter into its own.
- Data parallelism: one all-reduce of the gradients after backward (the whole job: DDP's fp32
  buckets beside backward, charged where backward does not cover them).
- Token rows (a replica's batch not a multiple of ``lcm(px·py, px·pz)``, :mod:`lightning_3d.token_rows`):
  each layer's attention all-gathers its keys and values over the x·z plane in forward and
  reduce-scatters their gradients in backward, both exposed, and keeps the gathered ones for backward.
- ``grads_at_end`` (whole job): a fitted share of the weight gradients' reduce-scatters comes off
  the step (:attr:`Machine.late_scatter_fraction`).

Ranks are placed dp-major then x, y, z (z fastest), as :func:`~lightning_3d.grid.init_grid` does,
and numbered node by node, as launchers number them: :func:`node_axes` derives from that order
which axes' groups span nodes, and a collective over such a group is priced with the inter-node
link (``Machine.inter``), any other with the NVLink of its group size (``Machine.intra``).

:func:`sent_bytes` counts what the same formulas move, without pricing it: the bytes each rank
sends per step, by collective, which the benchmark checks against the collectives a step calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..grid import axes_across_nodes
from ..models.config import GPTConfig
from .machine import DEFAULT_MACHINE, Machine

BYTES = 2  # bf16 activations, weights and gradients


@dataclass(frozen=True)
class ModelShape:
    """A stack of ``layers`` GPT blocks (fused q/k/v, then an MLP of ``ffn`` hidden units) on
    ``batch`` sequences of ``seq`` tokens: the global batch of one step. ``kv_heads`` (default
    ``heads``) below ``heads`` is grouped-query attention; ``gated`` is a SwiGLU MLP (gate and up).
    ``vocab`` (tokens of an untied embedding and LM head) makes it a whole model: :func:`predict_job`
    prices its training step, and :func:`~lightning_3d.cost.search.best_grid` ranks grids by that.
    :meth:`of` reads it off a :class:`~lightning_3d.models.GPTConfig`."""

    hidden: int
    heads: int
    seq: int
    batch: int
    layers: int
    ffn: int | None = None
    kv_heads: int | None = None
    gated: bool = False
    vocab: int | None = None

    @classmethod
    def of(cls, config: GPTConfig, batch: int, seq: int) -> ModelShape:
        """The shape of ``config``'s model (vocabulary included) trained on ``batch`` sequences of ``seq``
        tokens a step."""
        return cls(
            config.n_embd,
            config.n_head,
            seq,
            batch,
            config.n_layer,
            config.ffn_hidden,
            kv_heads=config.n_kv_head,
            gated=config.style == "llama",
            vocab=config.vocab_size,
        )

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

    grid: tuple[int, int, int]  # (px, py, pz)
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
        return "×".join(map(str, self.grid)) + (f" dp{self.dp}" if self.dp > 1 else "")


# ------------------------------------------------------------------ feasibility


def grid_error(shape: ModelShape, grid: tuple[int, int, int], dp: int, rows: str = "auto") -> str | None:
    """Why ``shape`` cannot run on ``grid`` with ``dp`` replicas and ``rows`` (``RuntimeOptions.rows``), or None."""
    px, py, pz = grid
    h, f = shape.hidden, shape.ffn_hidden
    if shape.batch % dp:
        return f"batch {shape.batch} % dp {dp}"
    b = shape.batch // dp
    grouped = shape.kv_heads not in (None, shape.heads)
    heads = (
        [(shape.kv_heads, py, "kv_heads % py"), (shape.kv_width, px * py, "kv width % px·py")]
        if grouped
        else [(shape.heads, py, "heads % py")]
    )
    checks = heads + [
        (h, px * py, "hidden % px·py"),
        (h, px * pz, "hidden % px·pz"),
        (f, px * py, "ffn % px·py"),
        (f, py, "ffn % py"),
    ]
    if rows == "sequences":
        checks += [(b, px * py, "batch/dp % px·py"), (b, px * pz, "batch/dp % px·pz")]
    elif token_rows(shape, grid, dp, rows):  # chunks of sequences (lightning_3d.token_rows)
        checks.append((shape.seq, math.lcm(2 * px * pz, px * py), "seq % lcm(2·px·pz, px·py) (token rows)"))
    for value, parts, what in checks:
        if value % parts:
            return what
    return None


def token_rows(shape: ModelShape, grid: tuple[int, int, int], dp: int, rows: str = "auto") -> bool:
    """Whether ``grid``'s rows hold chunks of sequences, as :func:`lightning_3d.token_rows.choose_rows`
    decides with ``rows`` (``"auto"``: where a replica's batch is not a multiple of ``lcm(px·py, px·pz)``)."""
    px, py, pz = grid
    return rows == "tokens" or (rows == "auto" and (shape.batch // dp) % math.lcm(px * py, px * pz) != 0)


def _kv_gathered(shape: ModelShape, grid: tuple[int, int, int], dp: int, rows: str) -> float:
    """Elements of the keys and values a rank gathers over the x·z plane per layer on token rows
    (its y block's key/value heads of every token of the replica), else 0."""
    if not token_rows(shape, grid, dp, rows):
        return 0.0
    return 2 * shape.batch * shape.seq / dp * shape.kv_width / grid[1]


def node_axes(grid: tuple[int, int, int], dp: int, machine: Machine = None) -> tuple[str, ...]:
    """The axes (``"dp"``, ``"x"``, ``"y"``, ``"z"``) whose groups span nodes of ``machine.gpus_per_node``
    GPUs, for ranks laid out as :func:`~lightning_3d.init_grid` lays them and numbered node by node."""
    gpus = (machine or DEFAULT_MACHINE).gpus_per_node
    return axes_across_nodes((dp, *grid), [r // gpus for r in range(dp * math.prod(grid))])


# ------------------------------------------------------------------ 3-D


def _moved(op: str, g: int, full_bytes: float) -> float:
    """Bytes each rank of a group of ``g`` sends in ``op`` over a tensor of ``full_bytes`` (the gathered
    tensor, or the one reduced), as a ring moves it (NCCL's bus bytes)."""
    return full_bytes * (g - 1) / g * (2 if op == "all_reduce" else 1)


class _Collectives:
    """Seconds of the collectives of ``grid`` × ``dp`` ranks on ``machine``, by axis (``"x"``, ``"y"``,
    ``"z"``, ``"dp"``)."""

    def __init__(self, grid: tuple[int, int, int], dp: int, machine: Machine):
        px, py, pz = grid
        self.machine = machine
        self.sizes = {"x": px, "y": py, "z": pz, "dp": dp}
        self.across = node_axes(grid, dp, machine)

    def seconds(self, op: str, axis: str, full_elements: float, element_bytes: int = BYTES) -> float:
        """``op`` over ``axis`` (or a plane of cube axes, ``"xz"``) whose gathered (or pre-scatter) tensor
        has ``full_elements``."""
        axes = [axis] if axis in self.sizes else list(axis)
        g = math.prod(self.sizes[a] for a in axes)
        if g == 1:
            return 0.0
        return self.machine.link(op, g, any(a in self.across for a in axes)).seconds(
            _moved(op, g, full_elements * element_bytes)
        )


def _product_collectives(
    sizes: dict[str, int], tokens: float, r: str, fa: str, n: int, k: int, save_gathered: bool
) -> dict[str, tuple[str, str, float]]:
    """The collectives of one 3-D product ``[tokens, n] @ [n, k]`` whose input is split over ``r`` and
    features over ``fa``, forward and backward: name → (op, axis, elements of the full tensor).
    ``ag_a``, ``ag_w``, ``rs_c`` forward; ``ag_dc``, ``rs_da``, ``rs_dw`` backward; without
    ``save_gathered``, backward's re-gathers ``reag_a``, ``reag_w``."""
    a_full = tokens / sizes["x"] * n / sizes[fa]  # A gathered over r
    w_full = k / sizes[r] * n / sizes[fa]  # W gathered over x
    c_full = tokens / sizes["x"] * k / sizes[r]  # C before the reduce-scatter over f
    out = {
        "ag_a": ("all_gather", r, a_full),
        "ag_w": ("all_gather", "x", w_full),
        "rs_c": ("reduce_scatter", fa, c_full),
        "ag_dc": ("all_gather", fa, c_full),
        "rs_da": ("reduce_scatter", r, a_full),
        "rs_dw": ("reduce_scatter", "x", w_full),
    }
    if not save_gathered:
        out.update(reag_a=out["ag_a"], reag_w=out["ag_w"])
    return out


def _product(
    c: _Collectives,
    tokens: float,
    r: str,
    fa: str,
    n: int,
    k: int,
    rate: float,
    save_gathered: bool,
    async_tp: bool,
) -> tuple[float, float, float, float, float]:
    """One 3-D product ``[tokens, n] @ [n, k]`` whose input is split over ``r`` and features over ``fa``:
    seconds of its forward GEMM, of the communication forward and backward expose, of all its
    communication, and of its weight gradient's reduce-scatter over x."""
    m, sizes = c.machine, c.sizes

    def exposed(t_coll: float, axis: str, t_mm: float) -> float:
        """What a gather or scatter over ``axis`` next to a product of ``t_mm`` exposes: all of it,
        or as a collective matmul its copies' excess over the product's other blocks and its barriers."""
        g = sizes[axis]
        if not async_tp or g == 1:
            return t_coll
        return max(0.0, t_coll - t_mm * (g - 1) / g) + m.pipeline_us * 1e-6

    collectives = _product_collectives(sizes, tokens, r, fa, n, k, save_gathered)
    t = {name: c.seconds(op, axis, elements) for name, (op, axis, elements) in collectives.items()}
    ag_a, ag_w, rs_c, ag_dc, rs_da, rs_dw = (
        t[name] for name in ("ag_a", "ag_w", "rs_c", "ag_dc", "rs_da", "rs_dw")
    )
    t_mm = 2 * collectives["ag_a"][2] * k / sizes[r] / rate
    # backward re-gathers A where it did not keep it; W's re-gather is prefetched behind the previous product's backward
    regather = 0.0 if save_gathered else max(ag_a, max(0.0, ag_w - 2 * t_mm))
    comm = sum(t.values())
    # forward: the gather of A is fused with the product where r > 1, else the scatter of C
    fused_ag = async_tp and sizes[r] > 1
    fwd = exposed(ag_a, r, t_mm) + max(0.0, ag_w - t_mm) + (rs_c if fused_ag else exposed(rs_c, fa, t_mm))
    if async_tp and sizes[fa] > 1:  # dC's gather fused into dA's product; dA's scatter hides behind dW's
        bwd = max(exposed(ag_dc, fa, t_mm), regather) + max(0.0, rs_da - t_mm) + rs_dw
    elif async_tp and sizes[r] > 1:  # dA's scatter fused; dW's hides behind it when dW runs first
        bwd = (
            max(ag_dc, regather)
            + exposed(rs_da, r, t_mm)
            + (max(0.0, rs_dw - t_mm) if rs_dw >= rs_da else rs_dw)
        )
    else:  # the larger scatter hides behind the other product, the smaller is exposed
        larger, smaller = max(rs_da, rs_dw), min(rs_da, rs_dw)
        bwd = max(ag_dc, regather) + max(0.0, larger - t_mm) + smaller
    return t_mm, fwd, bwd, comm, rs_dw


def _block_products(shape: ModelShape) -> list[tuple[str, str, int, int]]:
    """The four products of a block: (input's row axis r, feature axis f, in N, out K): q/k/v, the
    attention's output, the MLP's first (gate and up) and second."""
    h = shape.hidden
    return [
        ("y", "z", h, shape.qkv_out),
        ("z", "y", h, h),
        ("y", "z", h, shape.fc1_out),
        ("z", "y", shape.ffn_hidden, h),
    ]


def _head_product(shape: ModelShape) -> tuple[str, str, int, int]:
    """The LM head as a product of the same kind: a z-layout input (the final norm's), y-layout logits."""
    return ("y", "z", shape.hidden, shape.vocab)


def predict_3d(
    shape: ModelShape,
    grid: tuple[int, int, int],
    dp: int = 1,
    machine: Machine = None,
    save_gathered: bool = True,
    async_tp: bool = False,
    rows: str = "auto",
) -> Prediction:
    """Predicted step of ``shape``'s block stack on ``grid`` with ``dp`` replicas (weight prefetch on);
    with ``async_tp``, the activation gathers and scatters next to a product run as collective matmuls;
    ``rows`` as ``RuntimeOptions.rows`` (token rows add attention's key/value gathers)."""
    m = machine or DEFAULT_MACHINE
    px, py, pz = grid
    cube = px * py * pz
    c = _Collectives(grid, dp, m)
    across = c.across
    h, f, L = shape.hidden, shape.ffn_hidden, shape.layers
    tokens = shape.batch * shape.seq / dp  # per replica

    rate = m.matmul_tflops * 1e12 * m.gemm_efficiency
    products = _block_products(shape)
    fwd_exposed = bwd_exposed = comm = weight_scatters = 0.0
    mm_fwd = []
    for r, fa, n, k in products:
        t_mm, fwd_p, bwd_p, comm_p, rs_dw = _product(c, tokens, r, fa, n, k, rate, save_gathered, async_tp)
        mm_fwd.append(t_mm)
        comm += comm_p
        fwd_exposed += fwd_p
        bwd_exposed += bwd_p
        weight_scatters += L * rs_dw
    fwd_exposed = fwd_exposed * L + c.seconds(
        "all_gather", "x", products[0][3] / py * h / pz
    )  # first weight of the step
    bwd_exposed *= L
    # token rows: attention gathers K and V over x·z in forward and reduce-scatters dK, dV in backward
    kv = _kv_gathered(shape, grid, dp, rows)
    kv_gather, kv_scatter = c.seconds("all_gather", "xz", kv), c.seconds("reduce_scatter", "xz", kv)
    fwd_exposed += L * kv_gather
    bwd_exposed += L * kv_scatter
    comm += kv_gather + kv_scatter
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
    norm_saved = 2 + (
        5 if pz > 1 else 0
    )  # the distributed normalize keeps fp32 x̂, rstd and the affine inputs
    act = (
        m.activation_fraction
        * L
        * tokens
        * h
        / cube
        * (
            norm_saved
            + (shape.qkv_out + h) / h
            + shape.fc1_out / h  # norms, q/k/v and attention out, MLP input
            + 2 * gathered(py)  # qkv and fc1 inputs (gathered over y)
            + (1 + f / h) * gathered(pz)
        )
    )  # proj and fc2 inputs (gathered over z)
    transient = tokens * h / cube * 5  # the input block and the loss's fp32 copies
    act += L * kv  # token rows: the gathered keys and values, kept for backward
    memory = _peak(weights / cube, saved_w + act + transient, L)
    return Prediction(
        grid,
        dp,
        fwd * 1e3,
        bwd * 1e3,
        (comm + dp_sync) * 1e3,
        (fwd_exposed + bwd_exposed + dp_sync) * 1e3,
        memory,
        {
            "dp_sync_ms": dp_sync * 1e3,
            "hidden_comm_ms": hidden * 1e3,
            "weight_scatter_ms": weight_scatters * 1e3,
            "backward_compute_ms": L * (2 * (sum(mm_fwd) + attn) + t_mem_bwd) * 1e3,
            "activations_GiB": (saved_w + act + transient) * BYTES / 2**30,
        },
    )


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


def predict_job(
    shape: ModelShape,
    grid: tuple[int, int, int],
    dp: int = 1,
    machine: Machine = None,
    *,
    async_tp: bool = False,
    compiled: bool = False,
    save_gathered: bool = True,
    half_grads: bool = False,
    grads_at_end: bool = False,
    rows: str = "auto",
) -> Prediction:
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
    the blocks' backward compute) off the step and, where px > 1, leaves the whole dp reduction after backward
    (those gradients reach DDP's buckets at its end). Memory: the fp32 parameters and Adam's two moments of
    each shard (and DDP's gradient buckets with dp > 1), the bf16 weight copies autocast keeps, the
    activations, and the logits at the loss.
    """
    if shape.vocab is None:
        raise ValueError(
            f"predict_job needs the vocabulary: ModelShape(..., vocab=V) (the tokens of the embedding and LM head); "
            f"{shape} prices the block stack only (predict_3d)"
        )
    m = machine or DEFAULT_MACHINE
    px, py, pz = grid
    cube = px * py * pz
    h, V = shape.hidden, shape.vocab
    passes = (
        m.compiled_passes
        if compiled
        else (
            m.passes_fwd + m.eager_gated_passes[0] * shape.gated,
            m.passes_bwd + m.eager_gated_passes[1] * shape.gated,
        )
    )
    efficiency = m.compiled_job_gemm_efficiency if compiled else m.job_gemm_efficiency
    activations = m.compiled_activation_fraction if compiled else m.activation_fraction
    blocks = predict_3d(
        shape,
        grid,
        dp,
        replace(
            m,
            gemm_efficiency=efficiency,
            passes_fwd=passes[0],
            passes_bwd=passes[1],
            activation_fraction=activations,
        ),
        save_gathered,
        async_tp,
        rows,
    )
    c = _Collectives(grid, dp, m)
    rate, hbm = m.matmul_tflops * 1e12 * efficiency, m.hbm_GBps * 1e9
    tokens = shape.batch * shape.seq / dp  # per replica
    latency = m.link("all_reduce", cube, any(a in c.across for a in "xyz")).latency_us * 1e-6

    emb_w, emb_out = V / py * h / pz, tokens / px * h / pz
    embedding_fwd = c.seconds("all_gather", "x", emb_w, FP32) + c.seconds(
        "reduce_scatter", "y", emb_out, FP32
    )
    embedding_bwd_comm = c.seconds("all_gather", "y", emb_out, FP32) + c.seconds(
        "reduce_scatter", "x", emb_w, FP32
    )
    embedding_bwd = (
        embedding_bwd_comm + 2 * emb_w * FP32 / hbm
    )  # the zeroed gradient block, written and scattered into
    t_head, head_fwd, head_bwd, head_comm, head_scatter = _product(
        c, tokens, *_head_product(shape), rate, save_gathered, async_tp
    )
    logits = tokens * V / cube
    loss = (
        logits * m.logit_bytes / hbm + (2 * (py > 1) + (px * pz > 1)) * latency
    )  # row max and sums over y, the totals over x·z
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
    bwd = (
        (blocks.bwd_ms - blocks.detail["dp_sync_ms"]) * 1e-3
        + embedding_bwd
        + 2 * t_head
        + head_bwd
        + final_norm / 2
        + loss / 2
        + dp_exposed
        + optimizer
    )
    late = 0.0
    if (
        grads_at_end
    ):  # the weight gradients' reduce-scatters newly hide behind the blocks' backward compute, at most
        scatters = blocks.detail["weight_scatter_ms"] * 1e-3 + head_scatter
        late = m.late_scatter_fraction * min(scatters, blocks.detail["backward_compute_ms"] * 1e-3)
    bwd -= late
    pipelined = async_tp and py * pz > 1  # collective matmuls need an activation axis
    collectives = 8 * sum(
        p > 1 for p in grid
    )  # per layer: 4 products, each a gather and a scatter per split axis
    host = (
        shape.layers
        * (
            m.host_layer_ms[2 if compiled else 1 if pipelined else 0]
            + collectives * m.collective_host_us * 1e-3
        )
        * 1e-3
    )
    bwd += max(0.0, host - fwd - bwd)  # the GPU waits for the host
    static = (
        params * (3 * FP32 + (m.ddp_bytes if dp > 1 else 0))
        + shape.layers * shape.block_weights / cube * BYTES
    )
    memory = static / 2**30 + blocks.detail["activations_GiB"] + logits * m.logit_memory_bytes / 2**30
    exposed = (
        blocks.exposed_comm_ms
        - blocks.detail["dp_sync_ms"]
        + (embedding_fwd + embedding_bwd_comm + head_fwd + head_bwd + dp_exposed - late) * 1e3
    )
    detail = {
        "blocks_ms": blocks.step_ms - blocks.detail["dp_sync_ms"],
        "embedding_ms": (embedding_fwd + embedding_bwd) * 1e3,
        "head_ms": (3 * t_head + head_fwd + head_bwd) * 1e3,
        "loss_ms": loss * 1e3,
        "optimizer_ms": optimizer * 1e3,
        "dp_sync_ms": dp_sync * 1e3,
        "dp_exposed_ms": dp_exposed * 1e3,
        "activations_GiB": blocks.detail["activations_GiB"],
    }
    comm = (
        blocks.comm_ms
        - blocks.detail["dp_sync_ms"]
        + (embedding_fwd + embedding_bwd_comm + head_comm + dp_sync) * 1e3
    )
    return Prediction(grid, dp, fwd * 1e3, bwd * 1e3, comm, exposed, memory, detail)


def sent_bytes(
    shape: ModelShape,
    grid: tuple[int, int, int],
    dp: int = 1,
    *,
    save_gathered: bool = True,
    element_bytes: int = BYTES,
    grad_bytes: int = FP32,
    rows: str = "auto",
) -> dict[str, float]:
    """Bytes each rank sends in one training step of ``shape`` (``vocab`` required) on ``grid`` with
    ``dp`` replicas, by collective (``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``), as
    :func:`predict_job` prices them: every block's four products and the LM head (operands of
    ``element_bytes``: bf16 under autocast, 4 in float32), the embedding's weight gather and output
    scatter and their backward (float32), and the gradient all-reduce over dp (``grad_bytes`` per
    parameter). A collective of ``g`` ranks over a tensor of ``B`` bytes sends ``B·(g−1)/g`` from
    each rank, twice that for an all-reduce (a ring). Not counted: the latency-bound all-reduces of
    a few values per token or parameter vector (norm statistics, the replicated vectors' gradients
    and the dp reduction of those vectors, the loss's sums, the gradient norm), under ``1/h`` of
    the activations' traffic."""
    if shape.vocab is None:
        raise ValueError(
            f"sent_bytes needs the vocabulary: ModelShape(..., vocab=V); {shape} is a block stack"
        )
    px, py, pz = grid
    sizes = {"x": px, "y": py, "z": pz, "dp": dp}
    tokens = shape.batch * shape.seq / dp
    h, V = shape.hidden, shape.vocab
    out = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}

    def add(op: str, axis: str, elements: float, nbytes: int, times: int = 1) -> None:
        if sizes[axis] > 1:
            out[op] += times * _moved(op, sizes[axis], elements * nbytes)

    products = [(p, shape.layers) for p in _block_products(shape)] + [(_head_product(shape), 1)]
    for (r, fa, n, k), times in products:
        for op, axis, elements in _product_collectives(sizes, tokens, r, fa, n, k, save_gathered).values():
            add(op, axis, elements, element_bytes, times)
    kv, plane = _kv_gathered(shape, grid, dp, rows), px * pz  # token rows: K and V over x·z, and dK, dV back
    if plane > 1:
        out["all_gather"] += shape.layers * _moved("all_gather", plane, kv * element_bytes)
        out["reduce_scatter"] += shape.layers * _moved("reduce_scatter", plane, kv * element_bytes)
    emb_w, emb_out = V / py * h / pz, tokens / px * h / pz
    add("all_gather", "x", emb_w, FP32)  # forward: the weight over x, the output scattered over y
    add("reduce_scatter", "y", emb_out, FP32)
    add(
        "all_gather", "y", emb_out, FP32
    )  # backward: the output's gradient over y, the weight's scattered over x
    add("reduce_scatter", "x", emb_w, FP32)
    add("all_reduce", "dp", shape.params / (px * py * pz), grad_bytes)
    return out
