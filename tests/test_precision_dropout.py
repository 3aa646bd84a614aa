"""bf16 autocast on CPU, Dropout3D's RNG scheme, and the import boundary of the core."""

import subprocess
import sys

import harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from checks import local, on_grids, rel, seed_for
from torch.utils.checkpoint import checkpoint

from lightning_3d import CrossEntropyLoss3D, Dropout3D, LayerNorm3D, Linear3D


def autocast_job(grid):
    torch.manual_seed(50)
    ln, fc1, fc2 = (
        LayerNorm3D(16, grid=grid),
        Linear3D(16, 32, grid=grid),
        Linear3D(32, 16, input_layout="y", grid=grid),
    )
    torch.manual_seed(seed_for(grid, 51))
    x = local(torch.randn(4, 5, 16) * 2 + 1, "z", grid)

    def run():
        return fc2(F.gelu(fc1(ln(x))))

    ref = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run()
        logits = fc1(ln(x))
        loss = CrossEntropyLoss3D(grid=grid)(logits, torch.randint(0, 32, (4, 5)))
    loss.backward()
    return {
        "out_dtype": str(y.dtype),
        "err": rel(y.float(), ref),
        "loss_dtype": str(loss.dtype),
        "grad_dtype": str(fc1.weight.grad.dtype),
        "grad_finite": bool(torch.isfinite(fc1.weight.grad).all()),
    }


def saved_weights_job(grid):
    """Under bf16 autocast a weight gathered over a group of one is saved as the float32 parameter itself
    (backward casts it again) instead of as a bf16 copy; the gradients are those of re-gathering."""
    from lightning_3d.options import RuntimeOptions
    from lightning_3d.parallel import set_options

    torch.manual_seed(52)
    fc = Linear3D(16, 32, grid=grid, options=RuntimeOptions())
    torch.manual_seed(seed_for(grid, 53))
    x = local(torch.randn(4, 5, 16), "z", grid)
    grads, saved = [], []
    for save_gathered in (True, False):
        set_options(fc, save_gathered=save_gathered)
        fc.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = fc(x)
        (y.float() ** 2).sum().backward()
        grads.append(fc.weight.grad.clone())
    weight_like = [t for t in saved if t.dim() == 2 and t.shape[-1] == fc.weight.shape[-1]]
    return {
        "param_saved": any(
            t.untyped_storage().data_ptr() == fc.weight.untyped_storage().data_ptr() for t in weight_like
        ),
        "bf16_weight_copies": sum(t.dtype == torch.bfloat16 for t in weight_like),
        "grads_equal": bool(torch.equal(grads[0], grads[1])),
    }


def test_weights_saved_for_backward_under_autocast():
    results = harness.run(4, on_grids, [(1, 2, 1), (2, 1, 1)], saved_weights_job)
    for r in results:
        assert r[(1, 2, 1)] == {"param_saved": True, "bf16_weight_copies": 0, "grads_equal": True}, r
        # px = 2: save_gathered keeps the gathered bf16 weight; save_gathered=False keeps the parameter
        assert r[(2, 1, 1)] == {"param_saved": True, "bf16_weight_copies": 1, "grads_equal": True}, r


def test_bf16_autocast_on_cpu():
    for r in harness.run(8, on_grids, [(2, 2, 2), (1, 2, 1)], autocast_job):
        for shape, res in r.items():
            assert res["out_dtype"] == "torch.bfloat16" and res["loss_dtype"] == "torch.float32", (shape, res)
            assert res["grad_dtype"] == "torch.float32" and res["grad_finite"], (shape, res)
            assert 1e-4 < res["err"] < 2e-2, (shape, res)  # bf16 arithmetic happened, and stayed close


def dropout_job(grid):
    torch.manual_seed(60)  # the same seed everywhere, as a training script sets it
    drop = Dropout3D(0.3)
    fc = Linear3D(8, 12, grid=grid, dtype=torch.float64)
    torch.manual_seed(61)
    x = local(torch.randn(4, 3, 8, dtype=torch.float64), "z", grid)

    def f(t):
        return drop(fc(t))

    torch.manual_seed(62)
    (f(x) ** 2).sum().backward()
    plain = fc.weight.grad.clone()
    fc.weight.grad = None
    torch.manual_seed(62)
    y = checkpoint(f, x, use_reentrant=False)
    (y**2).sum().backward()
    mask = (y != 0).double()
    masks = [torch.empty_like(mask) for _ in range(grid.cube_size)]
    dist.all_gather(masks, mask, group=grid.group("cube"))
    drop.eval()
    return {
        "ckpt": rel(fc.weight.grad, plain),
        "keep": float(torch.stack(masks).mean()),
        "distinct": len({tuple(m.flatten().tolist()) for m in masks}) == len(masks),
        "eval_identity": bool(torch.equal(drop(x), x)),
    }


def test_dropout_streams_and_checkpoint_replay():
    for r in harness.run(8, on_grids, [(2, 2, 2)], dropout_job):
        res = r[(2, 2, 2)]
        assert res["ckpt"] < 1e-12 and res["eval_identity"], res
        assert 0.55 < res["keep"] < 0.85 and res["distinct"], res


def test_dropout_rescales_kept_values_and_keeps_the_expectation():
    """Kept elements are input / (1 − p), dropped ones 0, so E[dropout(x)] = x: the rescale is what
    lets evaluation skip dropout (a mask fraction alone would pass without it)."""
    p = 0.3
    torch.manual_seed(70)
    x = torch.rand(200_000, dtype=torch.float64) + 0.5
    y = Dropout3D(p)(x)
    kept = y != 0
    assert torch.equal(y[kept], x[kept] / (1 - p)) and bool((y[~kept] == 0).all())
    assert abs(float(kept.double().mean()) - (1 - p)) < 0.01
    assert abs(float((y / x).mean()) - 1) < 0.01  # the expectation, ~5 standard deviations wide


def test_core_imports_without_lightning_or_deepspeed():
    code = (
        "import sys, lightning_3d, lightning_3d.layers, lightning_3d.ops;"
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'deepspeed') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
