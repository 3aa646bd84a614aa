"""Dense state dicts are the original model's: its keys, shapes, layouts and dtypes, padding dropped.

For every built-in plan (Hugging Face GPT-2 with its tied head and ``Conv1D`` weights stored
``[in, out]``, Llama with grouped-query attention and an untied head, Mistral, Qwen2 with q/k/v
biases, ``DenseGPT`` in both styles: packed q/k/v with GQA and packed gate/up) and for an explicit
plan of ``Conv1D`` layers (a packed one and a square one), in float64 on 2×1×1 (dp 2), 1×2×2 and
2×2×1 in a world of 4, with a vocabulary padded on every grid:

- ``dense_state_dict(model)`` equals the unparallelized model's ``state_dict()`` exactly, and the
  original class loads it with ``strict=True`` and gives the parallelized model's logits (its
  weights drawn anew, so nothing but the loaded state dict can make them equal); a square
  ``Conv1D`` weight comes back as it was, not transposed;
- ``load_dense_state_dict(model, original.state_dict())`` takes another original model's state
  dict as it is, after which the parallelized model gives that model's logits;
- a sharded checkpoint of GPT-2 exports (``to_dense``, the ``to-dense`` command) the original
  layouts, as does a DeepSpeed checkpoint (``deepspeed_3d.to_dense``); ``checkpoint_to_pretrained``
  refuses a checkpoint that records no layouts, naming the shapes.
"""

from __future__ import annotations

import copy
import os

import harness
import torch
from checks import assert_close, on_grids, rel
from torch import nn

from lightning_3d.layout import gather_activation, split_activation

F64 = torch.float64
B, S, V, H = 4, 8, 61, 16  # V pads on every grid below (to 62 where px·py = 2, to 64 where it is 4)
GRIDS = [(2, 1, 1), (1, 2, 2), (2, 2, 1)]  # in a world of 4: dp 2, 1, 1


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=V,
            n_embd=H,
            n_layer=1,
            n_head=4,
            n_positions=S,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def llama_like(kind: str, **kw):
    import transformers

    config = getattr(transformers, f"{kind}Config")(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=S,
        **kw,
    )
    return getattr(transformers, f"{kind}ForCausalLM")(config)


def dense_gpt(style: str):
    from lightning_3d.models import DenseGPT, GPTConfig

    return DenseGPT(
        GPTConfig(
            vocab_size=V,
            block_size=S,
            n_layer=1,
            n_head=4,
            n_kv_head=2 if style == "llama" else None,
            n_embd=H,
            style=style,
            ffn_hidden=24 if style == "llama" else None,
            vocab_multiple=1,
        ),
        dtype=F64,
    )


MODELS = {
    "gpt2": gpt2,
    "llama": lambda: llama_like("Llama", tie_word_embeddings=False),
    "mistral": lambda: llama_like("Mistral", sliding_window=None),
    "qwen2": lambda: llama_like("Qwen2"),
    "densegpt_gpt2": lambda: dense_gpt("gpt2"),
    "densegpt_llama": lambda: dense_gpt("llama"),
}


def random_model(name: str, seed: int) -> nn.Module:
    """A float64 model whose every tensor is random (no unit norms, no zero biases): models of two seeds
    differ everywhere."""
    torch.manual_seed(seed)
    model = MODELS[name]().to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


