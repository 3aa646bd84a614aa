"""LitGPT's ``litgpt.model.GPT`` through ``parallelize`` with its built-in plan, against LitGPT's own model.

A world of 4 sweeps 1×1×1 (dp 4), 1×2×2 and 2×2×1 with two tiny configs built with ``litgpt.Config``,
in float64:

- Pythia-like: parallel residual, LayerNorm, GELU (``GptNeoxMLP``), partial rotary (half of each
  head), biases, untied head over a padded vocabulary that the grid pads further;
- Llama-like: grouped queries (4 heads, 2 key/value groups), RMSNorm, SwiGLU (``LLaMAMLP``), no
  biases, full rotary, sequential residual, untied head;

and a Phi-like config (parallel residual with a shared attention norm, tanh GELU, head bias, tied
by hand) and a Qwen2.5-like one (the Llama-like with q/k/v biases) on 1×2×1 (dp 2). Loss, logits
and every parameter's gradient are compared, and ``dense_state_dict`` loads into LitGPT's model
with ``strict=True``. On token rows, a world of 8 runs the Pythia-like and Llama-like configs at
batches of 1 and 3 sequences (which whole-sequence rows do not split) on 2×1×2 (dp 2) and 2×2×2, the
Llama-like one's loss over labels shifted as LitGPT's fine-tuning shifts them; the refusals include
what token rows cannot take. The example (``examples/fabric_litgpt.py``) trains, resumes and exports
in a world of 2; the benchmark (``benchmarks/litgpt_fabric.py``) runs its CPU smoke mode.

The reference is LitGPT's model with two float64 adjustments that leave the model the same:
LitGPT builds its RoPE tables in float32 (``build_rope_cache``'s ``.float()``), so both models get
the exact float64 tables (LitGPT's own are checked to float32 precision); LitGPT's ``RMSNorm``
computes in float32, so the reference's norms are swapped for ``nn.RMSNorm`` (same weight, eps).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import harness
import pytest
import torch
import torch.nn.functional as F
from checks import assert_close, on_grids, rel, seed_for, value_error
from torch import nn

pytest.importorskip("litgpt")

B, S = 4, 8
V, PADDED = 60, 62  # LitGPT pads to 62; grids with px·py = 4 pad to 64
GRIDS = [(1, 1, 1), (1, 2, 2), (2, 2, 1)]  # in a world of 4: dp = 4, 1, 1
F64 = torch.float64
F32_TOL = 1e-6

COMMON = dict(block_size=16, n_layer=2, n_embd=32, n_head=4, vocab_size=V, padded_vocab_size=PADDED)
CONFIGS = {
    "pythia": dict(
        COMMON,
        parallel_residual=True,
        norm_class_name="LayerNorm",
        mlp_class_name="GptNeoxMLP",
        rotary_percentage=0.5,
        bias=True,
    ),
    "llama": dict(
        COMMON,
        n_query_groups=2,
        parallel_residual=False,
        norm_class_name="RMSNorm",
        norm_eps=1e-5,
        mlp_class_name="LLaMAMLP",
        intermediate_size=48,
        rotary_percentage=1.0,
        bias=False,
    ),
    "phi": dict(
        COMMON,
        parallel_residual=True,
        shared_attention_norm=True,
        norm_class_name="LayerNorm",
        mlp_class_name="GptNeoxMLP",
        gelu_approximate="tanh",
        rotary_percentage=0.5,
        bias=True,
        lm_head_bias=True,
    ),
}
CONFIGS["qwen"] = dict(
    CONFIGS["llama"], attn_bias=True
)  # Qwen2.5's q/k/v biases: the bias rows reordered too


def exact_rope(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """LitGPT's RoPE tables (``build_rope_cache`` without adjustments) computed in float64."""
    n, base = model.config.rope_n_elem, model.config.rope_base
    theta = 1.0 / base ** (torch.arange(0, n, 2, dtype=F64) / n)
    angles = torch.outer(torch.arange(model.max_seq_length, dtype=F64), theta).repeat(1, 2)
    return angles.cos(), angles.sin()


