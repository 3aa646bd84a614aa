"""The built-in plan of LitGPT's ``litgpt.model.GPT``, registered by its qualified class name.

Covered: the structure of Llama 2/3, TinyLlama, Mistral (without a sliding window), Pythia,
Phi-1.5, Phi-2, Phi-3.5-mini and Phi-4 (the configs :func:`check_litgpt` passes): fused ``qkv``
with grouped queries, RoPE (partial rotary included), parallel residual (with or without a shared
attention norm), LayerNorm / RMSNorm, GELU (``GptNeoxMLP``) and SwiGLU (``LLaMAMLP``) MLPs,
biases, a tied or untied head over the padded vocabulary. The rest is refused by
:func:`check_litgpt` naming the module or config field and the fix.

Every block reads and writes z-layout; ``qkv``, ``fc``, ``fc_1``, ``fc_2`` are z→y, ``attn.proj`` and
``mlp.proj`` y→z. Attention runs on y-layout rows, whole heads of y block ``j``
(:class:`~lightning_3d.litgpt.attention.GridSelfAttention`, put in place of LitGPT's by the
plan's ``prepare``); the norms, residual adds, MLP activations and the rotary tables are LitGPT's
own code. ``model(idx)`` takes the full batch ``[b, s]`` on every cube rank, any ``b``, and returns
this rank's y-layout logits: ``[b/(px·pz), s, V'/py]`` where ``b`` is a multiple of
``lcm(px·py, px·pz)``, else token rows ``[b·C/(px·pz), s/C, V'/py]``: the plan names the blocks'
attention (:class:`~lightning_3d.parallel.Attention`, its RoPE tables ``cos`` and ``sin``), so the
embedding takes the token rows of ``idx``, each row's tables are its true positions' and attention
gathers each sequence's keys and values (:mod:`lightning_3d.parallel.attention`).
:func:`~lightning_3d.litgpt.loss.cross_entropy` gives LitGPT's training loss from the logits.

``litgpt`` is imported here only inside functions, when a LitGPT model is parallelized.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from ..agreement import agree_on_first_call
from ..grid import Grid
from ..parallel import (
    Attention,
    Linear,
    LMHead,
    Norm,
    Plan,
    VocabEmbedding,
    register_norm,
    register_plan,
)
from .attention import GridSelfAttention

GPT_CLASS = "litgpt.model.GPT"
MLPS = {"GptNeoxMLP": ("fc",), "LLaMAMLP": ("fc_1", "fc_2")}  # LitGPT MLP class → its z→y linears
NORMS = ("LayerNorm", "RMSNorm")


@dataclass(frozen=True)
class QueryGroupedQKV(Linear):
    """LitGPT's fused ``qkv`` ``[q; k; v]``: q ``[n_head·hs]`` with query head ``t·r + g`` (slot
    ``g`` of key/value head ``t``, ``r = n_head / n_query_groups``), then k and v ``[n_query_groups·hs]``.

    Built as ``FusedLinear3D(n_embd, n_query_groups·hs, groups=r + 2)``: ``r`` query slots, k, v,
    each cut over y like k and v, so that y block ``j`` holds key/value heads ``j·n_kv/py …`` with
    all their query heads. LitGPT stores the query heads key/value-group-major (``[t, g]``), the 3-D
    layer slot-major (``[g, t]``): the layer declares the row order of its dense twin
    (``dense_row_order``) and dense state dicts, loads and exports hold LitGPT's layout.
    """

    queries_per_kv: int = 1
    head_size: int = 1

    def build(self, name, module, grid, options):
        layer = super().build(name, module, grid, options)
        block, order = self.dense_order(layer.out_features)
        if list(order) != sorted(
            order
        ):  # the orders differ with several query heads per key/value head and several of those
            layer.dense_row_order = {
                n: (block, order) for n in ("weight", "bias") if getattr(layer, n, None) is not None
            }
        return layer

    def dense_order(self, out_features: int) -> tuple[int, tuple[int, ...]]:
        """``(block, order)``: dense head-row block ``k`` is the 3-D layer's block ``order[k]``, blocks of
        ``hs`` rows."""
        r, kv = self.queries_per_kv, out_features // self.head_size
        queries = [
            g * kv + t for t in range(kv) for g in range(r)
        ]  # LitGPT's head t·r + g lies in slot g, row t
        return self.head_size, tuple(queries + list(range(r * kv, (r + 2) * kv)))


def _refuse(model: nn.Module, what: str, why: str, fix: str) -> None:
    raise ValueError(f"{type(model).__name__} ({what}): {why}; {fix}")


def check_litgpt(model: nn.Module, grid: Grid) -> None:
    """Refuse what the plan does not compute exactly, or what ``grid`` cannot split, naming the
    module or config field, the numbers and the fix."""
    import litgpt.model as lm

    config = model.config
    unsupported = {
        "latent_attention": "multi-head latent attention",
        "norm_qk": "query/key norms",
        "post_attention_norm": "post-attention norms",
        "post_mlp_norm": "post-MLP norms",
        "sliding_window_size": "sliding-window attention",
        "attention_logit_softcapping": "attention logit soft-capping",
        "final_logit_softcapping": "final logit soft-capping (it would lift the padded vocabulary's logits)",
        "rope_interleave": "interleaved RoPE",
        "rope_local_base_freq": "separate local RoPE tables",
    }
    for field, what in unsupported.items():
        value = getattr(config, field, None)
        if value:
            _refuse(
                model,
                f"config.{field}={value!r}",
                f"{what} is not supported",
                f"use a config without it (config.{field}=None/False"
                + (
                    ": the same model for sequences no longer than the window)"
                    if field == "sliding_window_size"
                    else ")"
                ),
            )
    if config.mlp_class_name not in MLPS:
        _refuse(
            model,
            f"config.mlp_class_name={config.mlp_class_name!r}",
            "this MLP class is not supported"
            + (" (mixture of experts)" if "MoE" in config.mlp_class_name else ""),
            f"use one of {sorted(MLPS)}",
        )
    if config.attention_scores_scalar not in (None, config.head_size):
        _refuse(
            model,
            f"config.attention_scores_scalar={config.attention_scores_scalar}",
            f"attention scaled other than by 1/sqrt(head_size={config.head_size}) is not supported",
            "leave it None",
        )
    if config.rope_n_elem % 2:
        _refuse(
            model,
            f"config.rope_n_elem={config.rope_n_elem}",
            "an odd number of rotary features is not supported",
            "pick rotary_percentage so that rotary_percentage·head_size is even",
        )
    for name, module in model.named_modules():
        if isinstance(module, lm.CausalSelfAttention) and module.mscale != 1.0:
            _refuse(
                model,
                name,
                f"YaRN's attention scale (mscale {module.mscale}) is not supported",
                "drop mscale_all_dim",
            )
        if name.endswith(("norm_1", "norm_2", "ln_f")) and not isinstance(module, nn.Identity):
            if (
                type(module).__name__ not in NORMS
                or getattr(module, "add_unit_offset", False)
                or getattr(module, "dim", -1) != -1
            ):
                _refuse(
                    model,
                    name,
                    f"{type(module).__name__} (unit offset {getattr(module, 'add_unit_offset', False)}) is not "
                    "supported",
                    f"use config.norm_class_name in {NORMS}, a weight applied as x̂·weight over the last dim",
                )
    py = grid.size("y")
    for heads, what in (
        (config.n_head, "attention heads"),
        (config.n_query_groups, "query groups (key/value heads)"),
    ):
        if heads % py:
            _refuse(
                model,
                f"{heads} {what}",
                f"they do not split over py = {py} (attention runs on whole heads of each y "
                "block, with their key/value heads)",
                f"pick a grid whose py divides {heads}",
            )


def check_call(model: nn.Module, grid: Grid, args: tuple, kwargs: dict) -> None:
    """The plan's ``before_forward``: the full batch ``idx [b, s]`` on every cube rank, no KV cache."""
    call = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    idx = call["idx"]
    if call.get("input_pos") is not None:
        raise ValueError("the parallelized LitGPT model keeps no KV cache: call it without input_pos")
    agree_on_first_call(model, grid.group("cube"), "parallelized LitGPT model input", idx=idx)
    if idx.dim() != 2:
        raise ValueError(
            f"idx {list(idx.shape)}: the parallelized model takes the full batch [b, s] on every cube rank"
        )