def reference_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The unparallelized model's logits in float64 (Hugging Face's RMSNorms compute in float32: swapped for
    ``nn.RMSNorm`` with the same weight and eps, as the parallelized model computes)."""
    from lightning_3d.hf.plans import LLAMA_NORMS

    if not hasattr(model, "config") or not hasattr(model.config, "to_dict"):
        return model(ids)
    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if type(module).__name__ in LLAMA_NORMS:
            norm = nn.RMSNorm(module.weight.shape[0], eps=module.variance_epsilon, dtype=F64)
            norm.weight = module.weight
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, norm)
    return ref(ids, use_cache=False).logits


def parallel_logits(model: nn.Module, ids: torch.Tensor, grid) -> torch.Tensor:
    out = model(ids)
    return gather_activation(getattr(out, "logits", out), "y", grid)[..., :V]


def same(a: dict, b: dict, tag: str) -> dict:
    """Keys, shapes, dtypes and values of two state dicts, exactly (0: equal)."""
    errs = {f"{tag}_keys": float(sorted(a) != sorted(b))}
    errs.update(
        {
            f"{tag}_{k}": float(not (k in b and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])))
            for k in a
        }
    )
    return errs


@torch.no_grad()
def layouts(grid, name: str) -> dict:
    from lightning_3d import dense_state_dict, load_dense_state_dict, parallelize

    model = random_model(name, 1)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    parallelize(model, grid=grid)  # in place, its weights kept
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    state = dense_state_dict(model)
    errs = same(state, before, "export")

    original = random_model(name, 3)  # other weights everywhere, which the load must replace
    original.load_state_dict(state, strict=True)
    errs["original_logits"] = rel(parallel_logits(model, ids, grid), reference_logits(original, ids))

    other = random_model(name, 4)
    load_dense_state_dict(model, other.state_dict())
    errs.update(same(dense_state_dict(model), other.state_dict(), "load"))
    errs["loaded_logits"] = rel(parallel_logits(model, ids, grid), reference_logits(other, ids))

    if name == "gpt2":  # a square Conv1D weight, [in, out] = [out, in]: equal, not its transpose
        key = "transformer.h.0.attn.c_proj.weight"
        errs["square_is_transposable"] = float(
            rel(before[key].t(), before[key]) < 0.5
        )  # else the next could not fail
        errs["square_kept"] = rel(state[key], before[key])
        errs["tied"] = float(
            original.lm_head.weight is not original.transformer.wte.weight
            or not torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
        )
    return {f"{name}_{k}": e for k, e in errs.items()}


class Conv1DModel(nn.Module):
    """Two ``Conv1D`` layers (weights stored ``[in, out]``): a packed gate/up ``[h, 2h]`` and a square ``[h, h]``."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.up = Conv1D(2 * H, H)
        self.down = Conv1D(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.up(x).chunk(2, -1)
        return self.down(torch.tanh(gate) * up)


@torch.no_grad()
def explicit_plan(grid) -> dict:
    from lightning_3d import dense_state_dict, load_dense_state_dict, parallelize
    from lightning_3d.parallel import Linear, Plan

    plan = Plan({"up": Linear("z", groups=2, transposed=True), "down": Linear("y", transposed=True)})
    torch.manual_seed(5)
    model, original, other = (Conv1DModel().to(F64) for _ in range(3))
    before = {k: t.clone() for k, t in model.state_dict().items()}
    parallelize(model, plan, grid=grid)
    x = torch.randn(B, S, H, dtype=F64, generator=torch.Generator().manual_seed(6))

    def run() -> torch.Tensor:
        return gather_activation(model(split_activation(x, "z", grid)), "z", grid)

    errs = same(dense_state_dict(model), before, "export")
    original.load_state_dict(dense_state_dict(model), strict=True)
    errs["original_out"] = rel(run(), original(x))
    load_dense_state_dict(model, other.state_dict())
    errs.update(same(dense_state_dict(model), other.state_dict(), "load"))
    errs["loaded_out"] = rel(run(), other(x))
    return {f"explicit_{k}": e for k, e in errs.items()}


def job(grid) -> dict:
    errs = explicit_plan(grid)
    for name in MODELS:
        errs.update(layouts(grid, name))
    return errs


def test_dense_state_dicts_are_the_original_models_on_grids():
    assert_close(harness.run(4, on_grids, GRIDS, job), 1e-10)


def checkpoint_export(grid, folder: str) -> dict:
    """GPT-2 saved as a sharded checkpoint on the grid: ``to_dense`` and the ``to-dense`` command give the original
    model's state dict, which the original class loads strictly; so does a DeepSpeed checkpoint's ``to_dense``. A
    checkpoint that records no transposed layouts (as those written before they were recorded) is refused by
    ``checkpoint_to_pretrained``, naming the shapes."""
    import deepspeed_3d
    from lightning_3d import checkpoint as ckpt
    from lightning_3d import parallelize
    from lightning_3d.hf import checkpoint_to_pretrained

    model = random_model("gpt2", 7)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    parallelize(model, grid=grid)
    ckpt.save(f"{folder}/gpt2.ckpt", {"state_dict": ckpt.model_state(model, grid)}, grid, model)
    os.environ.setdefault(
        "LOCAL_RANK", str(torch.distributed.get_rank())
    )  # DeepSpeed reads it; harness workers are not launched
    config = {
        "train_batch_size": B * grid.data_parallel_size,
        "train_micro_batch_size_per_gpu": B,
        "tensor3d": {"grid": list(grid.shape)},
    }
    engine, *_ = deepspeed_3d.initialize(
        model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
    )
    deepspeed_3d.save_checkpoint(engine, f"{folder}/gpt2.ds")
    for layer in model.modules():
        layer.dense_transposed = ()
    ckpt.save(f"{folder}/unrecorded.ckpt", {"state_dict": ckpt.model_state(model, grid)}, grid, model)
    if torch.distributed.get_rank():
        return {}
    try:
        checkpoint_to_pretrained(f"{folder}/unrecorded.ckpt", f"{folder}/unrecorded")
        refusal = ""
    except ValueError as e:
        refusal = str(e)
    errs = {
        "unrecorded_refused": float(
            "transformer.h.0.attn.c_attn.weight [48, 16] (the model's: [16, 48])" not in refusal
        )
    }
    errs.update(same(ckpt.to_dense(f"{folder}/gpt2.ckpt"), before, "to_dense"))
    errs.update(same(deepspeed_3d.to_dense(f"{folder}/gpt2.ds"), before, "deepspeed_to_dense"))
    ckpt.main(["to-dense", f"{folder}/gpt2.ckpt", f"{folder}/gpt2.safetensors"])
    written, _ = ckpt.read_dense(f"{folder}/gpt2.safetensors")
    errs.update(same(written, before, "cli"))
    original = random_model("gpt2", 8)
    original.load_state_dict(written, strict=True)
    errs["loaded"] = float(any(not torch.equal(t, before[k]) for k, t in original.state_dict().items()))
    return errs


def test_checkpoint_dense_export_has_the_original_layouts(tmp_path):
    results = harness.run(4, on_grids, [(2, 2, 1)], checkpoint_export, str(tmp_path))
    assert results[0][(2, 2, 1)], "rank 0 compared nothing"
    assert_close(results, 1e-12)
