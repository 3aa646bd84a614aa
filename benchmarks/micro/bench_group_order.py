"""Micro-benchmark: a packed product's groups read where the x gather leaves them, or copied into order first.

With px > 1 a ``FusedLinear3D``'s product comes out ``[b, s, px, groups, out/px]``. Two ways to
make attention's heads and SwiGLU's input from it, each ``torch.compile``d, forward and backward:

- ``rope``: q and k put in head order first, then rotated (the order before RoPE moved), against
  rotated on each head where the product leaves it and put in order after (what the model does).
- ``swiglu``: gate and up as views ``[..., px, ffn/px]`` of the product, against a dense ``[N, 2·ffn]``
  output chunked in two (what a model with a packed ``nn.Linear`` runs).

``python benchmarks/micro/bench_group_order.py`` (CUDA, bf16, one layer at Llama shapes on 3d 2×1×1)
prints ms a call; ``--cpu`` runs tiny shapes in float32 and checks that both orders agree.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_3d.models.attention import apply_rope, rope_tables  # noqa: E402


def heads_then_rope(y: torch.Tensor, r: int, d: int, rope) -> tuple[torch.Tensor, ...]:
    """``y`` ``[b, s, px, r + 2, kv·d/px]`` → q ``[b, s, r·kv, d]`` (head t·r + g), k, v; groups and heads
    copied into order, then rotated."""
    packed = y.transpose(-3, -2).flatten(-3)
    width = packed.shape[-1] // (r + 2)  # of one group
    q, k, v = packed.split([r * width, width, width], -1)
    q = q.unflatten(-1, (r, -1, d)).transpose(-3, -2).flatten(-3)
    q, k, v = (t.unflatten(-1, (-1, d)) for t in (q, k, v))
    return apply_rope(q, rope), apply_rope(k, rope), v


def rope_then_heads(y: torch.Tensor, r: int, d: int, rope) -> tuple[torch.Tensor, ...]:
    """The same outputs, each head rotated where the product leaves it, then put in order (as ``DenseAttention``)."""
    q, k, v = (t.unflatten(-1, (-1, d)) for t in y.split([r, 1, 1], -2))
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    return tuple(t.flatten(2, -2) for t in (q.transpose(-3, -2), k, v))


def swiglu_views(y: torch.Tensor) -> torch.Tensor:
    """``y`` ``[N, px, 2, ffn/px]`` → ``[N, ffn]``."""
    gate, up = y.unbind(-2)
    return (F.silu(gate) * up).flatten(-2)


def swiglu_dense(y: torch.Tensor) -> torch.Tensor:
    """``y`` ``[N, 2·ffn]`` → ``[N, ffn]``."""
    gate, up = y.chunk(2, -1)
    return F.silu(gate) * up


def time_ms(fn, inputs: list[torch.Tensor], iters: int) -> tuple[float, float, tuple]:
    """Forward ms and forward + backward ms a call of ``torch.compile(fn)``, and its outputs."""
    compiled = torch.compile(fn)

    def run():
        out = compiled(*inputs)
        return out if isinstance(out, tuple) else (out,)

    grads = [torch.randn_like(o) for o in run()]
    for _ in range(3):
        torch.autograd.backward(run(), grads)
    times = []
    for backward in (False, True):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            out = run()
            if backward:
                torch.autograd.backward(out, grads)
        sync()
        times.append((time.perf_counter() - start) * 1e3 / iters)
    return times[0], times[1], tuple(o.detach() for o in run())


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu", action="store_true", help="tiny shapes in float32 on CPU; check that the orders agree"
    )
    parser.add_argument("--px", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    device, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
    # tokens b·s of one rank at 3d 2×1×1 (global batch 8), Llama-7B's heads and MLP
    b, s, r, kv, d, ffn = (2, 16, 4, 8, 16, 48) if args.cpu else (4, 2048, 4, 8, 128, 11008)
    torch.manual_seed(0)
    rope = rope_tables(s, d, 10000.0, device)
    y = torch.randn(b, s, args.px, r + 2, kv * d // args.px, device=device, dtype=dtype, requires_grad=True)
    results = {
        name: time_ms(lambda t, fn=fn: fn(t, r, d, rope), [y], args.iters)
        for name, fn in (
            ("rope: heads then rope", heads_then_rope),
            ("rope: rope then heads", rope_then_heads),
        )
    }
    g = torch.randn(b * s, args.px, 2, ffn // args.px, device=device, dtype=dtype, requires_grad=True)
    dense = torch.randn(b * s, 2 * ffn, device=device, dtype=dtype, requires_grad=True)
    results["swiglu: views of the product"] = time_ms(swiglu_views, [g], args.iters)
    results["swiglu: dense chunks"] = time_ms(swiglu_dense, [dense], args.iters)
    for name, (fwd, both, _) in results.items():
        print(f"{name:30s} forward {fwd:.3f} ms   forward + backward {both:.3f} ms")
    first, second = (results[k][2] for k in ("rope: heads then rope", "rope: rope then heads"))
    differ = max(float((a - c).abs().max()) for a, c in zip(first, second))
    print(f"largest difference between the two orders: {differ:.3g}")
    if args.cpu and differ > 1e-6:
        raise SystemExit("the two orders disagree")


if __name__ == "__main__":
    main()
