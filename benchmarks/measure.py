"""What the benchmark measures besides models: device rates, step timing, and profiler timelines.

Every function runs on every rank (collectives inside are matched) and works on CUDA (NCCL) and
on CPU (gloo, tiny sizes, for the smoke test).
"""

from __future__ import annotations

import gzip
import json
import os
import time

import torch

from lightning_3d.cost import machine
from lightning_3d.cost.machine import matmul_tflops  # noqa: F401 (the benchmarks' device rate)


class Timer:
    """Marks inside one step; ``split()`` after the step gives the ms between consecutive marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def split(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            out = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        else:
            out = [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]
        self.marks = []
        return out


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    return machine.slowest(values, device)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union ``a`` not covered by union ``b`` (both sorted, disjoint)."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


TOP_KERNELS = 40  # the longest kernels by name a timeline lists

# Names of the kernels that move data between GPUs or wait for peers: NCCL's, and the barrier,
# signal and spin kernels of PyTorch's symmetric-memory pipelines.
COMM_KERNELS = ("nccl", "barrier", "signal", "spin_kernel")


def _is_comm(event: dict) -> bool:
    """Communication: a copy (peer copies of the symmetric-memory pipelines, and the local copies
    next to them) or a kernel named in :data:`COMM_KERNELS`. Memsets count as neither side."""
    if event.get("cat") == "gpu_memcpy":
        return True
    name = event.get("name", "").lower()
    return any(k in name for k in COMM_KERNELS)


# Kernel kinds by name, first match wins; anything else is "other" (eager elementwise, reductions, copies).
KERNEL_KINDS = (
    ("communication", COMM_KERNELS),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("attention", ("flash", "fmha", "attention")),
    ("compiled", ("triton",)),
)


def kernel_kind(event: dict) -> str:
    """``communication``, ``matmul``, ``attention``, ``compiled`` (Inductor's Triton kernels), ``memset`` or
    ``other``."""
    if _is_comm(event):
        return "communication"
    if event.get("cat") == "gpu_memset":
        return "memset"
    name = event.get("name", "").lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in name for w in words)), "other")


MOST_EXPOSED = 12  # the collectives reported one by one, most exposed first
HOST_TOP = 15  # the host ops reported by their own CPU time


def kernel_timeline(trace_path: str) -> dict:
    """From a chrome trace: ms of GPU time with communication running and no compute kernel
    (exposed communication, also by collective, and the most exposed collectives one by one as
    ``[collective, k-th of its name in the trace, exposed ms, ms]``), of anything running (busy), of nothing running
    between the first and last kernel (idle, and its longest gaps with the kernels on either side), of
    communication in all, the summed time and count of kernels of each :func:`kernel_kind`, and the longest
    kernels by name (ms, count)."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    moving, computing, other = [], [], []
    by_collective: dict[str, list[tuple[float, float]]] = {}
    by_name: dict[str, list] = {}  # name → [ms, count]
    by_kind: dict[str, list] = {}
    kernels = []  # (start, end, name) of every GPU event
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            span = (e["ts"], e["ts"] + e["dur"])
            kernels.append((*span, e["name"][:60]))
            if _is_comm(e):
                moving.append(span)
                by_collective.setdefault(_collective(e["name"]), []).append(span)
            else:
                (other if e["cat"] == "gpu_memset" else computing).append(span)
            named = by_name.setdefault(e["name"][:80], [0.0, 0])
            named[0] += e["dur"] / 1e3
            named[1] += 1
            kind = by_kind.setdefault(kernel_kind(e), [0.0, 0])
            kind[0] += e["dur"] / 1e3
            kind[1] += 1
    moving_u, computing_u = _union(moving), _union(computing)
    busy = _union(moving + computing + other)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    exposed_by_collective = {
        name: round(_minus(_union(spans), computing_u) / 1e3, 3) for name, spans in by_collective.items()
    }
    each_exposed = [
        [name, k, round(_minus([span], computing_u) / 1e3, 3), round((span[1] - span[0]) / 1e3, 3)]
        for name, spans in by_collective.items()
        for k, span in enumerate(sorted(spans))
    ]
    return {
        "exposed_comm_ms": _minus(moving_u, computing_u) / 1e3,
        "comm_ms": _length(moving_u) / 1e3,
        "exposed_by_collective_ms": exposed_by_collective,
        "most_exposed": sorted(each_exposed, key=lambda e: -e[2])[:MOST_EXPOSED],
        "busy_ms": _length(busy) / 1e3,
        "idle_ms": (busy[-1][1] - busy[0][0] - _length(busy)) / 1e3 if busy else 0.0,
        "longest_idle_ms": _longest_gaps(busy, kernels, 5),
        "kernels": len(moving) + len(computing) + len(other),
        "by_kind_ms_count": {k: [round(ms, 3), n] for k, (ms, n) in sorted(by_kind.items())},
        "top_kernels_ms": [[name, round(ms, 3), n] for name, (ms, n) in top],
    }


def _longest_gaps(
    busy: list[tuple[float, float]], kernels: list[tuple[float, float, str]], n: int
) -> list[list]:
    """The ``n`` longest spans in which the GPU ran nothing: ``[ms, kernel that ended, kernel that started]``."""
    ends = {round(e, 3): name for _, e, name in kernels}
    starts = {round(s, 3): name for s, _, name in kernels}
    gaps = sorted(((b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:])), reverse=True)[:n]
    return [[round(g / 1e3, 3), ends.get(round(e, 3), "?"), starts.get(round(s, 3), "?")] for g, e, s in gaps]