def litgpt_model(name: str, seed: int = 1, tied: bool = False) -> nn.Module:
    """LitGPT's GPT in float64, every parameter moved off its init, with exact RoPE tables."""
    from litgpt import Config
    from litgpt.model import GPT

    torch.manual_seed(seed)
    model = GPT(Config(**CONFIGS[name])).to(F64)
    if tied:
        model.lm_head.weight = model.transformer.wte.weight
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.cos, model.sin = exact_rope(model)
    return model


def float64_reference(model: nn.Module) -> nn.Module:
    """A copy whose RMSNorms compute in float64 (LitGPT's cast to float32 first)."""
    from litgpt.model import RMSNorm

    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if isinstance(module, RMSNorm):
            norm = nn.RMSNorm(module.weight.shape[0], eps=module.eps, dtype=F64)
            norm.weight = module.weight
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, norm)
    return ref


def equivalence(grid, name: str, tied: bool = False) -> dict:
    from litgpt.model import GPT

    from lightning_3d import dense_state_dict, gather_activation, parallelize
    from lightning_3d.litgpt import cross_entropy

    dense = litgpt_model(name, tied=tied)
    ref = float64_reference(dense)
    torch.manual_seed(seed_for(grid, 2))
    ids = torch.randint(0, PADDED, (B, S))
    targets = torch.randint(0, PADDED, (B, S))
    targets[0, 2] = targets[3, 5] = -100
    ref_logits = ref(ids)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref_loss.backward()
    own_rope = GPT(dense.config).rope_cache()  # LitGPT's float32 tables

    model = parallelize(dense, grid=grid)  # in place
    logits = model(ids)
    loss = cross_entropy(model, logits, targets)
    loss.backward()
    full = gather_activation(logits.detach(), "y", grid)
    errs = {
        "loss": rel(loss.detach(), ref_loss.detach()),
        "logits": rel(full[..., :PADDED], ref_logits.detach()),
        "padded_logits_lowest": float(not (full[..., PADDED:] == torch.finfo(F64).min).all()),
        "f32_rope": max(rel(own.double(), exact) for own, exact in zip(own_rope, exact_rope(dense))),
    }
    weights = dense_state_dict(model)
    original = GPT(dense.config).to(F64)
    original.load_state_dict(weights, strict=True)
    errs["state_dict"] = max(rel(weights[k], p) for k, p in ref.state_dict().items())
    original.cos, original.sin = exact_rope(original)
    errs["reloaded_logits"] = rel(float64_reference(original)(ids), ref_logits.detach())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    grads = dense_state_dict(model)
    errs.update({"d" + k: rel(grads[k], p.grad) for k, p in ref.named_parameters()})
    return {f"{name}_{k}": e for k, e in errs.items()}


def sweep_job(grid) -> dict:
    return {k: e for name in ("pythia", "llama") for k, e in equivalence(grid, name).items()}


def assert_within_tolerances(results: list) -> None:
    """Float64 errors below 1e-10; LitGPT's float32 RoPE tables (``f32_``) below 1e-6."""
    assert_close(
        [{g: {k: e for k, e in errs.items() if "f32_" not in k} for g, errs in r.items()} for r in results]
    )
    assert_close(
        [{g: {k: e for k, e in errs.items() if "f32_" in k} for g, errs in r.items()} for r in results],
        F32_TOL,
    )


def test_litgpt_models_equal_litgpt_on_grids():
    assert_within_tolerances(harness.run(4, on_grids, GRIDS, sweep_job))


