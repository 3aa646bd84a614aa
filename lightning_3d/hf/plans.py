"""Built-in plans of Hugging Face causal LMs, registered by class name (``transformers`` is not imported).

- ``LlamaForCausalLM`` (and ``MistralForCausalLM``, ``Qwen2ForCausalLM``, which share its module
  names): GQA, RoPE, RMSNorm, SwiGLU, tied or untied head, optional projection biases.
- ``GPT2LMHeadModel``: ``Conv1D`` weights (stored ``[in, out]``), the packed ``c_attn`` (q, k, v:
  groups 3), learned positions ``wpe`` (features cut by z, added to the z-layout embedding),
  dropout with an independent mask on every rank.

Every block reads and writes z-layout; the projections into attention and the MLP are z→y, the
ones out of them y→z; attention runs on y-layout rows, whole heads of y block ``j`` (so the heads,
and GQA's key/value heads, must divide by py). Each plan's ``validate`` checks the config against
the grid before anything changes; its ``prepare``, run once the modules are replaced, sets what
the Hugging Face code reads per rank: GPT-2's ``split_size`` and ``num_heads``; Llama's attention
input as a y-batch view (a pre-hook on each attention,
:func:`~lightning_3d.hf.interface.attention_input_as_y_batch`); the model's ``loss_function``
(:func:`~lightning_3d.hf.interface.causal_lm_loss_3d`); its attention implementation, lightning_3d's
in place of ``"sdpa"`` (:mod:`~lightning_3d.hf.attention`: transformers' SDPA on whole-sequence
rows, split attention on token rows). The plan's ``before_forward`` lays each call out, on whole
sequences or token rows (:func:`~lightning_3d.hf.interface.lay_out_inputs`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from ..grid import Grid
from ..parallel import (
    Dropout,
    Linear,
    LMHead,
    Norm,
    Plan,
    PositionEmbedding,
    VocabEmbedding,
    register_norm,
    register_plan,
    runtime_of,
)
from ..versions import require
from .interface import attention_input_as_y_batch, causal_lm_loss_3d, lay_out_inputs, projection_input_as_z

LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
LLAMA_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
# RoPE variants whose tables depend on the positions only (not on the longest sequence seen)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class AttentionProjection(Linear):
    """A z-input q/k/v projection of an attention that receives its input as a y-batch view
    (:func:`~lightning_3d.hf.interface.attention_input_as_y_batch`): the built layer views it back."""

    def build(self, name, module, grid, options):
        layer = super().build(name, module, grid, options)
        layer.register_forward_pre_hook(projection_input_as_z)
        return layer


def _refuse_unless(ok: bool, model: nn.Module, why: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"{type(model).__name__}: {why}; {fix}")


def _check_common(model: nn.Module, grid: Grid, heads: int) -> None:
    require("transformers")
    config = model.config
    impl = config._attn_implementation
    _refuse_unless(
        impl in ATTENTION_IMPLEMENTATIONS,
        model,
        f"attention implementation {impl!r} is not supported",
        f"use one of {ATTENTION_IMPLEMENTATIONS} (model.set_attn_implementation('sdpa'))",
    )
    py = grid.size("y")
    _refuse_unless(
        heads % py == 0,
        model,
        f"{heads} attention heads do not split over py = {py} (attention runs on whole "
        f"heads of each y block)",
        f"pick a grid whose py divides {heads}",
    )


def _use_3d_loss_and_attention(model: nn.Module, grid: Grid) -> None:
    """The model's loss is the 3-D one, run by the model's runtime: its label checks read as the
    model's forward ends, its local passes compiled while the options say ``compile``. Its attention
    is lightning_3d's where it runs ``"sdpa"`` (:mod:`~lightning_3d.hf.attention`: token rows)."""
    from .attention import install

    model.loss_function = functools.partial(causal_lm_loss_3d, grid=grid, runtime=runtime_of(model))
    install(model)