def use_grid_attention(model: nn.Module, grid: Grid) -> None:
    """The plan's ``prepare``: each block's attention computes on this rank's heads (same ``qkv``, ``proj``)."""
    config = model.config
    for block in model.transformer.h:
        block.attn = GridSelfAttention(
            block.attn.qkv, block.attn.proj, config.n_head // config.n_query_groups, config.head_size
        )


def litgpt_plan(model: nn.Module) -> Plan:
    """The plan of ``litgpt.model.GPT`` for ``model``'s config (see the module docstring)."""
    import litgpt.model as lm

    register_norm(
        lm.RMSNorm, "rmsnorm"
    )  # x̂·weight over the last dim; a unit offset (Gemma) is refused by check_litgpt
    config = model.config
    block = "transformer.h.*."
    rules = {"transformer.wte": VocabEmbedding()}
    if config.norm_1:
        rules[block + "norm_1"] = Norm("z")
    if config.norm_2 and not config.shared_attention_norm:
        rules[block + "norm_2"] = Norm("z")
    rules[block + "attn.qkv"] = QueryGroupedQKV(
        "z",
        groups=config.n_head // config.n_query_groups + 2,
        queries_per_kv=config.n_head // config.n_query_groups,
        head_size=config.head_size,
    )
    rules[block + "attn.proj"] = Linear("y")
    for fc in MLPS.get(config.mlp_class_name, ()):
        rules[block + f"mlp.{fc}"] = Linear("z")
    rules[block + "mlp.proj"] = Linear("y")
    rules["transformer.ln_f"] = Norm("z")
    rules["lm_head"] = LMHead()
    return Plan(
        rules,
        checkpoint=("transformer.h.*",),
        validate=check_litgpt,
        prepare=use_grid_attention,
        before_forward=check_call,
        attention={block + "attn": Attention(rope=("cos", "sin"))},  # causal SDPA; RoPE tables by argument
    )


def register_builtin_plan() -> None:
    """Register :func:`litgpt_plan` for ``litgpt.model.GPT`` by its qualified name (``litgpt`` is not imported)."""
    register_plan(GPT_CLASS, litgpt_plan)
