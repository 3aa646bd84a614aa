"""The MLP nonlinearity both models share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mlp_activation(style: str, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """gpt2: ``gelu_tanh(gate)`` (GPT-2's ``gelu_new``); llama: SwiGLU ``silu(gate) · up``."""
    if style == "gpt2":
        return F.gelu(gate, approximate="tanh")
    return F.silu(gate) * up
