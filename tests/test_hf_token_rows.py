"""Hugging Face causal LMs on token rows: batches of 1 and 3 sequences, which whole-sequence rows split on
none of the grids below, against the unparallelized model.

One world of 8 runs 2×1×1 (dp 4), 1×2×2 (dp 2) and 2×2×2 (dp 1): an untied ``LlamaForCausalLM`` (GQA: 4
heads, 2 key/value heads over py; a ``pad_token_id``) and a tied ``GPT2LMHeadModel`` (learned positions), in
float64, with labels; plain calls at sequence lengths 8 and 40, a padding mask (left and right padding), and
packed sequences marked by position ids that restart (transformers' ``"sdpa"`` keeps each packed sequence
to itself). Logits, loss and every parameter's gradient equal the reference's, as in
``tests/test_hf_parallelize.py`` (RMSNorms in float64; the loss the float64 cross-entropy of the reference
logits with transformers' shift; transformers' own float32 loss to 1e-6). A world of 2 on 1×2×1 (py ≠ pz:
Llama's attention sees its input as a y-batch view) runs Mistral and Qwen2 alike, refuses what token rows
do not take, and runs GPT-2's decoder layers recomputed and compiled on token rows to the same numbers.
"""

from __future__ import annotations

import harness
import torch
from checks import on_grids, rel, seed_for
from test_hf_parallelize import (
    COMPILES_FLOAT64_SDPA,
    PAD,
    V,
    assert_within_tolerances,
    float64_reference,
    gpt2,
    llama,
    mistral,
    perturbed,
    qwen2,
    shifted_loss,
)

from lightning_3d.layout import gather_activation
from lightning_3d.token_rows import TokenRows, chunks_per_sequence

GRIDS = [(2, 1, 1), (1, 2, 2), (2, 2, 2)]  # in a world of 8: dp 4, 2, 1
MODELS = {
    "llama": lambda: llama(False, pad_token_id=PAD, max_position_embeddings=64),
    "gpt2": lambda: gpt2(n_positions=64),
    "mistral": lambda: mistral(sliding_window=None),
    "qwen2": qwen2,
}
SWEPT = ("llama", "gpt2")


def packed_positions(lengths: list[int]) -> torch.Tensor:
    """The position ids of sequences of ``lengths`` packed in one row: each restarts at 0."""
    return torch.cat([torch.arange(n) for n in lengths])


CASES = {"b1": (1, 8), "b3": (3, 40), "padded": (3, 16), "packed": (3, 24)}  # (batch, sequence length)


