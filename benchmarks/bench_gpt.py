"""GPT blocks under 3-D tensor parallelism on every grid, against PyTorch's 1-D peer and the dense model.

Launch one process per GPU: ``torchrun --nproc_per_node N benchmarks/bench_gpt.py --out DIR``
(``benchmarks/run_gpu.sh`` runs N = 1, 2, 4 in one call). ``--cpu`` runs tiny shapes on gloo in
float32: the smoke test of CI (``tests/test_benchmarks.py``).

For each shape it builds one set of dense weights (GPT-2 init, seed 0, the same on every rank) and
times, on the same weights and input, a forward + backward of ``sum(y²)/numel`` (the anchor's
step) for:

- ``dense``: ``lightning_3d.models.DenseBlock`` stack on one GPU (every rank runs it alone);
- ``tp1d``: the anchor's block under DTensor Colwise/Rowwise (``peer.py``), TP = N, and TP = N/2
  with dp 2 when N >= 4;
- ``3d``: ``DenseBlock`` stack parallelized by the GPT plan's block rules (``lightning_3d.models.gpt3d.block_rules``) on every ``px×py×pz`` grid whose size divides N
  (dp fills the rest; gradients all-reduced over dp inside the step), with the next weight's
  all-gather prefetched (:class:`~lightning_3d.ops.prefetch.WeightPrefetch`); and, on the A/B grids,
  the variants ``before`` (the matmul and norm code of commit 4e34463, loaded from ``--before``),
  ``no-prefetch``, ``regather`` (``save_gathered=False``), ``split-qkv`` (three Linear3D for
  q, k, v instead of the fused one), ``normal-priority`` (NCCL streams of normal priority;
  every other case runs with ``TORCH_NCCL_HIGH_PRIORITY=1``) and ``async-tp`` (the grid's
  ``async_tp=True``: activation gathers and scatters as collective matmuls over symmetric memory).

Reported per case: median forward, backward and step ms (CUDA events, max over ranks), TFLOP/s
per GPU and MFU against the matmul rate measured in the same run, peak memory per GPU (max over
ranks, above what was allocated before the model was built), the relative error of the output's
block contribution ``y − x`` and of the loss against the dense model. Before that, on every grid,
the 3-D model's loss, input gradient and every parameter gradient are checked against the dense
model in float64, in float32 with TF32 off, to 1e-4 (two steps with prefetch, weights changed in
place between them). Everything is written to ``DIR/bench_w{N}.json``; ``report.py`` prints the
tables from those files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import itertools
import json
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import measure  # noqa: E402
import peer  # noqa: E402
import lightning_3d  # noqa: E402
from lightning_3d.layout import Layout  # noqa: E402
from lightning_3d.models.config import GPTConfig  # noqa: E402
from lightning_3d.models.dense import DenseBlock  # noqa: E402
from lightning_3d.models.gpt3d import block_rules  # noqa: E402
from lightning_3d.models.init import init_dense_tensor_  # noqa: E402
from lightning_3d.options import RuntimeOptions  # noqa: E402
from lightning_3d.parallel import Linear, Plan, parallelize  # noqa: E402
from lightning_3d.sharding import get_spec, shard_tensor  # noqa: E402

VARIANTS = ("before", "no-prefetch", "regather", "split-qkv", "normal-priority", "async-tp")
# High-priority NCCL streams let a collective start while a GEMM holds every SM (read by
# ProcessGroupNCCL when a group's communicator is created, at its first collective).
HIGH_PRIORITY = "TORCH_NCCL_HIGH_PRIORITY"
CHECK_TOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Shape:
    """A stack of ``layers`` GPT blocks of width ``h`` and ``heads`` heads on ``b`` sequences of ``s`` tokens."""

    h: int
    heads: int
    s: int
    b: int
    layers: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """``"h4096,n32,s2048,b8,L4"`` → Shape."""
        fields = {part[0]: int(part[1:]) for part in text.split(",")}
        return cls(fields["h"], fields["n"], fields["s"], fields["b"], fields["L"])

    @property
    def name(self) -> str:
        return f"h{self.h},n{self.heads},s{self.s},b{self.b},L{self.layers}"

    @property
    def flops(self) -> int:
        """Forward + backward FLOPs of a step, counted as the anchor does."""
        return 3 * self.layers * (24 * self.b * self.s * self.h**2 + 4 * self.b * self.s**2 * self.h)

    def config(self) -> GPTConfig:
        return GPTConfig(vocab_size=64, block_size=self.s, n_layer=self.layers, n_head=self.heads, n_embd=self.h, dropout=0.0, style="gpt2")


@dataclasses.dataclass(frozen=True)
class Case:
    """One model on one layout of the ranks: ``kind`` dense / tp1d / 3d, a grid, dp and a variant."""

    kind: str
    grid: tuple[int, int, int] = (1, 1, 1)
    dp: int = 1
    variant: str = ""

    @property
    def label(self) -> str:
        if self.kind == "dense":
            return "dense 1 GPU"
        where = f"TP={self.grid[0]}" if self.kind == "tp1d" else "3d " + "x".join(map(str, self.grid))
        return where + (f" dp{self.dp}" if self.dp > 1 else "") + (f" [{self.variant}]" if self.variant else "")

    @property
    def gpus(self) -> int:
        return 1 if self.kind == "dense" else self.dp * math.prod(self.grid)


def cube_grids(n: int) -> list[tuple[int, int, int]]:
    """Every ``(px, py, pz)`` with ``px·py·pz == n``."""
    return [g for g in itertools.product(range(1, n + 1), repeat=3) if math.prod(g) == n]


def cases_for(world: int, main: bool, ab_grids: list[tuple[int, int, int]], variants: list[str]) -> list[Case]:
    """Dense, the peer(s) and 3-D on every grid; on a main shape also dp layouts and the variants."""
    cases = [Case("dense"), Case("tp1d", (world, 1, 1))]
    if main and world >= 4:
        cases.append(Case("tp1d", (world // 2, 1, 1), 2))
    sizes = [c for c in range(world, 0, -1) if world % c == 0] if main else [world]
    cases += [Case("3d", g, world // c) for c in sizes for g in cube_grids(c)]
    if main:
        cases += [Case("3d", g, 1, v) for g in ab_grids if math.prod(g) == world for v in variants]
    return cases


# ---------------------------------------------------------------- models on the same weights


def dense_block_states(shape: Shape, device, dtype, randomize: bool) -> list[dict[str, torch.Tensor]]:
    """Per block, a DenseBlock state dict: GPT-2 init (seed 0), or every tensor N(0, 0.3²) with
    ``randomize`` (the correctness check, so that no gradient vanishes); broadcast from rank 0."""
    config = shape.config()
    torch.manual_seed(0)
    states = []
    for i in range(shape.layers):
        sd = DenseBlock(config, device=device, dtype=dtype).state_dict()
        for key, t in sd.items():
            if randomize:
                t.normal_(0.0, 0.3)
            else:
                init_dense_tensor_(f"transformer.h.{i}.{key}", t, config)
            dist.broadcast(t, 0)
        states.append(sd)
    return states


class SplitQKV(nn.Module):
    """The unfused variant of ``DenseAttention.c_attn``: q, k and v as three linears (each z → y on
    the grid), their outputs concatenated so that ``chunk(3, -1)`` splits them again."""

    def __init__(self, h: int, bias: bool, device, dtype):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(h, h, bias=bias, device=device, dtype=dtype) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], -1)


def _split_qkv_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in sd.items() if not k.startswith("attn.c_attn.")}
    for part in ("weight", "bias"):
        for name, t in zip("qkv", sd[f"attn.c_attn.{part}"].chunk(3)):
            out[f"attn.c_attn.{name}.{part}"] = t
    return out


def _load_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def code_before(before_dir: str):
    """Run the 3-D products and norms with the code of ``before_dir`` (``ops/matmul.py`` and
    ``layers/norm.py`` of commit 4e34463: no prefetch, dA reduce-scatter always first, bias added
    after the product, the distributed normalize on every grid)."""
    import lightning_3d.layers.linear as linear
    import lightning_3d.layers.norm as norm
    import lightning_3d.layers.fused_linear as fused

    old_matmul = _load_module("lightning_3d.ops._matmul_before", os.path.join(before_dir, "matmul.py"))
    old_norm = _load_module("lightning_3d.layers._norm_before", os.path.join(before_dir, "norm.py"))

    def matmul_abt(a, b, directions, grid, options, bias=None):
        y = old_matmul.matmul_abt(a, b, directions, grid, options.save_gathered)
        return y if bias is None else y + bias.to(y.dtype)

    saved = linear.matmul_abt, fused.matmul_abt, norm._Norm3D.forward
    linear.matmul_abt = fused.matmul_abt = matmul_abt
    norm._Norm3D.forward = old_norm._Norm3D.forward
    try:
        yield
    finally:
        linear.matmul_abt, fused.matmul_abt, norm._Norm3D.forward = saved


@contextlib.contextmanager
def nccl_priority(high: bool):
    """NCCL streams of the process groups first used inside: high priority or normal."""
    saved = os.environ.get(HIGH_PRIORITY)
    os.environ[HIGH_PRIORITY] = "1" if high else "0"
    try:
        yield
    finally:
        os.environ[HIGH_PRIORITY] = saved if saved is not None else "0"


class Run:
    """The ranks, device and options of this process."""

    def __init__(self, args):
        self.args = args
        self.cpu = args.cpu
        self.device = torch.device("cpu") if self.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        self.dtype = torch.float32 if self.cpu else torch.bfloat16
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._grids: dict = {}
        self._meshes: dict = {}

    def grid(self, shape, dp, high_priority: bool = True):
        key = (shape, dp, high_priority)
        if key not in self._grids:
            self._grids[key] = lightning_3d.init_grid(shape, dp)
        lightning_3d.set_grid(self._grids[key])
        return self._grids[key]

    def mesh(self, tp, dp):
        from torch.distributed.device_mesh import init_device_mesh

        if (tp, dp) not in self._meshes:
            self._meshes[(tp, dp)] = init_device_mesh(self.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        return self._meshes[(tp, dp)]

    def log(self, *msg) -> None:
        if self.rank == 0:
            print(*msg, flush=True)


@dataclasses.dataclass
class Built:
    """A model ready to step: its local input, the loss scale, the dp group, and how to see its full output."""

    model: nn.Module
    x: torch.Tensor
    scale: float
    dp_group: object
    full_output: object  # local output -> this replica's full [b/dp, s, h]
    replica: slice
    loss_group_divisor: int


def build(run: Run, case: Case, shape: Shape, states, x_full: torch.Tensor, dtype) -> Built:
    """The model of ``case`` on ``states``, and its share of ``x_full``."""
    dev = run.device
    scale = 1.0 / x_full.numel()
    rows = shape.b // case.dp
    if case.kind == "dense":
        model = nn.Sequential(*[DenseBlock(shape.config(), device=dev, dtype=dtype) for _ in states])
        for block, sd in zip(model, states):
            block.load_state_dict(sd)
        x = x_full.detach().clone().requires_grad_()
        return Built(model, x, scale, None, lambda y: y, slice(0, shape.b), run.world)
    if case.kind == "tp1d":
        mesh = run.mesh(case.grid[0], case.dp)
        d = mesh.get_coordinate()[0]
        model = peer.build_peer(states, shape.h, shape.heads, mesh["tp"], dev, dtype)
        replica = slice(d * rows, (d + 1) * rows)
        x = x_full[replica].detach().clone().requires_grad_()
        dp_group = mesh.get_group("dp") if case.dp > 1 else None
        return Built(model, x, scale, dp_group, lambda y: y, replica, case.grid[0])
    grid = case_grid(run, case)
    config = shape.config()
    options = RuntimeOptions(async_tp=case.variant == "async-tp", save_gathered=case.variant != "regather",
                             prefetch=case.variant not in ("before", "no-prefetch"))
    model = nn.Sequential(*[DenseBlock(config, device="meta", dtype=dtype) for _ in states])
    rules = block_rules(config, "*")
    if case.variant == "split-qkv":
        for block in model:
            block.attn.c_attn = SplitQKV(shape.h, config.bias, "meta", dtype)
        states = [_split_qkv_state(sd) for sd in states]
        del rules["*.attn.c_attn"]
        rules["*.attn.c_attn.[qkv]"] = Linear("z")
    dense = {f"{i}.{key}": t for i, sd in enumerate(states) for key, t in sd.items()}
    parallelize(model, Plan(rules, options=options, init=lambda key, t: t.copy_(dense[key])), grid=grid, device=dev)
    d = grid.coord("dp")
    replica = slice(d * rows, (d + 1) * rows)
    layout = Layout("z")
    x = shard_tensor(x_full[replica], layout.spec(tuple(x_full[replica].shape)), grid).contiguous().requires_grad_()
    dp_group = grid.group("dp") if case.dp > 1 else None
    return Built(model, x, scale, dp_group, lambda y: lightning_3d.gather_activation(y, "z", grid), replica, 1)


def case_grid(run: Run, case: Case):
    return run.grid(case.grid, case.dp, case.variant != "normal-priority")


def make_step(built: Built, timer: measure.Timer | None = None):
    """One training step without optimizer: forward, ``sum(y²)·scale``, backward, dp gradient sum."""
    params = [p for p in built.model.parameters() if p.requires_grad]

    def mark():
        if timer is not None:
            timer.mark()

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        built.x.grad = None
        mark()
        loss = built.model(built.x).float().pow(2).sum() * built.scale
        mark()
        loss.backward()
        if built.dp_group is not None:
            works = [dist.all_reduce(_local(p.grad), group=built.dp_group, async_op=True) for p in params]
            for w in works:
                w.wait()
        mark()
        return loss

    return step


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------- correctness (float32 vs float64)


def check_grid(run: Run, case: Case, shape: Shape) -> dict:
    """Loss, input gradient and every parameter gradient of the 3-D stack (float32, prefetch on)
    against the dense stack in float64, over two steps with the weights changed in place between."""
    states = dense_block_states(shape, run.device, torch.float64, randomize=True)
    torch.manual_seed(1)
    x_full = torch.randn(shape.b, shape.s, shape.h, device=run.device, dtype=torch.float64)
    w_full = torch.randn_like(x_full)
    dist.broadcast(x_full, 0)
    dist.broadcast(w_full, 0)
    dense = build(run, Case("dense"), shape, states, x_full, torch.float64)
    mine = build(run, case, shape, [{k: v.float() for k, v in sd.items()} for sd in states], x_full.float(), torch.float32)
    grid = case_grid(run, case)
    layout = Layout("z")
    w_local = shard_tensor(w_full[mine.replica], layout.spec(tuple(w_full[mine.replica].shape)), grid).float()
    errors: dict[str, float] = {}
    for step in range(2):
        ref = (dense.model(dense.x) * w_full).sum()
        ref.backward()
        loss = (mine.model(mine.x) * w_local).sum()
        loss.backward()
        total = loss.detach().double().clone()
        dist.all_reduce(total)
        grads = {n: p.grad for n, p in mine.model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g, group=grid.group("dp"))
        dense_grads = dict(dense.model.named_parameters())
        errs = {"loss": _rel(total, ref.detach()),
                "dx": _rel(mine.x.grad, shard_tensor(dense.x.grad[mine.replica], layout.spec(tuple(dense.x.grad[mine.replica].shape)), grid))}
        for name, g in grads.items():
            spec = get_spec(dict(mine.model.named_parameters())[name])
            ref_grad = dense_grads[name].grad
            ref_grad = shard_tensor(ref_grad.reshape(spec.global_shape), spec, grid) if spec is not None else ref_grad
            errs["d" + name] = _rel(g, ref_grad)
        for k, v in errs.items():
            errors[k] = max(errors.get(k, 0.0), v)
        with torch.no_grad():  # an update in place, as an optimizer step does, before the second step
            for m in (dense.model, mine.model):
                for p in m.parameters():
                    p.mul_(0.9)
                    p.grad = None
            dense.x.grad = mine.x.grad = None
    worst = max(measure.all_reduce_max(list(errors.values()), run.device))
    return {"case": case.label, "grid": case.grid, "dp": case.dp, "max_rel_err": worst, "ok": worst < CHECK_TOL}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    norm = ref.double().norm()
    if norm == 0:
        raise AssertionError("zero reference: this comparison could not fail")
    return float((a.double() - ref.double()).norm() / norm)


@contextlib.contextmanager
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---------------------------------------------------------------- timing


def time_case(run: Run, case: Case, shape: Shape, states, x_full, ref_delta, profile_to: str | None) -> dict:
    args = run.args
    cuda = run.device.type == "cuda"
    before = code_before(args.before) if case.variant == "before" else contextlib.nullcontext()
    with before, nccl_priority(case.variant != "normal-priority"):
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
        built = build(run, case, shape, states, x_full, run.dtype)
        with torch.no_grad():
            y = built.full_output(built.model(built.x))
            x_rep = x_full[built.replica]
            out_err = _rel(y.float() - x_rep.float(), ref_delta[built.replica].float())
            del y
        timer = measure.Timer(run.device)
        step = make_step(built, timer)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        losses, fwd, bwd = [], [], []
        for i in range(args.warmup + args.iters):
            loss = step()
            f, b = timer.split()
            if i == 0:
                losses.append(loss.detach().double())
            if i >= args.warmup:
                fwd.append(f)
                bwd.append(b)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
        total = losses[0].clone()
        dist.all_reduce(total)
        loss = float(total) / built.loss_group_divisor
        steps = [f + b for f, b in zip(fwd, bwd)]
        fwd_ms, bwd_ms, step_ms, peak, out_err = measure.all_reduce_max(
            [statistics.median(fwd), statistics.median(bwd), statistics.median(steps), peak, out_err], run.device)
        result = {"case": case.label, "kind": case.kind, "grid": list(case.grid), "dp": case.dp, "variant": case.variant,
                  "gpus": case.gpus, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "step_ms": step_ms,
                  "step_spread_ms": [min(steps), max(steps)], "peak_GiB": peak, "loss": loss, "out_rel_err_vs_dense": out_err}
        if profile_to is not None:
            timeline = measure.profile_steps(make_step(built), 3, profile_to) if run.rank == 0 else None
            if run.rank != 0:
                measure.profile_steps(make_step(built), 3, os.path.join("/tmp", f"trace_rank{run.rank}.json"))
            if timeline is not None:
                timeline["exposed_comm_fraction"] = timeline["exposed_comm_ms"] / (3 * step_ms)
                timeline["idle_fraction"] = 1 - timeline["busy_ms"] / (3 * step_ms)
                timeline["trace"] = os.path.basename(profile_to)
                result["profile"] = timeline
    del built, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def run_shape(run: Run, shape: Shape, main: bool, profile: bool, hw: dict) -> list[dict]:
    args = run.args
    states = dense_block_states(shape, run.device, run.dtype, randomize=False)
    torch.manual_seed(2)
    x_full = torch.randn(shape.b, shape.s, shape.h, device=run.device, dtype=run.dtype)
    dist.broadcast(x_full, 0)
    with torch.no_grad():
        dense = build(run, Case("dense"), shape, states, x_full, run.dtype)
        ref_delta = dense.model(x_full) - x_full
        del dense
    ab_grids = [tuple(int(v) for v in g.split("x")) for g in args.ab_grids.split(",") if g] if main else []
    variants = [v for v in args.variants.split(",") if v and (v != "before" or args.before)]
    cases = cases_for(run.world, main, ab_grids, variants)
    results = []
    for case in cases:
        try:
            results.append(time_case(run, case, shape, states, x_full, ref_delta, None))
        except ValueError as e:  # the grid does not divide this shape: raised alike on every rank
            results.append({"case": case.label, "kind": case.kind, "grid": list(case.grid), "dp": case.dp,
                            "variant": case.variant, "gpus": case.gpus, "skipped": str(e)})
        r = results[-1]
        run.log(f"  {shape.name:28s} {r['case']:26s} " + (f"step {r['step_ms']:8.2f} ms  peak {r['peak_GiB']:6.2f} GiB  "
                                                          f"out err {r['out_rel_err_vs_dense']:.2e}" if "step_ms" in r else "skipped"))
    if args.profile and profile and (run.world > 1 or args.profile_cases) and not run.cpu:
        timed = [r for r in results if "step_ms" in r]
        best = [min((r for r in timed if r["kind"] == "3d" and r["dp"] == 1 and r["variant"] == v), key=lambda r: r["step_ms"])
                for v in ("", "async-tp") if any(r["kind"] == "3d" and r["variant"] == v for r in timed)]
        chosen = best + [next(r for r in timed if r["kind"] == "tp1d" and r["dp"] == 1)]
        if args.profile_cases:
            chosen = [r for r in timed if r["case"] in args.profile_cases.split(",")]
        for r in chosen:
            case = Case(r["kind"], tuple(r["grid"]), r["dp"], r["variant"])
            name = f"trace_w{run.world}_h{shape.h}_{case.kind}_{'x'.join(map(str, case.grid))}{'_' + case.variant if case.variant else ''}.json.gz"
            prof = time_case(run, case, shape, states, x_full, ref_delta, os.path.join(args.out, name))
            r["profile"] = prof.get("profile")
            run.log(f"  profiled {case.label}: {r['profile']}")
    for r in results:
        if "step_ms" in r:
            tflops = shape.flops / (r["step_ms"] * 1e-3) / r["gpus"] / 1e12
            r.update(tflops_per_gpu=tflops, mfu=tflops / hw["matmul_tflops"])
    dense_loss = next(r["loss"] for r in results if r["kind"] == "dense")
    peer_loss = next(r["loss"] for r in results if r["kind"] == "tp1d" and r["dp"] == 1)
    for r in results:
        if "loss" in r:
            r["loss_rel_diff_vs_dense"] = abs(r["loss"] - dense_loss) / abs(dense_loss)
            r["loss_rel_diff_vs_peer"] = abs(r["loss"] - peer_loss) / abs(peer_loss)
    return results


def hardware(run: Run) -> dict:
    """Matmul rate and memory bandwidth of this device, and collective rates for every group size."""
    dev = run.device
    if run.cpu:
        hw = {"matmul_tflops": measure.matmul_tflops(dev, torch.float32, 256, 5), "copy_GBps": measure.copy_gbps(dev, 2**22)}
        sizes, iters, small = (2**12, 2**16), 3, 2**10
    else:
        hw = {"matmul_tflops": measure.matmul_tflops(dev, torch.bfloat16, 8192), "copy_GBps": measure.copy_gbps(dev, 2**30)}
        sizes, iters, small = (2**20, 2**28), 10, 2**16
    hw["matmul_tflops"], hw["copy_GBps"] = (-v for v in measure.all_reduce_max([-hw["matmul_tflops"], -hw["copy_GBps"]], dev))
    hw["collectives"] = {str(g): measure.collective_rates(dev, g, sizes, iters, small) for g in range(2, run.world + 1) if run.world % g == 0}
    return hw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU, float32, tiny default shapes (smoke test)")
    parser.add_argument("--shapes", default=None, help="main shapes, e.g. 'h4096,n32,s2048,b8,L4;h8192,n64,s2048,b4,L2'")
    parser.add_argument("--extra-shapes", default=None, help="shapes timed on the full-size grids only (weak scaling)")
    parser.add_argument("--ab-grids", default=None, help="grids that also run the variants, e.g. '2x2x1,1x2x2'")
    parser.add_argument("--before", default=None, help="folder with matmul.py and norm.py of commit 4e34463 (variant 'before')")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--no-check", action="store_true", help="skip the float32 correctness check")
    parser.add_argument("--profile", action="store_true",
                        help="torch-profile the best 3-D grid (and the best with async-tp) and the peer on the last main shape")
    parser.add_argument("--profile-cases", default=None,
                        help="with --profile: the cases to profile instead, by label, e.g. '3d 2x2x1,3d 2x2x1 [async-tp]'")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="variants timed on the A/B grids")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    cpu = args.cpu
    os.environ[HIGH_PRIORITY] = "1"
    dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(seconds=300))
    run = Run(args)
    if not cpu:
        torch.cuda.set_device(run.device)
    world = run.world
    default_ab = {1: "1x1x1", 2: "2x1x1,1x2x1", 4: "4x1x1,1x4x1,2x2x1"}.get(world, "")
    args.ab_grids = default_ab if args.ab_grids is None else args.ab_grids
    if cpu:
        args.shapes = args.shapes or "h32,n4,s8,b8,L2"
        args.warmup, args.iters = args.warmup or 1, args.iters or 3
    else:
        args.shapes = args.shapes or "h4096,n32,s2048,b8,L4;h8192,n64,s2048,b4,L2"
        weak = {1: "h2048,n16,s2048,b8,L4", 2: "h3072,n24,s2048,b8,L4"}.get(world)
        args.extra_shapes = args.extra_shapes if args.extra_shapes is not None else (weak or "")
        args.warmup, args.iters = args.warmup or 5, args.iters or 20
    os.makedirs(args.out, exist_ok=True)
    meta = {"world": world, "device": "cpu" if cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
            "nccl": None if cpu else ".".join(map(str, torch.cuda.nccl.version())), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "commit": os.environ.get("BENCH_COMMIT", ""), "argv": sys.argv, "warmup": args.warmup, "iters": args.iters}
    hw = hardware(run)
    run.log(f"world {world} on {meta['device']}: matmul {hw['matmul_tflops']:.0f} TFLOP/s, copy {hw['copy_GBps']:.0f} GB/s")
    checks = []
    check_variants = [""] + (["async-tp"] if "async-tp" in args.variants.split(",") else [])
    if not args.no_check:
        check_shape = Shape(32, 4, 8, 8, 2) if cpu else Shape(128, 8, 32, 16, 2)
        with no_tf32():
            for c in range(world, 0, -1):
                if world % c == 0:
                    for g, variant in itertools.product(cube_grids(c), check_variants):
                        checks.append(check_grid(run, Case("3d", g, world // c, variant), check_shape))
                        run.log(f"  check {checks[-1]['case']:28s} max rel err {checks[-1]['max_rel_err']:.2e} {'ok' if checks[-1]['ok'] else 'FAILED'}")
    results = {}
    mains = [t for t in args.shapes.split(";") if t]
    for text, main in [(t, True) for t in mains] + [(t, False) for t in (args.extra_shapes or "").split(";") if t]:
        shape = Shape.parse(text)
        run.log(f"shape {shape.name} ({'main' if main else 'extra'})")
        cases = run_shape(run, shape, main, main and text == mains[-1], hw)
        results[shape.name] = {"shape": dataclasses.asdict(shape), "flops": shape.flops, "main": main, "cases": cases}
    if run.rank == 0:
        path = os.path.join(args.out, f"bench_w{world}.json")
        with open(path, "w") as f:
            json.dump({"meta": meta, "hardware": hw, "checks": checks, "results": results}, f, indent=1)
        import report

        print(report.tables([path]), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if any(not c["ok"] for c in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
