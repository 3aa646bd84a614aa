"""The benchmark: the user's whole training job, 3-D tensor parallelism against torchtitan's recipes, DDP and FSDP2.

One process per GPU runs the cases it is given, in order: ``torchrun --nproc_per_node N
benchmarks/train_job.py --model gpt2-1.3b --cases "3d 4x1x1 compile;fsdp2 compile" --out DIR``.
``benchmarks/launch.py`` is how a comparison is run: each case in a process of its own, the order
rotated between repeats, then the medians and ranges (``report.py``). ``--cpu`` runs tiny models
on gloo in float32: the smoke test of CI (``tests/test_benchmarks.py``).

Every case trains the same model (one set of weights: ``DenseGPT``'s init, seed 0) on the same
data (random tokens, seed 1) with the same global batch for a fixed number of steps, each step the
whole job: forward of embedding, blocks, LM head and loss under bf16 mixed precision with float32
master weights, backward, the gradient reduction over data parallelism, clipping by the global
gradient norm (1.0) and a fused AdamW step. Cases (``--cases``, in order; ``defaults`` per GPU count):

- ``3d PXxPYxPZ [dpD] [async] [compile] [nocheck] [regather] [aheadN] [togetherN] [early]``:
  :class:`~lightning_3d.models.GPT3D` through the steps ``Tensor3DStrategy`` takes (DDP over the dp group,
  ``lightning_3d.grad_norm.clip_grad_norm_``, autocast as Lightning's ``"bf16-mixed"``), weight gathers
  prefetched where px > 1, ``async`` = ``async_tp=True``, ``compile`` = ``RuntimeOptions(compile=True)`` (each
  block and the loss's local passes compiled), ``nocheck`` = ``check_inputs=False`` (no token-range check),
  ``regather`` = ``save_gathered=False`` (gathered operands re-gathered in backward, not kept), ``aheadN`` =
  ``prefetch_depth=N`` (N weights gathered ahead, not the default four), ``togetherN`` =
  ``gathered_together=N`` (the gathers of N consecutive weights started as one collective, not the default
  four), ``early`` = ``grads_at_end=False`` (each weight gradient's reduce-scatter waited for in its product's
  backward, not once at the end; ``late``, the default, is accepted); ``3d auto [async] [compile]``: the grid
  ``grid="auto"`` picks from the model's shape. Before the options' defaults became
  ``prefetch_depth=4, gathered_together=4, grads_at_end=True``, a case without these words ran
  ``ahead2 together1 early``; result files record each case's fields.
- ``tp``, ``tp-sp`` (``compile``, ``async``): 1-D tensor parallelism over every GPU, plain or with
  sequence parallelism, each block and the loss compiled, async TP (``peers.py``: torchtitan's recipe).
- ``fsdp2`` (``compile``): FSDP2 over every GPU; ``fsdp2-tp DxT`` (``compile``): FSDP2 over D × TP+SP over T;
  either with ``noreshard``: no block's weights freed after forward (torchtitan's
  ``reshard_after_forward="never"``, ZeRO-2: no all-gather in backward, the gathered weights held).
- ``ddp`` (``compile``): plain data parallelism (one GPU: the dense model alone).

Any case may add ``ckpt``: every block recomputed in backward (ours: ``activation_checkpointing``;
the peers: torchtitan's full activation checkpointing, after TP, before compile and FSDP); and
``bf16grad``: the gradient reduction over data parallelism in bf16 (DDP's ``bf16_compress_hook``
for ours and DDP, ``reduce_dtype=bf16`` for FSDP2; the 3-D products' own reductions already run in
the autocast dtype).

Python's automatic garbage collection is off during the steps of every case, as torchtitan
trains (it collects every ``gc_freq`` steps instead): collections inside steps made compiled cases
1.3–2× slower and erratic at GPT-2 shapes. ``--profile`` adds, for the cases it names, the GPU
timeline of two more steps on rank 0 (busy time, communication, communication not hidden by
compute, the longest kernels) and, from every rank's trace, how long each rank's NCCL kernels
waited for the last rank to arrive (``peer_waits``: ranks drifting apart) against how long they
moved data, every rank's busy, idle and exposed time (``by_rank``), and the host ops that took
rank 0's host longest (``host_top_self_ms``); ``--host-profile`` adds, for the cases it names, the
Python functions that took rank 0's host longest in three more steps (``host_python_rank0``, from
cProfile). ``gpt2-narrow`` is GPT-2 1.4B's 24 layers at width 256: its GEMMs take the GPU almost no
time, so its steps measure how fast each method's host issues them. Reported per case: median step ms over the
timed steps (CUDA events, max over ranks), tokens/s, TFLOP/s per GPU and MFU against the bf16 matmul rate
measured at the start, peak memory per GPU (``max_memory_allocated`` during the steps above what was allocated
before the model was built, max over ranks), the first step's time (compilation included) and the loss of the
first three steps (mean over the global batch). Each result also lists rank 0's step times (``step_ms_each``)
and how long its host took to issue each step (``host_ms_each``; every step starts on an idle GPU, so a host
time near the step time means the host sets the pace), and each rank's median host time (``host_ms_by_rank``).
Every case is warmed up alike: built and run for one step untimed, then built again and run ``--warmup``
untimed steps before its timed ones (a case's first run in a process ran up to 1.3× slow at GPT-2 1.4B).
``--count-bytes`` adds one more step whose collectives are counted (``comm_bytes.SentBytes``): the bytes each
rank sent, by collective and group size (``sent_bytes_by_rank``), and for 3-D cases the cost model's
prediction of the same bytes (``predicted_sent_bytes``, :func:`lightning_3d.cost.sent_bytes`). Results go to
``DIR/job_w{N}_{model}[_L{layers}]_{links}.json`` after every case, so a run stopped by its time budget keeps
what it measured. ``--append`` adds this process's cases to that file (the same job only: its ``meta`` stays,
this process's date, command and matmul rate go to ``meta["appended"]``): ``launch.py`` runs one process per
case so that no case inherits another's communicators, compiled code or allocator state (cases of one process
moved each other by up to 27% at GPT-2 1.4B on 4 GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters as compile_counters
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import comm_bytes  # noqa: E402
import measure  # noqa: E402
import peers  # noqa: E402

import lightning_3d  # noqa: E402
from lightning_3d.cost import Machine, ModelShape, measure_machine, sent_bytes  # noqa: E402
from lightning_3d.grad_norm import clip_grad_norm_  # noqa: E402
from lightning_3d.models import GPT3D, DenseGPT, GPTConfig  # noqa: E402
from lightning_3d.strategy import grid_rules  # noqa: E402

DEFAULTS = lightning_3d.RuntimeOptions()

# name → (GPTConfig fields, global batch, sequence length)
MODELS = {
    "gpt2-1.3b": (dict(style="gpt2", vocab_size=50304, n_embd=2048, n_head=16, n_layer=24), 8, 2048),
    "llama-7b": (
        dict(
            style="llama", vocab_size=32000, n_embd=4096, n_head=32, n_kv_head=8, n_layer=8, ffn_hidden=11008
        ),
        8,
        2048,
    ),
    "llama-7b-mha": (
        dict(style="llama", vocab_size=32000, n_embd=4096, n_head=32, n_layer=8, ffn_hidden=11008),
        8,
        2048,
    ),
    # GPT-2 1.4B's 24 layers at a width whose GEMMs take the GPU almost no time: every step's pace is its host's
    "gpt2-narrow": (dict(style="gpt2", vocab_size=50304, n_embd=256, n_head=4, n_layer=24), 8, 2048),
    "tiny-gpt2": (dict(style="gpt2", vocab_size=128, n_embd=32, n_head=4, n_layer=2), 8, 16),
    "tiny-llama": (
        dict(style="llama", vocab_size=128, n_embd=32, n_head=8, n_kv_head=4, n_layer=2, ffn_hidden=48),
        8,
        16,
    ),
}
LR, WEIGHT_DECAY, CLIP = 3e-4, 0.1, 1.0
LOSS_STEPS = 3
RANK_TIMELINE = (
    "busy_ms",
    "idle_ms",
    "exposed_comm_ms",
    "exposed_by_collective_ms",
    "longest_idle_ms",
)  # of every rank's profile

DEFAULT_CASES = {
    4: [
        "3d 1x4x1 async",
        "3d 4x1x1",
        "3d 2x2x1",
        "3d auto",
        "3d auto async",
        "tp-sp compile async",
        "tp-sp compile",
        "fsdp2 compile",
        "fsdp2 compile noreshard",
        "tp-sp",
        "fsdp2",
        "fsdp2-tp 2x2 compile",
        "ddp",
        "tp",
        "3d 1x4x1",
        "3d 2x2x1 async",
        "3d 1x1x1 dp4",
        "3d 1x2x1 dp2 async",
        "3d 1x2x1 dp2",
        "3d 2x1x1 dp2",
        "fsdp2-tp 2x2",
        "3d 1x2x2",
        "3d 2x1x2",
        "3d 1x1x4",
        "3d 1x1x2 dp2",
        "3d 1x2x2 async",
        "3d 2x1x2 async",
        "3d 1x1x4 async",
    ],
    2: [
        "3d 2x1x1",
        "3d 1x2x1 async",
        "3d 1x2x1",
        "3d auto",
        "3d auto async",
        "tp-sp compile async",
        "tp-sp compile",
        "fsdp2 compile",
        "fsdp2 compile noreshard",
        "tp-sp",
        "fsdp2",
        "ddp",
        "tp",
        "3d 1x1x1 dp2",
        "3d 1x1x2",
        "3d 1x1x2 async",
    ],
    1: ["3d 1x1x1", "ddp compile", "ddp"],
}


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to train: ``kind`` 3d / tp / tp-sp / fsdp2 / fsdp2-tp / ddp and its options."""

    kind: str
    grid: tuple[int, int, int] | None = None  # 3d; None = "auto"
    dp: int = 1  # 3d, fsdp2-tp
    tp: int = 1  # fsdp2-tp
    async_tp: bool = False
    compile: bool = False
    check_inputs: bool = True  # 3d
    save_gathered: bool = True  # 3d
    prefetch_depth: int = DEFAULTS.prefetch_depth  # 3d
    gathered_together: int = DEFAULTS.gathered_together  # 3d
    grads_at_end: bool = DEFAULTS.grads_at_end  # 3d
    checkpointing: bool = False
    half_grads: bool = False  # the dp gradient reduction in bf16 (fp16 on CPU)
    reshard: bool = (
        True  # fsdp2, fsdp2-tp: free each block's gathered weights after forward (torchtitan's default)
    )

    @classmethod
    def parse(cls, text: str, world: int) -> Method:
        """``"3d 1x4x1 async"``, ``"3d 1x2x1 dp2"``, ``"3d auto"``, ``"tp-sp compile async"``,
        ``"fsdp2-tp 2x2 compile"``, ``"ddp"``."""
        words = text.split()
        kind, opts = words[0], words[1:]
        if kind not in ("3d", "tp", "tp-sp", "fsdp2", "fsdp2-tp", "ddp"):
            raise ValueError(
                f"unknown case {text!r}: the first word must be 3d, tp, tp-sp, fsdp2, fsdp2-tp or ddp"
            )
        fields = {
            "kind": kind,
            "async_tp": "async" in opts,
            "compile": "compile" in opts,
            "check_inputs": "nocheck" not in opts,
            "save_gathered": "regather" not in opts,
            "checkpointing": "ckpt" in opts,
            "half_grads": "bf16grad" in opts,
            "grads_at_end": "early" not in opts,
            "reshard": "noreshard" not in opts,
        }
        for w in opts:
            if "x" in w:
                dims = tuple(int(d) for d in w.split("x"))
                if kind == "3d":
                    fields["grid"] = dims
                else:
                    fields["dp"], fields["tp"] = dims
            elif w.startswith("dp"):
                fields["dp"] = int(w[2:])
            elif w.startswith("ahead"):
                fields["prefetch_depth"] = int(w[5:])
            elif w.startswith("together"):
                fields["gathered_together"] = int(w[8:])
            elif w == "noreshard" and kind not in ("fsdp2", "fsdp2-tp"):
                raise ValueError(f"case {text!r}: noreshard is FSDP2's setting (cases fsdp2 and fsdp2-tp)")
            elif w not in (
                "auto",
                "async",
                "compile",
                "nocheck",
                "regather",
                "late",
                "early",
                "ckpt",
                "bf16grad",
                "noreshard",
            ):
                raise ValueError(f"case {text!r}: unknown word {w!r}")
        method = cls(**fields)
        if kind == "3d" and method.grid is not None and method.dp * math.prod(method.grid) != world:
            raise ValueError(
                f"case {text!r}: dp·px·py·pz = {method.dp * math.prod(method.grid)}, the world has {world} ranks"
            )
        if kind == "fsdp2-tp" and method.dp * method.tp != world:
            raise ValueError(f"case {text!r}: dp·tp = {method.dp * method.tp}, the world has {world} ranks")
        return method

    @property
    def label(self) -> str:
        common = (" ckpt" if self.checkpointing else "") + (" bf16grad" if self.half_grads else "")
        if self.kind == "3d":
            where = (
                "auto"
                if self.grid is None
                else "x".join(map(str, self.grid)) + (f" dp{self.dp}" if self.dp > 1 else "")
            )
            return (
                f"3d {where}"
                + (" async" if self.async_tp else "")
                + (" compile" if self.compile else "")
                + ("" if self.check_inputs else " nocheck")
                + ("" if self.save_gathered else " regather")
                + (f" ahead{self.prefetch_depth}" if self.prefetch_depth != DEFAULTS.prefetch_depth else "")
                + (
                    f" together{self.gathered_together}"
                    if self.gathered_together != DEFAULTS.gathered_together
                    else ""
                )
                + (
                    ""
                    if self.grads_at_end == DEFAULTS.grads_at_end
                    else " late"
                    if self.grads_at_end
                    else " early"
                )
                + common
            )
        where = f" {self.dp}x{self.tp}" if self.kind == "fsdp2-tp" else ""
        return (
            self.kind
            + where
            + (" compile" if self.compile else "")
            + (" async" if self.async_tp else "")
            + ("" if self.reshard else " noreshard")
            + common
        )