def call_of(grid, case: str) -> dict:
    """Fresh ids per dp replica; labels with ignored tokens; a padding mask or packed position ids by ``case``."""
    b, s = CASES[case]
    torch.manual_seed(seed_for(grid, 2))
    ids = torch.randint(0, V, (b, s))
    labels = ids.clone()
    labels[0, 3] = labels[-1, s // 2] = -100
    call = {"input_ids": ids, "labels": labels}
    if case == "padded":
        mask = torch.ones(b, s, dtype=torch.long)
        mask[0, 11:] = 0  # right padding
        mask[1, :3] = 0  # left padding
        labels[mask == 0] = -100
        call["attention_mask"] = mask
    if case == "packed":
        call["position_ids"] = torch.stack([packed_positions(n) for n in ([5, 7, 12], [24], [1, 9, 8, 6])])
    return call


def grads_as_dense(model) -> dict:
    """Every parameter's gradient under the original model's keys (the weights are put back)."""
    from lightning_3d import dense_state_dict

    weights = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
        grads = dense_state_dict(model)
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    return grads


def equivalence(grid, name: str, cases=tuple(CASES)) -> dict:
    """Each case's logits, loss and gradients on one parallelized model against the reference."""
    from lightning_3d.parallel import parallelize

    ref = float64_reference(perturbed(MODELS[name], 1))
    model = parallelize(perturbed(MODELS[name], 1), grid=grid)
    errs = {}
    for case in cases:
        call = call_of(grid, case)
        b, s = call["input_ids"].shape
        ref.zero_grad()
        model.zero_grad()
        ref_out = ref(**call, use_cache=False)
        hf_loss, ref_logits = ref_out.loss.detach(), ref_out.logits  # transformers' loss is float32's
        ref_loss = shifted_loss(ref_logits, call["labels"])
        ref_loss.backward()
        out = model(**call)
        out.loss.backward()
        logits = TokenRows(b, s, grid).restore(gather_activation(out.logits.detach(), "y", grid))
        grads = grads_as_dense(model)
        errs.update(
            {
                f"{case}_token_rows": float(out.logits.shape[1] != s // chunks_per_sequence(grid)),
                f"{case}_loss": rel(out.loss.detach(), ref_loss.detach()),
                f"{case}_logits": rel(logits[..., :V], ref_logits.detach()),
                f"{case}_f32_hf_loss": rel(out.loss.detach(), hf_loss),
                **{f"{case}_d{k}": rel(grads[k], p.grad) for k, p in ref.named_parameters()},
            }
        )
    return {f"{name}_{k}": e for k, e in errs.items()}


def equivalence_job(grid) -> dict:
    return {k: e for name in SWEPT for k, e in equivalence(grid, name).items()}


def test_hf_models_on_token_rows_equal_dense():
    assert_within_tolerances(harness.run(8, on_grids, GRIDS, equivalence_job))


def refused(grid) -> dict:
    """What token rows do not take is refused with a ValueError naming the fix (0: raised as expected)."""
    from lightning_3d.options import RuntimeOptions
    from lightning_3d.parallel import parallelize

    def message(model, **call) -> str:
        try:
            model(**call)
        except ValueError as e:
            return str(e)
        return ""

    torch.manual_seed(seed_for(grid, 5))
    ids = torch.randint(0, V, (1, 8))
    eager = parallelize(perturbed(lambda: gpt2(attn_implementation="eager"), 3), grid=grid)
    plain = parallelize(perturbed(MODELS["gpt2"], 3), grid=grid)
    sequences = parallelize(perturbed(MODELS["gpt2"], 3), grid=grid, options=RuntimeOptions(rows="sequences"))
    expected = {
        "eager": (eager, {}, "runs attention 'eager': token rows (a batch of 1 on grid (1, 2, 1)) need"),
        "mask_4d": (
            plain,
            {"attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool)},
            "a 4-D mask needs whole-sequence rows: a batch that is a multiple of 2",
        ),
        "sequences": (
            sequences,
            {},
            "whole-sequence rows need a batch that is a multiple of lcm(px·py, px·pz) = 2",
        ),
    }
    errs = {
        k: float(needle not in message(model, input_ids=ids, **call))
        for k, (model, call, needle) in expected.items()
    }
    with torch.no_grad():  # whole-sequence rows, as before
        logits = eager(input_ids=ids.expand(2, 8)).logits
        errs["eager_whole_sequences"] = float(logits.shape[:2] != (2 // grid.size("xz"), 8))
    return errs


def recomputed_and_compiled(grid) -> dict:
    """GPT-2's decoder layers recomputed in backward on token rows (a plain call, and packed sequences
    through the masked attention), the plain call's also compiled (from torch 2.13): the same loss and
    gradients."""
    from lightning_3d.parallel import parallelize, set_options

    model = parallelize(perturbed(MODELS["gpt2"], 4), grid=grid)
    errs = {}
    for case, runs in (("b1", 3 if COMPILES_FLOAT64_SDPA else 2), ("packed", 2)):
        call = call_of(grid, case)
        results = []
        for recompute, compiled in ((False, False), (True, False), (True, True))[:runs]:
            set_options(model, activation_checkpointing=recompute, compile=compiled)
            model.zero_grad()
            loss = model(**call).loss
            loss.backward()
            results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        for run, result in zip(("recomputed", "compiled"), results[1:]):
            errs.update(
                {f"{case}_{run}_{i}": rel(t, ref) for i, (t, ref) in enumerate(zip(result, results[0]))}
            )
    return errs


def llama_like_refusals_and_compiled_job(grid) -> dict:
    return {
        **{
            k: e
            for name in ("mistral", "qwen2")
            for k, e in equivalence(grid, name, ("b1", "padded")).items()
        },
        **{f"refused_{k}": e for k, e in refused(grid).items()},
        **recomputed_and_compiled(grid),
    }


def test_llama_like_refusals_and_compiled_layers_on_token_rows():
    """Mistral and Qwen2 on Llama's plan take token rows too; what token rows do not take is refused; compiled
    and recomputed layers give the same numbers."""
    assert_within_tolerances(harness.run(2, on_grids, [(1, 2, 1)], llama_like_refusals_and_compiled_job))
