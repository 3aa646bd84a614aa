"""The attention of a parallelized Hugging Face model: transformers' ``"sdpa"`` on whole-sequence rows,
:meth:`~lightning_3d.token_rows.TokenRows.attend` on token rows.

:func:`attention` is registered with transformers' ``AttentionInterface`` as ``"lightning_3d"``; the
plans install it in a model that runs ``"sdpa"`` (:func:`install`: the model's own
``set_attn_implementation``), and an ``"eager"`` model keeps its own attention (whole-sequence rows
only). Each call says what its rows are through the keyword arguments that transformers hands
every attention function from the model's call (the plan's ``before_forward`` adds them,
:func:`~lightning_3d.hf.interface.lay_out_inputs`):

- whole-sequence rows (no ``token_rows``): transformers' ``"sdpa"`` function, with the mask of
  this rank's y rows that ``before_forward`` built as ``"sdpa"`` builds it (transformers builds
  none for an implementation that registers no mask function);
- token rows (``token_rows``, the call's :class:`~lightning_3d.token_rows.TokenRows`): split
  attention (:meth:`~lightning_3d.token_rows.TokenRows.sdpa`, as explicit plans' attention runs),
  ``attention_mask`` being the rows' own
  (:meth:`~lightning_3d.token_rows.TokenRows.attention_mask`, or None: plain causal).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ..token_rows import TokenRows

NAME = "lightning_3d"


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    token_rows: TokenRows | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: ``query`` ``[rows, heads, L, d]`` and ``key``,
    ``value`` ``[rows, kv_heads, L, d]`` (y-layout rows, the heads of y block ``j``) →
    ``([rows, L, heads, d], None)``."""
    if token_rows is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    causal = attention_mask is None
    out = token_rows.sdpa(query, key, value, attention_mask, dropout, is_causal=causal, scale=scaling)
    return out.transpose(1, 2), None


AttentionInterface.register(NAME, attention)


def install(model: nn.Module) -> None:
    """Run ``model``'s attention through :func:`attention` where it runs ``"sdpa"``."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
