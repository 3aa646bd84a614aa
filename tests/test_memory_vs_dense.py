"""The memory benchmark of a 1×1×1 parallelized model against its dense twin (``benchmarks/micro/memory_vs_dense.py``)
runs on CPU, and the compiled cross-entropy's backward writes the logits' gradient without an fp32 copy of them."""

import json
import os
import subprocess
import sys

import torch

from lightning_3d.ops import cross_entropy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_memory_vs_dense_benchmark_on_cpu(tmp_path):
    """Both models of a case train; the saved bytes and the peak of live bytes are counted for both,
    and at 1×1×1 the parallelized model saves what its dense twin saves, within 3% (eager, CPU)."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "micro", "memory_vs_dense.py"),
        "--cpu",
        "--cases",
        "llama",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--out",
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(tmp_path / "memory_vs_dense.json") as f:
        (result,) = json.load(f)["results"]
    for side in ("dense", "3d"):
        row = result[side]
        assert row["saved_bytes"] > 0 and row["peak_live_bytes"] > 0 and row["step_ms_median"] > 0, row
        assert row["saved_by_category"] and row["peak_sites"], row
    assert abs(result["ratio"]["saved"] - 1) < 0.03, result["ratio"]


def test_compiled_cross_entropy_gradient_keeps_no_fp32_logits():
    """The compiled local gradient of the vocabulary-parallel cross-entropy equals the eager one, and
    the only ``[rows, V]`` buffer its kernel allocates is the gradient in the logits' dtype."""
    from torch._inductor.utils import run_and_get_code

    rows, vocab = 8, 96
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    row_max = cross_entropy._row_max(logits)
    local = torch.randint(0, vocab, (rows,))
    onehot_rows = torch.rand(rows) > 0.25
    (sum_exp, _), exp = cross_entropy._sums_keep_exp(logits, row_max, local, onehot_rows)
    scale = torch.rand(rows)
    eager = cross_entropy._grad_from_exp(exp, row_max, sum_exp, local, onehot_rows, scale, torch.bfloat16)
    compiled = torch.compile(cross_entropy._grad_from_logits)
    grad, (code, *_) = run_and_get_code(
        compiled, logits, row_max, sum_exp, local, onehot_rows, scale, torch.bfloat16
    )
    assert grad.dtype == torch.bfloat16 and torch.equal(grad, eager)
    full = [line for line in code.splitlines() if "empty_strided" in line and f"({rows}, {vocab})" in line]
    assert full and all("torch.bfloat16" in line for line in full), full


def _hf_loss_follows_compile(shape) -> dict:
    import harness
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_3d.parallel import parallelize, set_options

    grid = harness.grid(shape)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    model = parallelize(LlamaForCausalLM(config), grid=grid)
    logits = torch.randn(2, 8, 64, requires_grad=True)
    labels = torch.randint(0, 64, (2, 8))
    used = {}
    for compile_ in (False, True):
        set_options(model, compile=compile_)
        loss = model.loss_function(logits, labels, 64)
        (grad,) = torch.autograd.grad(loss, logits)
        used[compile_] = (loss.grad_fn.math, loss.detach(), grad)
    return {
        "eager_math": used[False][0] is cross_entropy._EAGER,
        "compiled_math": used[True][0] is cross_entropy._compiled(),
        "loss_err": (used[True][1] - used[False][1]).abs().item(),
        "grad_err": (used[True][2] - used[False][2]).abs().max().item(),
    }


def test_hf_loss_runs_compiled_with_the_model_options():
    """A parallelized Hugging Face model's loss runs its local passes compiled from the call after
    ``set_options(model, compile=True)`` on, with the eager loss and gradient."""
    import harness

    for result in harness.run(2, _hf_loss_follows_compile, (1, 1, 1)):
        assert result["eager_math"] and result["compiled_math"], result
        assert result["loss_err"] < 1e-6 and result["grad_err"] < 1e-7, result
