"""The Transformer block on the 3-D layers: z-layout in, z-layout out.

Attention: ``c_attn`` (FusedLinear3D, z→y) gives q, k, v of the heads of y block ``j`` on rank
``(i, j, l)``, for whole sequences, so causal attention is local; ``c_proj`` (y→z) returns to z.
MLP: ``c_fc`` (z→y; fused gate/up for llama) → activation → ``c_proj`` (y→z).
"""

from __future__ import annotations

import torch
from torch import nn

from ..grid import Grid
from ..layers import Dropout3D, LayerNorm3D, Linear3D, RMSNorm3D
from .attention import causal_attention
from .config import GPTConfig
from .fused_linear import FusedLinear3D
from .mlp import mlp_activation


def norm3d(config: GPTConfig, grid: Grid, **factory) -> nn.Module:
    """The style's norm on z-layout activations."""
    if config.style == "gpt2":
        return LayerNorm3D(config.n_embd, eps=config.norm_eps, bias=config.bias, layout="z", grid=grid, **factory)
    return RMSNorm3D(config.n_embd, eps=config.norm_eps, layout="z", grid=grid, **factory)


class Attention3D(nn.Module):
    def __init__(self, config: GPTConfig, grid: Grid, save_gathered: bool = True, **factory):
        super().__init__()
        h = config.n_embd
        self.head_dim = config.head_dim
        self.c_attn = FusedLinear3D(h, h, 3, bias=config.bias, input_layout="z", grid=grid, save_gathered=save_gathered, **factory)
        self.c_proj = Linear3D(h, h, bias=config.bias, input_layout="y", grid=grid, save_gathered=save_gathered, **factory)
        self.resid_dropout = Dropout3D(config.dropout)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        q, k, v = self.c_attn(x)  # each [b/(px·pz), s, h/py]: the heads of y block j
        return self.resid_dropout(self.c_proj(causal_attention(q, k, v, self.head_dim, rope)))


class MLP3D(nn.Module):
    def __init__(self, config: GPTConfig, grid: Grid, save_gathered: bool = True, **factory):
        super().__init__()
        self.style = config.style
        h, ffn = config.n_embd, config.ffn_hidden
        common = dict(bias=config.bias, input_layout="z", grid=grid, save_gathered=save_gathered, **factory)
        self.c_fc = FusedLinear3D(h, ffn, 2, **common) if self.style == "llama" else Linear3D(h, ffn, **common)
        self.c_proj = Linear3D(ffn, h, bias=config.bias, input_layout="y", grid=grid, save_gathered=save_gathered, **factory)
        self.dropout = Dropout3D(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.c_fc(x) if self.style == "llama" else (self.c_fc(x),)
        return self.dropout(self.c_proj(mlp_activation(self.style, *parts)))


class Block3D(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``+ mlp(ln_2(·))``, on z-layout ``[b/(px·py), s, h/pz]``."""

    def __init__(self, config: GPTConfig, grid: Grid, save_gathered: bool = True, **factory):
        super().__init__()
        self.ln_1 = norm3d(config, grid, **factory)
        self.attn = Attention3D(config, grid, save_gathered, **factory)
        self.ln_2 = norm3d(config, grid, **factory)
        self.mlp = MLP3D(config, grid, save_gathered, **factory)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))
