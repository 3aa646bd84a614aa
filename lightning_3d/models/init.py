"""The weight initialisation both models share (GPT-2's), keyed by dense state-dict name.

Both models draw every tensor in the order of ``DenseGPT.state_dict()`` from the default
generator, so the same seed gives the same weights on every grid and in the dense twin.
"""

from __future__ import annotations

import math

import torch

from .config import GPTConfig

STD = 0.02


@torch.no_grad()
def init_dense_tensor_(key: str, t: torch.Tensor, config: GPTConfig) -> None:
    """Fill the dense tensor ``key``: norms 1, biases 0, residual projections ``N(0, 0.02/√(2L))``, the rest
    ``N(0, 0.02)``."""
    if key.endswith(".bias"):
        t.zero_()
    elif ".ln_" in key or key.startswith("transformer.ln_f"):
        t.fill_(1.0)
    elif key.endswith("c_proj.weight"):
        t.normal_(0.0, STD / math.sqrt(2 * config.n_layer))
    else:
        t.normal_(0.0, STD)
