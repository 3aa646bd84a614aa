"""The elementwise work beside a packed product, compiled: SwiGLU on the packed gate/up output and
RoPE on the packed q/k/v output, forward + backward, at the local shapes of a 3-D block.

Each three ways: on views of the packed output with autograd assembling the packed gradient (a
concatenation, which Inductor lowers as a pointwise one: each element computes and loads what
either group needs), as :mod:`lightning_3d.ops.packed_elementwise` runs it (a backward kernel that
writes the packed gradient in one pass), and on separate tensors, as a dense model with one product
per group runs it (no packed gradient: the reference); the GPU's time, and the wall time, which
at these sizes the host's launches set. One GPU: ``python
benchmarks/micro/packed_elementwise.py --out DIR``; defaults are a Llama-7B block's local shapes on
2×1×1 (4 sequences of 2048 tokens, 32 heads of 128 over 8 key/value heads, ffn 11008). ``--cpu``:
the same cases at tiny shapes on CPU, wall time only (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_3d.models.attention import apply_rope, rope_tables  # noqa: E402
from lightning_3d.ops.packed_elementwise import packed_rope, packed_swiglu  # noqa: E402


def swiglu_on_views(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.unbind(-2)
    return F.silu(gate) * up


def rope_on_views(qkv: torch.Tensor, rope, r: int) -> tuple[torch.Tensor, ...]:
    """RoPE on views of ``qkv [b, s, P, r + 2, T, d]``, the heads then put in attention's order."""
    q, k, v = qkv.split([r, 1, 1], 3)
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    return tuple(t.flatten(2, -2) for t in (q.transpose(-3, -2), k, v))


def time_us(fn, inputs: tuple, repeats: int, cuda: bool) -> tuple[float, float | None]:
    """µs per forward + backward of ``fn(*inputs)`` (fixed random output gradients, the input
    gradients returned, not accumulated), after warm-up: the wall time, which at these sizes the
    host's launches set, and on CUDA the GPU time, the sum of the kernels' times (``torch.profiler``)."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = tuple(torch.randn_like(o) for o in outs)

    def once():
        out = fn(*inputs)
        torch.autograd.grad(out if isinstance(out, tuple) else (out,), inputs, grads)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        once()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    sync()
    wall_us = (time.perf_counter() - start) * 1e6 / repeats
    if not cuda:
        return wall_us, None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            once()
        sync()
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0)
    return wall_us, gpu_us / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--px", type=int, default=2, help="blocks each group's output comes in (the x size)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--queries-per-kv", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--cpu", action="store_true", help="a smoke test: float32 on CPU, tiny shapes, wall time only"
    )
    args = parser.parse_args()
    if args.cpu:
        args.batch, args.seq, args.kv_heads, args.queries_per_kv, args.head_dim, args.ffn, args.repeats = (
            2,
            16,
            2,
            2,
            8,
            64,
            2,
        )
    device, dtype = (
        (torch.device("cpu"), torch.float32) if args.cpu else (torch.device("cuda"), torch.bfloat16)
    )
    b, s, p, r, d = args.batch, args.seq, args.px, args.queries_per_kv, args.head_dim
    rope = rope_tables(s, d, 10000.0, device)

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    qkv, gate_up = leaf(b, s, p, r + 2, args.kv_heads // p, d), leaf(b, s, p, 2, args.ffn // p)
    q, k, v = leaf(b, s, args.kv_heads * r, d), leaf(b, s, args.kv_heads, d), leaf(b, s, args.kv_heads, d)
    gate, up = leaf(b, s, args.ffn), leaf(b, s, args.ffn)
    cases = {
        "swiglu on views": (swiglu_on_views, (gate_up,)),
        "swiglu, packed_swiglu": (packed_swiglu, (gate_up,)),
        "swiglu on separate gate and up": (lambda g, u: F.silu(g) * u, (gate, up)),
        "rope on views": (lambda x: rope_on_views(x, rope, r), (qkv,)),
        "rope, packed_rope": (lambda x: packed_rope(x, rope, r), (qkv,)),
        "rope on separate q, k, v": (
            lambda q, k, v: (apply_rope(q, rope), apply_rope(k, rope), v),
            (q, k, v),
        ),
    }
    results = {}
    for name, (fn, inputs) in cases.items():
        torch.compiler.reset()
        wall, gpu = time_us(torch.compile(fn), inputs, args.repeats, device.type == "cuda")
        results[name] = {"wall_us": wall, "gpu_us": gpu}
        on_gpu = "" if gpu is None else f"{gpu:7.1f} µs of GPU kernels, "
        print(f"{name:32s} forward + backward: {on_gpu}{wall:7.1f} µs wall", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = {
            "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "commit": os.environ.get("BENCH_COMMIT", ""),
            "argv": sys.argv,
            "args": vars(args),
            "us": results,
        }
        with open(os.path.join(args.out, "packed_elementwise.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
