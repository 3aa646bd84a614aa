"""What a parallelized Hugging Face model owes transformers' callers, against transformers itself.

In a world of 2 on 2×1×1, a tiny float64 ``GPT2LMHeadModel``: the loss of a Trainer-style
accumulation step (``num_items_in_batch``: the sum of the token losses over a count taken across
micro-batches) is transformers' own, over the shifted labels; and ``save_pretrained`` writes the
``config.json`` dtype entry that transformers' own ``save_pretrained`` writes for the same model.
transformers computes its loss in float32, so the exact reference is the float64 cross-entropy of the
unparallelized model's logits, and transformers' own loss is checked to float32 precision.
"""

from __future__ import annotations

import copy
import json

import harness
import torch
import torch.nn.functional as F
from checks import assert_close, on_grids, rel, seed_for

B, S, V = 4, 8, 60
F64 = torch.float64
HF_F32_TOL = 1e-6  # transformers' loss is computed in float32


def gpt2():
    """A tiny GPT-2 in float64, every parameter moved off its init (no unit norms, no zero biases)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=V,
            n_embd=16,
            n_layer=1,
            n_head=4,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ).to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def contracts_job(grid, folder: str) -> dict:
    from lightning_3d.hf import save_pretrained
    from lightning_3d.parallel import parallelize

    dense = gpt2()
    torch.manual_seed(seed_for(grid, 2))
    ids = torch.randint(0, V, (B, S))
    labels = ids.clone()
    labels[:, -1] = labels[0, 3] = labels[
        2, 5
    ] = -100  # ignored; position 0 is never a target, and is not ignored
    shifted = labels[:, 1:]
    counted = int((shifted != -100).sum())
    items = torch.tensor(
        2 * counted + 3
    )  # the count over this and other micro-batches of the accumulated step
    with torch.no_grad():
        logits = dense(ids, use_cache=False).logits
        hf_loss = dense(ids, labels=labels, num_items_in_batch=items, use_cache=False).loss
    ref = (
        F.cross_entropy(logits[:, :-1].flatten(0, 1), shifted.flatten(), ignore_index=-100, reduction="sum")
        / items
    )
    if (
        torch.distributed.get_rank() == 0
    ):  # a copy: transformers' save_pretrained sets the dtype in the model's config
        copy.deepcopy(dense).save_pretrained(f"{folder}/transformers")
    model = parallelize(copy.deepcopy(dense), grid=grid)
    with torch.no_grad():
        loss = model(ids, labels=labels, num_items_in_batch=items).loss
    save_pretrained(model, f"{folder}/parallelized")
    configs = [
        json.loads(open(f"{folder}/{name}/config.json").read()) for name in ("transformers", "parallelized")
    ]
    dtypes = [{k: v for k, v in c.items() if "dtype" in k} for c in configs]
    return {
        "loss": rel(loss, ref),
        "f32_hf_loss": rel(loss, hf_loss),
        # the test could not fail if the unshifted count (every position but the ignored ones) were the same
        "counts_differ": float(int((labels != -100).sum()) == counted),
        "config_dtype": float(not (dtypes[0] == dtypes[1] == {"dtype": "float64"})),
    }


def test_loss_over_num_items_in_batch_and_saved_dtype_are_transformers(tmp_path):
    results = harness.run(2, on_grids, [(2, 1, 1)], contracts_job, str(tmp_path))
    assert_close(
        [
            {g: {k: e for k, e in errs.items() if not k.startswith("f32_")} for g, errs in r.items()}
            for r in results
        ]
    )
    assert_close(
        [
            {g: {k: e for k, e in errs.items() if k.startswith("f32_")} for g, errs in r.items()}
            for r in results
        ],
        HF_F32_TOL,
    )