def check_llama(model: nn.Module, grid: Grid) -> None:
    """Refuse a Llama-like config that ``grid`` cannot split, naming the numbers and the fix."""
    config = model.config
    _check_common(model, grid, config.num_attention_heads)
    py, kv = grid.size("y"), config.num_key_value_heads
    _refuse_unless(
        kv % py == 0,
        model,
        f"{kv} key/value heads do not split over py = {py} (each y block holds whole "
        f"key/value heads with their query heads)",
        f"pick a grid whose py divides {kv}",
    )
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    _refuse_unless(
        rope in ROPE_TYPES,
        model,
        f"rope_type {rope!r} rescales by the longest sequence, which differs per rank",
        f"use one of {ROPE_TYPES}",
    )
    window = getattr(config, "sliding_window", None)
    _refuse_unless(
        window is None,
        model,
        f"sliding-window attention (sliding_window={window}) is not supported",
        "set config.sliding_window = None (the same model when sequences are no longer than the window)",
    )


def prepare_llama(model: nn.Module, grid: Grid) -> None:
    """Hand each attention its input as a y-batch view; the 3-D loss and lightning_3d's attention."""
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            functools.partial(attention_input_as_y_batch, grid=grid), with_kwargs=True
        )
    _use_3d_loss_and_attention(model, grid)


def check_gpt2(model: nn.Module, grid: Grid) -> None:
    """Refuse a GPT-2 config that ``grid`` cannot split, naming the numbers and the fix."""
    config = model.config
    _check_common(model, grid, config.n_head)
    _refuse_unless(
        not config.add_cross_attention,
        model,
        "cross-attention is not supported",
        "set add_cross_attention=False",
    )


def prepare_gpt2(model: nn.Module, grid: Grid) -> None:
    """Set each attention's per-rank sizes; the 3-D loss and lightning_3d's attention."""
    py = grid.size("y")
    for block in model.transformer.h:
        block.attn.split_size //= py  # the width of q, k and v in c_attn's y-layout output block
        block.attn.num_heads //= py
    _use_3d_loss_and_attention(model, grid)


def llama_plan(model: nn.Module) -> Plan:
    """The plan of ``LlamaForCausalLM`` and the models that share its module names (Mistral, Qwen2)."""
    layer = "model.layers.*."
    rules = {
        "model.embed_tokens": VocabEmbedding(),
        layer + "input_layernorm": Norm("z"),
        **{layer + f"self_attn.{p}_proj": AttentionProjection("z") for p in "qkv"},
        layer + "self_attn.o_proj": Linear("y"),
        layer + "post_attention_layernorm": Norm("z"),
        layer + "mlp.gate_proj": Linear("z"),
        layer + "mlp.up_proj": Linear("z"),
        layer + "mlp.down_proj": Linear("y"),
        "model.norm": Norm("z"),
        "lm_head": LMHead(),
    }
    return Plan(
        rules,
        checkpoint=("model.layers.*",),
        validate=check_llama,
        prepare=prepare_llama,
        before_forward=functools.partial(lay_out_inputs, positions_layout="y"),
        rows_in_model=True,  # lay_out_inputs arranges token rows before the embedding
    )


def gpt2_plan(model: nn.Module) -> Plan:
    """The plan of ``GPT2LMHeadModel``."""
    block = "transformer.h.*."
    rules = {
        "transformer.wte": VocabEmbedding(),
        "transformer.wpe": PositionEmbedding(),
        "transformer.drop": Dropout(),
        block + "ln_1": Norm("z"),
        block + "attn.c_attn": Linear("z", groups=3, transposed=True),
        block + "attn.c_proj": Linear("y", transposed=True),
        block + "attn.attn_dropout": Dropout(),
        block + "attn.resid_dropout": Dropout(),
        block + "ln_2": Norm("z"),
        block + "mlp.c_fc": Linear("z", transposed=True),
        block + "mlp.c_proj": Linear("y", transposed=True),
        block + "mlp.dropout": Dropout(),
        "transformer.ln_f": Norm("z"),
        "lm_head": LMHead(),
    }
    return Plan(
        rules,
        checkpoint=("transformer.h.*",),
        validate=check_gpt2,
        prepare=prepare_gpt2,
        before_forward=functools.partial(lay_out_inputs, positions_layout="z"),
        rows_in_model=True,  # lay_out_inputs arranges token rows before the embedding
    )


def register_builtin_plans() -> None:
    """Register the Hugging Face plans and norm classes by name."""
    for norm in LLAMA_NORMS:
        register_norm(norm, "rmsnorm", eps_attr="variance_epsilon")
    for name in LLAMA_LIKE:
        register_plan(name, llama_plan)
    register_plan("GPT2LMHeadModel", gpt2_plan)
