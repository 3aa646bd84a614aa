"""GPT3D equals DenseGPT on every grid (float64): logits, loss, every parameter gradient; and the rest of issue 3."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import harness
from checks import assert_close, on_grids, rel, seed_for
from lightning_3d.layout import gather_activation
from lightning_3d.models import DenseGPT, GPT3D, GPTConfig, dense_state_dict_from_hf, gpt_config_from_hf
from lightning_3d.sharding import get_spec, unshard_tensor

# Tiny and distinct sizes: vocab 50 (padded to 64), width 16, 4 heads, MLP 64 (gpt2) / 24 (llama),
# batch 4 (a multiple of every grid's lcm(px·py, px·pz)), sequence 8 of block 12.
V, B, S = 50, 4, 8
BASE = dict(vocab_size=V, block_size=12, n_layer=2, n_head=4, n_embd=16)
STYLES = {"gpt2": dict(style="gpt2"), "llama": dict(style="llama", tie_embeddings=False, ffn_hidden=24)}
GRIDS = [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 2, 2)]  # in a world of 8: dp = 8, 4, 2, 1
F64 = torch.float64


def config(style, **kw) -> GPTConfig:
    return GPTConfig(**BASE, **STYLES[style], **kw)


def pair(grid, cfg, seed, dtype=F64):
    """A DenseGPT with perturbed weights (no zero biases, no unit norms) and the GPT3D holding them."""
    torch.manual_seed(seed)
    dense = DenseGPT(cfg, dtype=dtype)
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = GPT3D(cfg, grid, dtype=dtype)
    model.load_dense_state_dict(dense.state_dict())
    return dense, model


def batch(grid, seed):
    """Fresh ids and targets per dp replica, some targets ignored."""
    torch.manual_seed(seed_for(grid, seed))
    idx, targets = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
    targets[0, 0] = targets[-1, 3] = -100
    return idx, targets


def full_logits(model, idx):
    return gather_activation(model(idx), "y", model.grid)


def grads_as_dense(model) -> dict:
    """Every parameter's gradient, exported under the dense keys (overwrites the weights)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    return model.dense_state_dict()


def equivalence(grid, style):
    dense, model = pair(grid, config(style), 1)
    idx, targets = batch(grid, 2)
    ref_logits = dense(idx)
    ref_loss = dense(idx, targets)
    ref_loss.backward()
    with torch.no_grad():
        logits = full_logits(model, idx)
    loss = model(idx, targets)
    loss.backward()
    wte = model.transformer.wte.weight
    errs = {
        "logits": rel(logits[..., :V], ref_logits),
        "loss": rel(loss.detach(), ref_loss.detach()),
        "padded_logits_masked": float(not (logits[..., V:] == torch.finfo(F64).min).all()),
        "padded_rows_no_grad": float(unshard_tensor(wte.grad, get_spec(wte), grid)[V:].abs().max()),
    }
    grads = grads_as_dense(model)
    errs.update({"d" + k: rel(grads[k], p.grad) for k, p in dense.named_parameters()})
    return {f"{style}_{k}": e for k, e in errs.items()}


def checkpointing(grid, style):
    """With dropout, recomputing each block gives the same loss and gradients as keeping activations."""
    _, model = pair(grid, config(style, dropout=0.2), 3)
    idx, targets = batch(grid, 4)
    calls = []
    model.transformer.h[0].register_forward_pre_hook(lambda *_: calls.append(1))
    runs = []
    for ckpt in (False, True):
        model.zero_grad()
        model.activation_checkpointing = ckpt
        calls.clear()
        torch.manual_seed(5)
        loss = model(idx, targets)
        loss.backward()
        grads = [unshard_tensor(p.grad, get_spec(p), grid) for p in model.parameters()]  # a shard's may be 0
        runs.append((loss.detach(), grads, len(calls)))
    torch.manual_seed(6)
    with torch.no_grad():
        loss_other_masks = model(idx, targets)
    (loss0, grads0, calls0), (loss1, grads1, calls1) = runs
    errs = {"loss": rel(loss1, loss0), "block_recomputed": float((calls0, calls1) != (1, 2)),
            "dropout_active": float(abs(loss0 - loss_other_masks) < 1e-6)}
    errs.update({f"grad{n}": rel(g1, g0) for n, (g0, g1) in enumerate(zip(grads0, grads1))})
    return {f"{style}_ckpt_{k}": e for k, e in errs.items()}


def model_job(grid):
    return {k: e for style in STYLES for job in (equivalence, checkpointing) for k, e in job(grid, style).items()}


def test_gpt3d_equals_dense_on_grids():
    assert_close(harness.run(8, on_grids, GRIDS, model_job), tol=1e-9)


def test_gpt3d_equals_dense_on_2x1x1_with_dp2():
    assert_close(harness.run(4, on_grids, [(2, 1, 1)], model_job), tol=1e-9)