@dataclasses.dataclass
class Job:
    """A model ready to train: its step on ``(ids, targets)`` (returns the loss), this rank's rows of
    the global batch, and the group over which the loss is averaged into the global batch's mean."""

    step: object
    rows: slice
    loss_group: object
    info: dict


class Run:
    """This process: rank, device, and the grids and meshes built so far (group creation is collective, reused)."""

    def __init__(self, cpu: bool):
        self.cpu = cpu
        self.device = (
            torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._grids: dict = {}
        self._meshes: dict = {}

    def grid(self, shape, dp):
        key = (shape, dp)
        if key not in self._grids:
            self._grids[key] = lightning_3d.init_grid(shape, dp)
        lightning_3d.set_grid(self._grids[key])
        return self._grids[key]

    def mesh(self, dp: int, tp: int):
        from torch.distributed.device_mesh import init_device_mesh

        if (dp, tp) not in self._meshes:
            self._meshes[(dp, tp)] = init_device_mesh(self.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        return self._meshes[(dp, tp)]

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if not self.cpu else contextlib.nullcontext()

    def log(self, *msg) -> None:
        if self.rank == 0:
            print(*msg, flush=True)


def step_flops(config: GPTConfig, batch: int, seq: int) -> float:
    """Forward + backward FLOPs of one step: 3 × (2 · tokens · matmul weights + the attention scores)."""
    h, f, L = config.n_embd, config.ffn_hidden, config.n_layer
    mlp = (3 if config.style == "llama" else 2) * h * f
    attention = 2 * h * h + 2 * h * config.n_kv_head * config.head_dim  # q and out; k and v (fewer with GQA)
    weights = L * (attention + mlp) + config.vocab_size * h
    return 3 * (2 * batch * seq * weights + L * 4 * batch * seq * seq * h)


def fused_adamw(params, run: Run) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA; DTensor and plain parameters in separate groups (a fused step takes one kind)."""
    params = list(params)
    groups = [
        {"params": g}
        for g in (
            [p for p in params if isinstance(p, DTensor)],
            [p for p in params if not isinstance(p, DTensor)],
        )
        if g
    ]
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY, fused=not run.cpu)


# ---------------------------------------------------------------- building each method


def half_precision_hook(run: Run):
    """DDP's gradient reduction in bf16 (``Tensor3DStrategy(ddp_comm_hook=...)``); fp16 on gloo, where bf16's
    hook does not run."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.fp16_compress_hook if run.cpu else default_hooks.bf16_compress_hook


def build_3d(run: Run, method: Method, config: GPTConfig, dense: dict, batch: int) -> Job:
    """GPT3D through the strategy's steps: DDP over dp, global-norm clipping, bf16 autocast, AdamW."""
    grid = run.grid(method.grid, method.dp)
    options = lightning_3d.RuntimeOptions(
        async_tp=method.async_tp,
        compile=method.compile,
        check_inputs=method.check_inputs,
        save_gathered=method.save_gathered,
        activation_checkpointing=method.checkpointing,
        grads_at_end=method.grads_at_end,
        prefetch_depth=method.prefetch_depth,
        gathered_together=method.gathered_together,
    )
    if method.compile:
        torch.compiler.reset()
    model = GPT3D(config, grid, device=run.device, options=options)
    model.load_dense_state_dict(dense)
    params = list(model.parameters())
    if method.dp > 1:
        model = DistributedDataParallel(
            model, device_ids=None if run.cpu else [run.device], process_group=grid.group("dp")
        )
        if method.half_grads:
            model.register_comm_hook(grid.group("dp"), half_precision_hook(run))
    optimizer = fused_adamw(params, run)

    def step(ids, targets):
        with run.autocast():
            loss = model(ids, targets)
        loss.backward()
        clip_grad_norm_(params, CLIP, grid)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    per = batch // method.dp
    d = grid.coord("dp")
    return Job(
        step, slice(d * per, (d + 1) * per), grid.group("dp") if method.dp > 1 else None, {"model": model}
    )


def build_peer(run: Run, method: Method, config: GPTConfig, dense: dict, batch: int) -> Job:
    """A peer of ``peers.py``: torchtitan's order (TP, compile, FSDP), its mixed precision and clipping."""
    import torch._inductor.config as inductor_config
    from torch.distributed.tensor.parallel import loss_parallel

    world, kind = run.world, method.kind
    model = peers.PeerGPT(config, device=run.device)
    model.load_state_dict(peers.peer_state_dict(dense, config))
    inductor_config._micro_pipeline_tp = False
    tp_mesh = dp_mesh = None
    if kind in ("tp", "tp-sp"):
        tp_mesh = run.mesh(1, world)["tp"]
    elif kind == "fsdp2":
        dp_mesh = run.mesh(world, 1)["dp"]
    elif kind == "fsdp2-tp":
        mesh = run.mesh(method.dp, method.tp)
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    if tp_mesh is not None and tp_mesh.size() > 1:
        peers.apply_tp(model, tp_mesh, sequence_parallel=kind != "tp")
        if method.async_tp:
            peers.enable_async_tp(tp_mesh)
    if method.checkpointing:
        peers.apply_ac(model)
    if method.compile:
        torch.compiler.reset()
        peers.apply_compile(model)
    if dp_mesh is not None:
        peers.apply_fsdp(
            model, dp_mesh, torch.bfloat16 if method.half_grads else torch.float32, method.reshard
        )
    params = list(model.parameters())
    if kind == "ddp" and world > 1:
        model = DistributedDataParallel(model, device_ids=None if run.cpu else [run.device])
        if method.half_grads:
            model.register_comm_hook(None, half_precision_hook(run))
    optimizer = fused_adamw(params, run)
    sharded_logits = tp_mesh is not None and tp_mesh.size() > 1
    precision = contextlib.nullcontext() if dp_mesh is not None else run.autocast()
    loss_fn = peers.compiled_cross_entropy() if method.compile else peers.cross_entropy

    def step(ids, targets):
        with loss_parallel() if sharded_logits else contextlib.nullcontext():
            with precision:
                loss = loss_fn(model(ids), targets)
            loss.backward()
        peers.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if kind in ("fsdp2", "ddp"):
        replicas, replica, group = world, run.rank, dist.group.WORLD if world > 1 else None
    elif kind == "fsdp2-tp":
        replicas, replica, group = method.dp, dp_mesh.get_local_rank(), dp_mesh.get_group()
    else:
        replicas, replica, group = 1, 0, None
    per = batch // replicas
    return Job(step, slice(replica * per, (replica + 1) * per), group, {})


def profiled_labels(option: str, text: str, methods: list[Method], world: int) -> set[str]:
    """The labels of the ';'-separated cases ``text`` names (their words in any order); raises
    ``SystemExit`` naming a case that is not among ``methods``, before any case runs."""
    labels = {m.label for m in methods}
    named = {Method.parse(t.strip(), world).label for t in text.split(";") if t.strip()}
    if named - labels:
        raise SystemExit(f"{option} names {sorted(named - labels)}, not among the cases: {sorted(labels)}")
    return named


def predicted_bytes(method: Method, config: GPTConfig, batch: int, seq: int, cpu: bool) -> dict:
    """The bytes the cost model says each rank sends in one step of a 3-D case: float32 operands on
    CPU, bf16 under autocast; the dp reduction in float32, or half with ``bf16grad``."""
    operands = 4 if cpu else 2
    return sent_bytes(
        ModelShape.of(config, batch, seq),
        method.grid,
        method.dp,
        save_gathered=method.save_gathered,
        element_bytes=operands,
        grad_bytes=2 if method.half_grads else 4,
    )


def resolve_auto(
    run: Run, method: Method, config: GPTConfig, batch: int, seq: int, machine: Machine
) -> Method:
    """``3d auto``: the grid and dp ``Tensor3DStrategy(grid="auto", model_shape=..., machine=...)`` resolves to,
    the whole job priced on the ``machine`` measured at the start."""
    grid, dp = grid_rules.resolve(
        "auto",
        "auto",
        run.world,
        run.world,
        ModelShape.of(config, batch, seq),
        options=lightning_3d.RuntimeOptions(async_tp=method.async_tp, grads_at_end=method.grads_at_end),
        machine=machine,
        half_grads=method.half_grads,
    )
    return dataclasses.replace(method, grid=tuple(grid), dp=dp)


# ---------------------------------------------------------------- running one case


def free_memory(run: Run) -> None:
    gc.collect()
    if not run.cpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_case(
    run: Run,
    method: Method,
    config: GPTConfig,
    dense_cpu: dict,
    data,
    batch: int,
    seq: int,
    warmup: int,
    steps: int,
    profile: bool = False,
    host_profile: bool = False,
    count_bytes: bool = False,
) -> dict:
    free_memory(run)
    cuda = not run.cpu
    base = torch.cuda.memory_allocated(run.device) if cuda else 0
    t0 = time.perf_counter()
    dense = {k: v.to(run.device) for k, v in dense_cpu.items()}
    build = build_3d if method.kind == "3d" else build_peer
    job = build(run, method, config, dense, batch)
    del dense
    free_memory(run)
    if cuda:
        torch.cuda.reset_peak_memory_stats(run.device)
    build_s = time.perf_counter() - t0
    timer = measure.Timer(run.device)
    times, host, losses = [], [], []
    compile_counters.clear()
    gc.collect()
    gc.disable()  # as torchtitan trains: no automatic collection inside steps (its gc_freq collects between them)
    for i in range(warmup + steps):
        ids, targets = (t[job.rows] for t in data[i % len(data)])
        timer.mark()
        launched = time.perf_counter()
        loss = job.step(ids, targets)
        host.append((time.perf_counter() - launched) * 1e3)
        timer.mark()
        times += timer.split()
        if i < LOSS_STEPS:
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            losses.append(loss.detach().float().reshape(()))
    timeline = None
    # GPU time of 2 more steps: busy, communication, communication no compute hides, the longest kernels
    if profile:
        ids, targets = (t[job.rows] for t in data[0])
        trace = os.path.join("/tmp", f"train_job_trace_{os.getpid()}.json.gz")
        timeline = measure.profile_steps(functools.partial(job.step, ids, targets), 2, trace)
        every_rank = [None] * run.world
        dist.all_gather_object(every_rank, measure.nccl_kernels(trace))
        timeline["peer_waits"] = measure.peer_waits(every_rank)
        dist.all_gather_object(every_rank, {k: timeline[k] for k in RANK_TIMELINE})
        timeline["by_rank"] = every_rank
    if host_profile:  # 3 more steps, every rank profiled alike; rank 0's Python is reported
        ids, targets = (t[job.rows] for t in data[0])
        python_top = measure.host_profile(functools.partial(job.step, ids, targets), 3)
    sent = None
    if count_bytes:  # one more step, its collectives counted (every rank's)
        ids, targets = (t[job.rows] for t in data[0])
        with comm_bytes.SentBytes() as counter:
            job.step(ids, targets)
        sent = [None] * run.world
        dist.all_gather_object(sent, counter.summary())
    gc.enable()
    peak = (torch.cuda.max_memory_allocated(run.device) - base) / 2**30 if cuda else 0.0
    loss_t = torch.stack(losses).to(run.device)
    if job.loss_group is not None:
        dist.all_reduce(loss_t, group=job.loss_group)
        loss_t /= dist.get_world_size(job.loss_group)
    median, first, peak = measure.all_reduce_max(
        [statistics.median(times[warmup:]), times[0], peak], run.device
    )
    host_by_rank = [None] * run.world
    dist.all_gather_object(host_by_rank, round(statistics.median(host[warmup:]), 2))
    del job
    free_memory(run)
    result = {
        "step_ms": median,
        "first_step_s": first / 1e3,
        "build_s": build_s,
        "peak_GiB": peak,
        "losses": loss_t.tolist(),
        "step_ms_each": times,
        "host_ms_each": host,
        "host_ms_by_rank": host_by_rank,
        "compiled": compiled_summary(),
    }
    if timeline is not None:
        result["profile_rank0_2_steps"] = timeline
    if host_profile:
        result["host_python_rank0"] = python_top
    if sent is not None:
        result["sent_bytes_by_rank"] = sent
    return result


SAME_JOB = (
    "world",
    "device",
    "torch",
    "links",
    "nccl_p2p_disable",
    "warmup",
    "steps",
    "model",
    "config",
    "batch",
    "seq",
)


def earlier_job(path: str, meta: dict) -> tuple[dict, list[dict]]:
    """The meta and cases of the job in ``path``, to which this process appends its cases; raises
    ``ValueError`` naming the fields where this process's job differs from it (on every rank alike)."""
    with open(path) as f:
        earlier = json.load(f)
    differ = [
        f"{k}: {earlier['meta'].get(k)!r} in the file, {meta[k]!r} here"
        for k in SAME_JOB
        if earlier["meta"].get(k) != meta[k]
    ]
    if differ:
        raise ValueError(
            f"--append: {path} holds another job ({'; '.join(differ)}); "
            "give the same model, layers, batch, steps, links and GPUs, or another --out"
        )
    this = {k: meta[k] for k in ("date", "commit", "argv", "matmul_tflops")}
    return dict(earlier["meta"], appended=earlier["meta"].get("appended", []) + [this]), earlier["cases"]


def compiled_summary() -> dict:
    """What ``torch.compile`` did in this case (this rank): frames traced (a recompilation traces
    one more), distinct graphs, graph breaks and the first few reasons."""
    breaks = compile_counters["graph_break"]
    return {
        "frames": compile_counters["frames"]["total"],
        "graphs": compile_counters["stats"]["unique_graphs"],
        "graph_breaks": sum(breaks.values()),
        "break_reasons": [reason.splitlines()[0][:160] for reason in list(breaks)[:4]],
    }


def agreed(ok: bool, run: Run) -> bool:
    """True when every rank passes ``ok`` (a case failed on any rank counts as failed everywhere)."""
    flag = torch.tensor([0.0 if ok else 1.0], device=run.device)
    dist.all_reduce(flag)
    return flag.item() == 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU, float32, a tiny model (smoke test)")
    parser.add_argument(
        "--model", default=None, help=f"one of {sorted(MODELS)} (default gpt2-1.3b; tiny-gpt2 with --cpu)"
    )
    parser.add_argument("--layers", type=int, default=None, help="override the model's layers")
    parser.add_argument(
        "--batch", type=int, default=None, help="global batch in sequences (the same for every case)"
    )
    parser.add_argument(
        "--cases", default="defaults", help="';'-separated cases in order, or 'defaults' (see the module doc)"
    )
    parser.add_argument(
        "--links",
        default="nvlink",
        choices=("nvlink", "p2p-off"),
        help="a tag for the links; p2p-off (NCCL_P2P_DISABLE=1) drops async cases: symmetric memory bypasses "
        "NCCL's setting",
    )
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--profile",
        default="",
        help="';'-separated cases also profiled for 2 steps after timing (GPU kernels on CUDA)",
    )
    parser.add_argument(
        "--host-profile",
        default="",
        help="';'-separated cases whose rank-0 Python is also profiled (cProfile) for 3 steps after timing",
    )
    parser.add_argument(
        "--budget-s", type=float, default=1e9, help="start no case that would end after this many seconds"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the cases to the file an earlier process of the same job wrote (one process per case: launch.py)",
    )
    parser.add_argument(
        "--count-bytes",
        action="store_true",
        help="one more step per case, the bytes each rank sends counted from its collectives",
    )
    args = parser.parse_args()
    cpu = args.cpu
    dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(seconds=600))
    run = Run(cpu)
    if not cpu:
        torch.cuda.set_device(run.device)
    started = time.perf_counter()
    name = args.model or ("tiny-gpt2" if cpu else "gpt2-1.3b")
    fields, batch, seq = MODELS[name]
    fields = dict(fields, n_layer=args.layers or fields["n_layer"])
    batch = args.batch or batch
    config = GPTConfig(block_size=seq, dropout=0.0, tie_embeddings=False, **fields)
    warmup, steps = args.warmup or (2 if cpu else 3), args.steps or (2 if cpu else 6)
    texts = (
        DEFAULT_CASES[run.world]
        if args.cases == "defaults"
        else [t.strip() for t in args.cases.split(";") if t.strip()]
    )
    methods = [Method.parse(t, run.world) for t in texts]
    profiled, python_profiled = (
        profiled_labels(option, text, methods, run.world)
        for option, text in (("--profile", args.profile), ("--host-profile", args.host_profile))
    )
    if args.links == "p2p-off":
        methods = [m for m in methods if not m.async_tp]

    torch.manual_seed(0)
    dense_cpu = {
        k: v.cpu() if cpu else v.cpu().pin_memory()
        for k, v in DenseGPT(config, device=run.device).state_dict().items()
    }
    n_params = sum(v.numel() for v in dense_cpu.values())
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(4):
        ids = torch.randint(config.vocab_size, (batch, seq + 1), generator=gen).to(run.device)
        data.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    flops = step_flops(config, batch, seq)
    if cpu:
        matmul = measure.matmul_tflops(run.device, torch.float32, 256, 5)
    else:
        matmul = measure.matmul_tflops(run.device, torch.bfloat16, 8192)
    matmul = -measure.all_reduce_max([-matmul], run.device)[0]
    machine = measure_machine(run.device, gpus_per_node=run.world)  # one node: torchrun --nproc_per_node
    meta = {
        "world": run.world,
        "device": "cpu" if cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "nccl": None if cpu else ".".join(map(str, torch.cuda.nccl.version())),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("BENCH_COMMIT", ""),
        "argv": sys.argv,
        "links": args.links,
        "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE", ""),
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")),
        "gpu_GiB": None if cpu else torch.cuda.get_device_properties(run.device).total_memory / 2**30,
        "warmup": warmup,
        "steps": steps,
        "warm_run_steps": 1,
        "model": name,
        "config": dataclasses.asdict(config),
        "params": n_params,
        "batch": batch,
        "seq": seq,
        "tokens_per_step": batch * seq,
        "flops_per_step": flops,
        "matmul_tflops": matmul,
        "precision": "fp32 (cpu)" if cpu else "bf16 mixed, fp32 master weights",
        "optimizer": f"AdamW lr {LR} wd {WEIGHT_DECAY}, fused",
        "clip": CLIP,
        "machine": machine.rates(),
    }
    run.log(
        f"{name}: {n_params / 1e9:.2f}B parameters, batch {batch}×{seq}, world {run.world} on {meta['device']}, "
        f"links {args.links}, matmul {matmul:.0f} TFLOP/s"
    )
    size = f"_L{config.n_layer}" if args.layers else ""
    path = os.path.join(args.out, f"job_w{run.world}_{name}{size}_{args.links}.json")
    os.makedirs(args.out, exist_ok=True)
    cases: list[dict] = []
    if args.append and os.path.exists(path):
        meta, cases = earlier_job(path, meta)
    done: dict[str, dict] = {}
    cost = {
        False: 20.0 if not cpu else 1.0,
        True: 45.0 if not cpu else 1.0,
    }  # seconds a case takes: a guess, then the most measured
    measured: set[bool] = set()
    for method in methods:
        label = method.label
        entry = {"case": label}
        if method.kind == "3d" and method.grid is None:
            try:
                method = resolve_auto(run, method, config, batch, seq, machine)
            except ValueError as e:
                cases.append(dict(entry, error=f"auto: {e}"))
                continue
            entry["picks"] = method.label
        if method.label in done and label != method.label:
            cases.append(dict(done[method.label], case=label, picks=method.label))
            run.log(f"  {label:24s} = {method.label}")
            continue
        elapsed = time.perf_counter() - started
        if elapsed + cost[method.compile] > args.budget_s:
            cases.append(
                dict(entry, error=f"not run: time budget ({elapsed:.0f} s of {args.budget_s:.0f} s spent)")
            )
            run.log(f"  {label:24s} not run (time budget)")
            continue
        t0 = time.perf_counter()
        error = None
        try:
            run_case(
                run, method, config, dense_cpu, data, batch, seq, 0, 1
            )  # the warm run: untimed, not recorded
            result = run_case(
                run,
                method,
                config,
                dense_cpu,
                data,
                batch,
                seq,
                warmup,
                steps,
                profile=label in profiled,
                host_profile=label in python_profiled,
                count_bytes=args.count_bytes,
            )
        except (
            Exception
        ) as e:  # a case that fails (out of memory, a peer's limits) is recorded, the rest still run
            error = f"{type(e).__name__}: {str(e)[:400]}"
            result = {}
            free_memory(run)
        if not agreed(error is None, run):
            result = {"error": error or "failed on another rank"}
        else:
            s = result["step_ms"] / 1e3
            result.update(
                tokens_per_s=batch * seq / s,
                tflops_per_gpu=flops / s / run.world / 1e12,
                mfu=flops / s / run.world / (matmul * 1e12),
            )
            if (
                args.count_bytes and method.kind == "3d" and not method.checkpointing
            ):  # recomputed collectives: not priced
                result["predicted_sent_bytes"] = predicted_bytes(method, config, batch, seq, cpu)
        spent = time.perf_counter() - t0
        cost[method.compile] = max(cost[method.compile], spent) if method.compile in measured else spent
        measured.add(method.compile)
        entry.update(method=dataclasses.asdict(method), **result)
        cases.append(entry)
        done[method.label] = entry
        if "error" in result:
            run.log(f"  {label:24s} FAILED {result['error']}")
        else:
            run.log(
                f"  {label:24s} {result['step_ms']:8.1f} ms {result['tokens_per_s']:9.0f} tok/s MFU "
                f"{result['mfu']:.1%} "
                f"peak {result['peak_GiB']:6.2f} GiB loss {' '.join(f'{v:.5f}' for v in result['losses'])} "
                f"(first step {result['first_step_s']:.1f} s)"
            )
        if run.rank == 0:
            with open(path, "w") as f:
                json.dump({"meta": meta, "cases": cases}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
