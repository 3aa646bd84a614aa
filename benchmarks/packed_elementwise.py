"""The elementwise work beside a packed product, compiled: SwiGLU on the packed gate/up output and
RoPE on the packed q/k/v output, forward + backward, as a 3-D block with px > 1 runs them.

Their backward writes one packed gradient (the product's ``dC``), which Inductor lowers as a
concatenation: by default a pointwise one (each output element computes and loads what either
half needs), or, with ``max_complex_pointwise_cat_inputs`` and ``max_pointwise_cat_inputs`` at 1,
into place (each half's kernel writes its slice). Times each way, RoPE also written as the
concatenation of its two rotated halves (no concatenation inside it), against SwiGLU on separate
gate and up tensors (a dense model's two products). One GPU: ``python benchmarks/packed_elementwise.py
--out DIR``; defaults are a Llama-7B block's local shapes on 2×1×1 (4 sequences of 2048 tokens, 32
heads of 128 over 8 key/value heads, ffn 11008).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_3d.models.attention import apply_rope, rope_tables  # noqa: E402
from lightning_3d.models.mlp import mlp_activation  # noqa: E402

IN_PLACE = {"max_complex_pointwise_cat_inputs": 1, "max_pointwise_cat_inputs": 1}


def rope_halves(x: torch.Tensor, rope) -> torch.Tensor:
    """:func:`apply_rope` as the concatenation of its two rotated halves."""
    cos, sin = (t[: x.shape[1]].view(x.shape[1], *[1] * (x.dim() - 3), -1).to(x.dtype) for t in rope)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]], -1)


def attention_inputs(packed: torch.Tensor, rope, rotate, queries_per_kv: int, head_dim: int) -> tuple:
    """``DenseAttention``'s work between its product and attention, on ``[b, s, P, r + 2, kv/P·d]``."""
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in packed.split([queries_per_kv, 1, 1], -2))
    q, k = rotate(q, rope), rotate(k, rope)
    return tuple(t.flatten(2, -2) for t in (q.transpose(-3, -2), k, v))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``DenseMLP``'s activation on ``[b, s, P, 2, ffn/P]``."""
    return mlp_activation("llama", *gate_up.unbind(-2)).flatten(-2)


def time_ms(fn, inputs: tuple, repeats: int) -> float:
    """Median-free mean ms of ``fn(*inputs)`` forward + backward (random output gradients), after warm-up."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = tuple(torch.randn_like(o) for o in outs)

    def once():
        out = fn(*inputs)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), grads)

    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--px", type=int, default=2, help="blocks each group's output comes in (the x size)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--queries-per-kv", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device, bf16 = torch.device("cuda"), torch.bfloat16
    b, s, p = args.batch, args.seq, args.px
    rope = rope_tables(s, args.head_dim, 10000.0, device, bf16)
    qkv = torch.randn(b, s, p, args.queries_per_kv + 2, args.kv_heads // p * args.head_dim, device=device, dtype=bf16, requires_grad=True)
    gate_up = torch.randn(b, s, p, 2, args.ffn // p, device=device, dtype=bf16, requires_grad=True)
    gate, up = (torch.randn(b, s, args.ffn, device=device, dtype=bf16, requires_grad=True) for _ in range(2))
    cases = {}
    for lowering, options in (("pointwise", {}), ("in place", IN_PLACE)):
        for name, rotate in (("rope", apply_rope), ("rope as halves", rope_halves)):
            cases[f"{name}, {lowering}"] = (lambda x, rotate=rotate: attention_inputs(x, rope, rotate, args.queries_per_kv, args.head_dim),
                                           (qkv,), options)
        cases[f"swiglu, {lowering}"] = (swiglu, (gate_up,), options)
    cases["swiglu on separate gate and up"] = (lambda g, u: mlp_activation("llama", g, u), (gate, up), {})
    results = {}
    for name, (fn, inputs, options) in cases.items():
        torch.compiler.reset()
        results[name] = time_ms(torch.compile(fn, options=options), inputs, args.repeats)
        print(f"{name:34s} {results[name] * 1000:8.1f} µs forward + backward", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("BENCH_COMMIT"),
                  "args": vars(args), "ms": results}
        with open(os.path.join(args.out, "packed_elementwise.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