def refusals(grid) -> dict:
    """Each unsupported config or call raises a ValueError naming it (0: raised as expected), before the model
    changes."""
    from litgpt import Config
    from litgpt.model import GPT

    from lightning_3d import parallelize
    from lightning_3d.litgpt import cross_entropy
    from lightning_3d.parallel import find_plan

    def built(**changes) -> nn.Module:
        return GPT(Config(**{**CONFIGS["llama"], **changes}))

    plain = parallelize(litgpt_model("llama"), grid=grid)
    ids = torch.randint(0, V, (B, S))
    moe = built(mlp_class_name="LLaMAMoE", n_expert=2, n_expert_per_token=1, moe_intermediate_size=16)
    expected = {
        "moe": (lambda: parallelize(moe, grid=grid), "mlp_class_name='LLaMAMoE'"),
        "sliding_window": (
            lambda: parallelize(built(sliding_window_size=4), grid=grid),
            "sliding_window_size=None",
        ),
        "unit_offset_norm": (
            lambda: parallelize(built(name="Gemma-tiny"), grid=grid),
            "transformer.h.0.norm_1",
        ),
        "softcapping": (
            lambda: parallelize(built(final_logit_softcapping=30.0), grid=grid),
            "final_logit_softcapping",
        ),
        "query_groups": (
            lambda: parallelize(built(n_query_groups=1), grid=grid),
            "1 query groups (key/value heads)",
        ),
        "kv_cache": (lambda: plain(ids, input_pos=torch.arange(S)), "keeps no KV cache"),
        "set_kv_cache": (lambda: plain.set_kv_cache(B), "keeps no KV cache"),
        "token_rows_length": (lambda: plain(ids[:1, :7]), "multiple of lcm(2·px·pz, px·py) = 2"),
        "sliced_logits": (
            lambda: cross_entropy(plain, plain(ids[:1])[..., :-1, :], ids[:1, 1:]),
            "shift=True for labels: slice neither",
        ),
    }
    errs = {k: float(needle not in value_error(fn)) for k, (fn, needle) in expected.items()}
    errs["moe_untouched"] = float(type(moe.transformer.wte) is not nn.Embedding)
    targets = torch.randint(0, V, (B, S))
    chunks = plain(ids, lm_head_chunk_size=3)  # LitGPT's chunks of the sequence, each a y-layout block
    errs["lm_head_chunks"] = float(len(chunks) != 3) + rel(
        cross_entropy(plain, chunks, targets).detach(), cross_entropy(plain, plain(ids), targets).detach()
    )
    errs["found_by_class"] = float(find_plan(built()).rules["lm_head"].__class__.__name__ != "LMHead")
    return errs


