"""Peak host memory of ``parallelize`` on CPU: a materialised DenseGPT, and the same model built on ``meta``.

Each rank of a gloo world (one process per rank) builds the model, then parallelizes it on the
grid; the peak resident set (Linux ``VmHWM``, reset just before ``parallelize`` through
``/proc/self/clear_refs``) is compared with the dense model's size and this rank's shards.

    python benchmarks/micro/parallelize_memory.py --grid 2 2 1 --layers 8 --width 1024
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MB = 2**20


def _status(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _nbytes(tensors) -> float:
    seen = {}
    for t in tensors:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values()) / MB


def _measure(build: str, config, grid) -> dict:
    from lightning_3d.models import DenseGPT
    from lightning_3d.parallel import parallelize

    torch.manual_seed(0)
    base = _status("VmRSS")
    model = DenseGPT(config, device="meta" if build == "meta" else "cpu")
    dense = _nbytes(model.parameters())  # meta tensors have sizes too
    before = _status("VmRSS")
    _reset_peak()
    parallelize(model, grid=grid, device="cpu")
    return {
        "build": build,
        "dense_mb": round(dense, 1),
        "shards_mb": round(_nbytes(model.parameters()), 1),
        "rss_before_mb": round(before - base, 1),
        "peak_during_mb": round(_status("VmHWM") - base, 1),
        "rss_after_mb": round(_status("VmRSS") - base, 1),
    }


def _worker(rank: int, world: int, port: int, args, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import lightning_3d
    from lightning_3d.models import GPTConfig

    grid = lightning_3d.init_grid(tuple(args.grid))
    config = GPTConfig(
        vocab_size=args.vocab, block_size=256, n_layer=args.layers, n_head=16, n_embd=args.width
    )
    row = _measure(args.build, config, grid)
    out.put((rank, row))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--grid", type=int, nargs=3, default=[2, 2, 1])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    world = args.grid[0] * args.grid[1] * args.grid[2]
    rows = []
    for build in ("materialised", "meta"):  # fresh processes for each: VmHWM and the allocator start clean
        args.build = build
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, world, port, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        rows.append(results[0])
    print(
        f"DenseGPT {args.layers}×{args.width}, vocab {args.vocab}, fp32, grid "
        f"{'×'.join(map(str, args.grid))}, rank 0 (MiB):"
    )
    print("| build | dense model | this rank's shards | RSS before parallelize | peak during | RSS after |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['build']} | {r['dense_mb']} | {r['shards_mb']} | {r['rss_before_mb']} | "
            f"{r['peak_during_mb']} | {r['rss_after_mb']} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
