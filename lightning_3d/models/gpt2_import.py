"""Import of Hugging Face ``transformers`` GPT-2 weights (``GPT2LMHeadModel``).

Works on plain state dicts and config dicts, so ``transformers`` itself is never imported here.
HF's GPT-2 already uses nanoGPT's names; its ``Conv1D`` weights are stored ``[in, out]`` and are
transposed to ``nn.Linear``'s ``[out, in]``; its causal-mask buffers are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..grid import Grid
from .config import GPTConfig
from .gpt3d import GPT3D

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _as_dict(hf_config: Any) -> Mapping[str, Any]:
    return hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()


def gpt_config_from_hf(hf_config: Any, **overrides) -> GPTConfig:
    """A gpt2-style :class:`GPTConfig` from a ``GPT2Config`` (or its ``to_dict()``); ``overrides`` win.

    ``dropout`` takes ``resid_pdrop`` (GPT3D has no attention-probability dropout).

    Raises:
        ValueError: the HF model computes something GPT3D does not (another activation, or
            attention scaled other than by ``1/sqrt(head_dim)``).
    """
    c = _as_dict(hf_config)
    act = c.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        raise ValueError(
            f"GPT2Config.activation_function={act!r}: GPT3D's gpt2 style uses the tanh GELU {TANH_GELUS}"
        )
    if c.get("scale_attn_by_inverse_layer_idx", False) or not c.get("scale_attn_weights", True):
        raise ValueError(
            "GPT2Config: GPT3D scales attention by 1/sqrt(head_dim) only; set scale_attn_weights=True, "
            "scale_attn_by_inverse_layer_idx=False"
        )
    fields = dict(
        vocab_size=c["vocab_size"],
        block_size=c["n_positions"],
        n_layer=c["n_layer"],
        n_head=c["n_head"],
        n_embd=c["n_embd"],
        dropout=c.get("resid_pdrop", 0.0),
        bias=True,
        tie_embeddings=c.get("tie_word_embeddings", True),
        style="gpt2",
        ffn_hidden=c.get("n_inner") or 4 * c["n_embd"],
        norm_eps=c.get("layer_norm_epsilon", 1e-5),
    )
    fields.update(overrides)
    return GPTConfig(**fields)


def dense_state_dict_from_hf(
    hf_state_dict: Mapping[str, torch.Tensor], tie_embeddings: bool = True
) -> dict[str, torch.Tensor]:
    """``GPT2LMHeadModel.state_dict()`` → ``DenseGPT.state_dict()`` (load it with ``load_dense_state_dict``).

    A tied head's ``lm_head.weight`` is the token embedding, whether or not the HF state dict lists it.
    """
    out = {}
    for key, t in hf_state_dict.items():
        if key.endswith(MASK_BUFFERS) or key == "lm_head.weight":
            continue
        out[key] = t.t().contiguous() if key.endswith(CONV1D_WEIGHTS) else t
    out["lm_head.weight"] = (
        out["transformer.wte.weight"] if tie_embeddings else hf_state_dict["lm_head.weight"]
    )
    return out


def gpt3d_from_hf(hf_model: Any, grid: Grid | None = None, **kwargs) -> GPT3D:
    """A :class:`GPT3D` holding a ``GPT2LMHeadModel``'s weights (``kwargs`` go to ``GPT3D``)."""
    config = gpt_config_from_hf(hf_model.config)
    model = GPT3D(config, grid, **kwargs)
    model.load_dense_state_dict(dense_state_dict_from_hf(hf_model.state_dict(), config.tie_embeddings))
    return model
