"""SwiGLU and RoPE on a packed product's output: outputs and the packed gradient against autograd
of the plain formulas on views (float64, CPU), and the CUDA kernels against the PyTorch backward
(on a GPU, eager and compiled)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from lightning_3d.models.attention import rope_tables
from lightning_3d.ops import packed_elementwise
from lightning_3d.ops.packed_elementwise import packed_rope, packed_swiglu

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "micro")
)
from packed_elementwise import rope_on_views as plain_rope  # noqa: E402  (autograd of the plain formulas on views)
from packed_elementwise import swiglu_on_views as plain_swiglu  # noqa: E402


def outputs_and_grad(
    fn, x: torch.Tensor, grads: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    x = x.detach().requires_grad_()
    out = fn(x)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(out, grads)
    return tuple(o.detach() for o in out), x.grad


def rope_case(device="cpu", dtype=torch.float64, b=2, s=6, p=2, r=3, t=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, p, r + 2, t, d, generator=gen, dtype=torch.float64).to(device, dtype)
    rope = rope_tables(
        s + 3, d, 10000.0, device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32
    )
    grads = tuple(
        torch.randn(b, s, n, d, generator=gen, dtype=torch.float64).to(device, dtype)
        for n in (p * t * r, p * t, p * t)
    )
    return qkv, rope, r, grads


@pytest.mark.parametrize("shape", [(3, 5, 2, 7), (4, 1, 2, 6)])
def test_packed_swiglu_equals_autograd_of_the_views(shape):
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(shape, generator=gen, dtype=torch.float64)
    grad = torch.randn(shape[:-2] + shape[-1:], generator=gen, dtype=torch.float64)
    (out,), dx = outputs_and_grad(packed_swiglu, gate_up, (grad,))
    (ref,), ref_dx = outputs_and_grad(plain_swiglu, gate_up, (grad,))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    assert dx.abs().min(-1).values.min() > 0  # both halves written
    assert torch.autograd.gradcheck(packed_swiglu, (gate_up.requires_grad_(),))


@pytest.mark.parametrize("blocks", [(1, 4, 1), (2, 3, 2), (2, 1, 1)])  # (P, r, T)
def test_packed_rope_equals_autograd_of_the_views(blocks):
    p, r, t = blocks
    qkv, rope, r, grads = rope_case(p=p, r=r, t=t)
    out, dx = outputs_and_grad(lambda x: packed_rope(x, rope, r), qkv, grads)
    ref, ref_dx = outputs_and_grad(lambda x: plain_rope(x, rope, r), qkv, grads)
    for o, e in zip(out, ref):
        torch.testing.assert_close(o, e, rtol=1e-12, atol=1e-12)
    assert all(o.is_contiguous() for o in out)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x: packed_rope(x, rope, r), (qkv[:1, :3].clone().requires_grad_(),)
    )


def test_bad_packed_shapes_are_named():
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, n\].*\(3, 5\)"):
        packed_swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"2 \+ 2.*\(1, 4, 1, 3, 2, 8\)"):
        packed_rope(torch.randn(1, 4, 1, 3, 2, 8), rope_tables(4, 8, 10000.0), 2)


cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or packed_elementwise.packed_kernels is None,
    reason="the Triton kernels run on CUDA",
)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(
    "blocks", [(2, 4, 2, 128), (1, 1, 3, 96)]
)  # (P, r, T, head_dim): 96 pads to 128 lanes
def test_kernels_equal_the_pytorch_backward(dtype, compiled, blocks):
    """The Triton backward (on CUDA) against the same Function's PyTorch backward (on CPU, float64)."""
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    swiglu, rope_fn = packed_swiglu, packed_rope
    if compiled:
        torch.compiler.reset()
        swiglu, rope_fn = (
            torch.compile(packed_swiglu, fullgraph=True),
            torch.compile(packed_rope, fullgraph=True),
        )
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(2, 5, 2, 2, 1000, generator=gen, dtype=torch.float64)
    grad = torch.randn(2, 5, 2, 1000, generator=gen, dtype=torch.float64)
    _, dx = outputs_and_grad(swiglu, gate_up.to("cuda", dtype), (grad.to("cuda", dtype),))
    _, ref = outputs_and_grad(packed_swiglu, gate_up.to(dtype).double(), (grad.to(dtype).double(),))
    torch.testing.assert_close(dx.double().cpu(), ref, **tol)
    p, r, t, d = blocks
    qkv, rope, r, grads = rope_case(b=2, s=33, p=p, r=r, t=t, d=d)
    on_gpu = [x.to("cuda", dtype) for x in (qkv, *grads)]
    gpu_rope = tuple(t.float().cuda() for t in rope)
    out, dx = outputs_and_grad(lambda x: rope_fn(x, gpu_rope, r), on_gpu[0], tuple(on_gpu[1:]))
    ref_out, ref = outputs_and_grad(
        lambda x: packed_rope(x, rope, r), qkv.to(dtype).double(), tuple(g.to(dtype).double() for g in grads)
    )
    torch.testing.assert_close(dx.double().cpu(), ref, **tol)
    for o, e in zip(out, ref_out):
        torch.testing.assert_close(o.double().cpu(), e, **tol)
