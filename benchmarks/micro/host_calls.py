"""How long the host takes to issue each call a 3-D product makes: µs per call, rank 0.

Launch two processes (``torchrun --nproc_per_node 2 benchmarks/micro/host_calls.py --out DIR``; gloo on
CPU without a GPU). On grid 2×1×1 at width 256 (``--width``: the GPU's work is negligible, the
host's is not) each call runs 300 times after 30 untimed; the host's time per call is measured, the
GPU synchronised only after. Calls: a product's custom op (``torch.ops.lightning_3d.matmul3d`` and
its backward, as compiled blocks call them on grids not cut over x only) against the same forward
and backward called as Python functions, the two ops a compiled product calls on a grid cut over x
only (the weight's gather; the backward GEMMs with dB's reduce-scatter), a weight gradient's reduce-scatter
left for the end of backward, one and four at a time, a block's flat weight gather, the collectives and stream
calls they make, and a custom op with a trivial body against the Python function alone: what dispatch costs.
Results go to ``DIR/host_calls.json``.

One process (``--nproc_per_node 1``) times only the products and the trivial op, on grid 1×1×1:
nothing is sent, so the custom op against the Python it runs is the dispatch alone, which gloo's
collectives on CPU (hundreds of µs) would hide; there take ``--width 16``, so that the products'
arithmetic does not hide it either.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning_3d  # noqa: E402
from lightning_3d import comm  # noqa: E402
from lightning_3d.ops import matmul as products  # noqa: E402
from lightning_3d.runtime import MatmulSchedule, Runtime  # noqa: E402

WARMUP, CALLS = 30, 300


def trivial(x: torch.Tensor, k: int) -> torch.Tensor:
    """The body of the custom op ``host_calls::trivial``: an empty tensor, no work."""
    return x.new_empty(0)


torch.library.custom_op("host_calls::trivial", trivial, mutates_args=())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--width", type=int, default=256, help="the model width h (even)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if dist.get_world_size() not in (1, 2):
        raise SystemExit(f"host_calls.py runs on 1 or 2 processes, not {dist.get_world_size()}")
    grid = lightning_3d.init_grid((dist.get_world_size(), 1, 1))
    gx, gy, gz = grid.group("x"), grid.group("y"), grid.group("z")
    px = grid.size("x")
    us: dict[str, float] = {}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(name: str, call) -> None:
        for _ in range(WARMUP):
            call()
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        us[name] = round((time.perf_counter() - start) / CALLS * 1e6, 1)
        sync()

    h, bf16 = args.width, torch.bfloat16
    a = torch.randn(4, 128, h, device=device, dtype=bf16)
    w = torch.nn.Parameter(torch.randn(h // px * 3, h, device=device))
    schedule = MatmulSchedule("abt", (gy, gx, gz), (1, px, 1), True, bf16, True, False, 1, False)
    runtime = Runtime()
    op_args = products._op_args(schedule, runtime)
    grad_full = torch.randn(h * 3, h, device=device, dtype=bf16)
    block = [torch.randn(h * 3, h, device=device, dtype=bf16) for _ in range(4)]
    weights = [torch.nn.Parameter(torch.randn(h // px * 3, h, device=device)) for _ in range(4)]

    def left_for_end(grads, together: int) -> None:
        for g, weight in zip(grads, weights):
            runtime.late_grads.scatter_at_end(g, gx, weight, together)
        runtime.late_grads.pending.clear()

    def block_gather() -> None:
        _, handle = comm.all_gather_dim0_together(weights, gx, bf16, streams=runtime.streams)
        handle.wait()

    def beside() -> None:
        with runtime.streams.beside("weight gradients", grad_full):
            pass

    with torch.no_grad():
        c, _, kept_b = products._forward(schedule, runtime, a, w, None)
        grad_c = torch.randn_like(c)
        shapes = [a.dim(), *a.shape, *w.shape]
        timed("product forward, custom op", lambda: torch.ops.lightning_3d.matmul3d(a, w, None, *op_args))
        timed("product forward, Python", lambda: products._forward(schedule, runtime, a, w, None))
        timed(
            "product backward, custom op",
            lambda: torch.ops.lightning_3d.matmul3d_backward(
                grad_c, a, kept_b, w, shapes, bf16, torch.float32, bf16, [True, True, False], *op_args
            ),
        )
        timed(
            "product backward, Python",
            lambda: products._backward(schedule, runtime, grad_c, a, kept_b, (True, True, False), w),
        )
        w_full = torch.ops.lightning_3d.gathered_weight(w, *op_args)
        timed(
            "x-grid product, the weight's gather op",
            lambda: torch.ops.lightning_3d.gathered_weight(w, *op_args),
        )
        timed(
            "x-grid product, its backward op",
            lambda: torch.ops.lightning_3d.gathered_product_backward(grad_c, a, w_full, w, True, *op_args),
        )
        timed("custom op, trivial body", lambda: torch.ops.host_calls.trivial(a, 1))
        timed("its Python function", lambda: trivial(a, 1))
        timed("F.linear", lambda: F.linear(a, grad_full))
        if px > 1:  # what moves data between ranks
            timed("4 weight gradients left for the end, one by one", lambda: left_for_end(block, 1))
            timed("4 weight gradients left for the end, as one", lambda: left_for_end(block, 4))
            timed("a block's 4 weights gathered as one, copied out", block_gather)
            timed("reduce_scatter_dim0", lambda: comm.reduce_scatter_dim0(grad_full, gx))
            timed("all_gather_dim0", lambda: comm.all_gather_dim0(w.detach(), gx))
            timed("SideStreams.beside, empty", beside)
    if rank == 0:
        for name, t in us.items():
            print(f"{t:9.1f} us  {name}")
        meta = {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": os.environ.get("BENCH_COMMIT", ""),
            "argv": sys.argv,
            "calls": CALLS,
            "width": h,
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_calls.json"), "w") as f:
            json.dump({"meta": meta, "us_per_call": us}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
