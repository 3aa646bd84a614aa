"""transformers' ``create_causal_mask``, called alike on every supported transformers version.

Its arguments changed between releases: the embeddings are ``input_embeds`` in 5.0 and
``inputs_embeds`` later; the cache is ``past_key_values`` until 5.17 and ``cache`` by 5.24;
``cache_position`` is required in 5.0-5.2 and gone by 5.17. The names are read from its signature
once, as this module is imported (only when a Hugging Face model builds a mask, so
``transformers`` stays out of ``import lightning_3d``). A model that runs lightning_3d's attention
(:mod:`.attention`, in place of ``"sdpa"``) gets the mask ``"sdpa"`` builds.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, find_packed_sequence_indices

from . import attention

_PARAMETERS = frozenset(inspect.signature(create_causal_mask).parameters)
_EMBEDS = "inputs_embeds" if "inputs_embeds" in _PARAMETERS else "input_embeds"
_CACHE = "cache" if "cache" in _PARAMETERS else "past_key_values"


def _every_pair(
    batch_idx: torch.Tensor, head_idx: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
) -> torch.Tensor:
    """A mask function that keeps every (query, key) pair: and-ed to the causal mask, it changes nothing."""
    return q_idx.new_ones((), dtype=torch.bool)


class _RunningSdpa:
    """A config as the mask builder reads it, its attention implementation ``"sdpa"``."""

    _attn_implementation = "sdpa"

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def causal_mask(
    model: nn.Module,
    embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    *,
    may_skip: bool,
) -> torch.Tensor | None:
    """The mask ``model`` builds for a batch of ``embeds`` ``[b, s, ·]`` with a 2-D padding mask and position ids.

    ``may_skip``: whether a plain causal mask may come back as None (the attention then runs causal
    on its own); otherwise the mask is always built (any mask function makes transformers build it).
    """
    config = model.config
    kwargs = {
        "config": _RunningSdpa(config) if config._attn_implementation == attention.NAME else config,
        _EMBEDS: embeds,
        "attention_mask": attention_mask,
        _CACHE: None,
        "position_ids": position_ids,
    }
    if "cache_position" in _PARAMETERS:
        kwargs["cache_position"] = torch.arange(embeds.shape[1], device=embeds.device)
    if not may_skip:
        kwargs["and_mask_function"] = _every_pair
    return create_causal_mask(**kwargs)


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The segment of each token ``[b, s]`` where ``position_ids`` ``[b, s]`` pack several sequences in a
    row (a position that does not follow the one before starts a segment), or None where no row
    does: how transformers reads packed sequences (only without a 2-D mask and a cache)."""
    return find_packed_sequence_indices(position_ids)