COLLECTIVES = ("AllGather", "ReduceScatter", "AllReduce", "SendRecv", "Broadcast")


def _collective(name: str) -> str:
    """A communication kernel's collective: an NCCL kernel's op and dtype as named (``AllGather``,
    ``ReduceScatter_Sum_bf16``, ...), ``copy or barrier`` for the rest."""
    return next(
        (
            name[name.index(c) :].split("(")[0].split("_RING")[0].split("_TREE")[0]
            for c in COLLECTIVES
            if c in name
        ),
        "copy or barrier",
    )


def nccl_kernels(trace_path: str) -> dict[str, list[tuple[float, float]]]:
    """The NCCL kernels of a chrome trace by name, each list in start order, as ``(start, end)`` in
    µs of wall-clock time (``baseTimeNanoseconds`` + ``ts``: comparable across the processes of a host)."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        trace = json.load(f)
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    out: dict[str, list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e.get("cat") == "kernel" and "dur" in e and "nccl" in e.get("name", "").lower():
            out.setdefault(e["name"], []).append((base + e["ts"], base + e["ts"] + e["dur"]))
    return {name: sorted(spans) for name, spans in out.items()}


def peer_waits(per_rank: list[dict[str, list[tuple[float, float]]]]) -> dict:
    """How long each rank's collectives waited for the last rank to arrive, and how long they ran after.

    ``per_rank``: every rank's :func:`nccl_kernels`. The k-th kernel of a name on every rank is
    taken to be one collective, which holds where every collective spans all ranks (data
    parallelism, FSDP, a cube of one axis); a name whose count differs between ranks is left out.
    Returns ``waited_ms`` and ``moving_ms`` per rank and the ``collectives`` matched.
    """
    ranks = len(per_rank)
    waited, moving, matched = [0.0] * ranks, [0.0] * ranks, 0
    for name in sorted(set().union(*per_rank)):
        spans = [r.get(name, []) for r in per_rank]
        if len({len(s) for s in spans}) != 1:
            continue
        for k in range(len(spans[0])):
            last = max(s[k][0] for s in spans)
            for r in range(ranks):
                start, end = spans[r][k]
                waited[r] += max(0.0, min(last, end) - start)
                moving[r] += max(0.0, end - last)
            matched += 1
    return {
        "waited_ms": [round(w / 1e3, 3) for w in waited],
        "moving_ms": [round(m / 1e3, 3) for m in moving],
        "collectives": matched,
    }


def host_profile(step, steps: int, top: int = 30) -> list:
    """Run ``step()`` ``steps`` times under Python's cProfile (the host only; the GPU is synchronised
    before and after) and return the ``top`` Python functions and builtins by their own time:
    ``[name, calls a step, own ms a step, cumulative ms a step]`` (cProfile's own cost inflates
    Python calls alike)."""
    import cProfile
    import pstats

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    if cuda:
        torch.cuda.synchronize()
    stats = pstats.Stats(
        profiler
    ).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [
        [
            f"{os.path.basename(file)}:{line}({name})" if line else name,
            round(calls / steps, 1),
            round(own * 1e3 / steps, 3),
            round(cum * 1e3 / steps, 3),
        ]
        for (file, line, name), (_, calls, own, cum, _) in rows
    ]


def profile_steps(step, steps: int, trace_path: str) -> dict:
    """Run ``step()`` ``steps`` times under the torch profiler; write a gzipped chrome trace and
    return its :func:`kernel_timeline`, with ``host_top_self_ms``: the host's ``HOST_TOP`` most
    costly ops and runtime calls by their own CPU time, ``[name, ms, calls]`` (the profiler's own
    cost inflates them alike)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    host_top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:HOST_TOP]
    raw = trace_path[:-3] if trace_path.endswith(".gz") else trace_path
    prof.export_chrome_trace(raw)
    if raw != trace_path:
        with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
            dst.write(src.read())
        os.remove(raw)
    timeline = kernel_timeline(trace_path)
    timeline["host_top_self_ms"] = [[e.key, round(e.self_cpu_time_total / 1e3, 3), e.count] for e in host_top]
    return timeline