def conversion(grid) -> dict:
    """LitGPT's converter to Hugging Face gives the same tensors from the parallelized model's export as from
    LitGPT's own; a sharded checkpoint's dense export (``to_dense``) is LitGPT's state dict."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch.distributed as dist
    from litgpt.scripts.convert_lit_checkpoint import convert_lit_checkpoint
    from litgpt.utils import save_config

    from lightning_3d import checkpoint as ckpt
    from lightning_3d import dense_state_dict, parallelize

    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    folder = Path(folder[0])
    errs = {}
    for name in ("pythia", "llama"):
        dense = litgpt_model(name)
        original = copy.deepcopy(dense).state_dict()
        model = parallelize(dense, grid=grid)
        weights = dense_state_dict(model)
        ckpt.save(folder / f"{name}.ckpt", {"state_dict": ckpt.model_state(model, grid)}, grid, model)
        if dist.get_rank():
            continue
        exported = ckpt.to_dense(folder / f"{name}.ckpt")
        errs[f"{name}_to_dense"] = max(rel(exported[k], t) for k, t in original.items())
        converted = {}
        for source, state in (("ours", weights), ("litgpt", original)):
            lit = folder / name / source
            lit.mkdir(parents=True)
            torch.save(state, lit / "lit_model.pth")
            save_config(dense.config, lit)
            convert_lit_checkpoint(lit, lit / "hf")
            converted[source] = torch.load(lit / "hf" / "model.pth", weights_only=True)
        ours, theirs = converted["ours"], converted["litgpt"]
        errs[f"{name}_hf_keys"] = float(sorted(ours) != sorted(theirs))
        errs[f"{name}_hf_tensors"] = max(rel(ours[k], theirs[k]) for k in theirs)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder)
    return errs


def features_job(grid) -> dict:
    errs = equivalence(grid, "phi", tied=True)
    errs.update(equivalence(grid, "qwen"))
    errs.update({f"refused_{k}": e for k, e in refusals(grid).items()})
    errs.update(conversion(grid))
    return errs


def test_phi_like_tied_refusals_and_conversion():
    """A Phi-like tied model equals LitGPT's; unsupported configs and calls are refused; LitGPT's converter
    reads the export."""
    assert_within_tolerances(harness.run(4, on_grids, [(1, 2, 1)], features_job))


def token_rows_equivalence(grid, name: str, b: int, shift: bool) -> dict:
    """LitGPT's model on token rows (a batch of ``b`` sequences of 16 tokens) against LitGPT's: logits, loss
    (targets of each position, or with ``shift`` labels as LitGPT's fine-tuning shifts them) and every gradient."""
    from lightning_3d import dense_state_dict, gather_activation, parallelize
    from lightning_3d.litgpt import cross_entropy
    from lightning_3d.token_rows import TokenRows

    s = 16
    dense = litgpt_model(name)
    ref = float64_reference(dense)
    torch.manual_seed(seed_for(grid, 2))
    ids, targets = torch.randint(0, PADDED, (b, s)), torch.randint(0, PADDED, (b, s))
    targets[0, 2] = targets[-1, 9] = -100
    ref_logits = ref(ids)
    predicted, wanted = (ref_logits[:, :-1], targets[:, 1:]) if shift else (ref_logits, targets)
    ref_loss = F.cross_entropy(predicted.flatten(0, 1), wanted.flatten(), ignore_index=-100)
    ref_loss.backward()

    model = parallelize(dense, grid=grid)  # in place
    logits = model(ids)
    loss = cross_entropy(model, logits, targets, shift=shift)
    loss.backward()
    full = TokenRows(b, s, grid).restore(gather_activation(logits.detach(), "y", grid))
    errs = {
        "loss": rel(loss.detach(), ref_loss.detach()),
        "logits": rel(full[..., :PADDED], ref_logits.detach()),
    }
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    grads = dense_state_dict(model)
    errs.update({"d" + k: rel(grads[k], p.grad) for k, p in ref.named_parameters()})
    return {f"{name}_b{b}_{k}": e for k, e in errs.items()}


def token_rows_job(grid) -> dict:
    """Pythia-like (partial rotary, targets of each position) and Llama-like (grouped queries, shifted labels):
    each at batch 1 on one grid and batch 3 on the other."""
    batches = (1, 3) if grid.size("y") == 1 else (3, 1)
    return {
        k: e
        for (name, shift), b in zip((("pythia", False), ("llama", True)), batches)
        for k, e in token_rows_equivalence(grid, name, b, shift).items()
    }


def test_litgpt_on_token_rows_equals_litgpt():
    """Batches whole-sequence rows split on neither grid: 2×1×2 (dp 2) and 2×2×2 in a world of 8."""
    assert_within_tolerances(harness.run(8, on_grids, [(2, 1, 2), (2, 2, 2)], token_rows_job))


ROOT = Path(__file__).parent.parent


def _run(*cmd: str, timeout: float = 240) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, *cmd],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_fabric_example_trains_resumes_and_exports(tmp_path):
    """``examples/fabric_litgpt.py`` in a world of 2 (1×2×1): two steps with a checkpoint, a resumed third, and an
    export that LitGPT's ``GPT`` loads strictly."""
    from litgpt import Config
    from litgpt.model import GPT

    common = [
        "examples/fabric_litgpt.py",
        "--devices",
        "2",
        "--grid",
        "1,2,1",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--max-bytes",
        "100000",
        "--save-every",
        "2",
        "--log-every",
        "1",
        "--out",
        str(tmp_path),
    ]
    first = _run(*common, "--max-steps", "2").stdout
    assert "step     2/2" in first and "step-000002" in first, first[-2000:]
    second = _run(*common, "--max-steps", "3", "--resume").stdout
    assert "at step 2" in second and "step     3/3" in second and "step     2/3" not in second, second[-2000:]
    model = GPT(Config.from_file(tmp_path / "final" / "model_config.yaml"))
    model.load_state_dict(torch.load(tmp_path / "final" / "lit_model.pth", weights_only=True), strict=True)


def test_benchmark_cpu_smoke(tmp_path):
    """``benchmarks/litgpt_fabric.py --cpu``: both cases time their steps and start from the same weights."""
    _run("benchmarks/litgpt_fabric.py", "--cpu", "--no-compile", "--steps", "1", "--out", str(tmp_path))
    report = json.loads((tmp_path / "litgpt_fabric.json").read_text())
    single, grid = (next(r for r in report["runs"] if r["case"] == case) for case in ("single", "tensor3d"))
    assert (
        single["tokens_per_s"] > 0
        and grid["tokens_per_s"] > 0
        and report["tensor3d_over_single"]["tokens_per_s"] > 0
    )
    assert abs(single["losses"][0] - grid["losses"][0]) < 1e-5 * single["losses"][0], (
        single["losses"],
        grid["losses"],
    )
