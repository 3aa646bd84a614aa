"""Activation checkpointing of the plan's checkpoint units, switched by ``RuntimeOptions``."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..options import RuntimeOptions


def recompute_when_enabled(module: nn.Module, options: RuntimeOptions) -> None:
    """Make ``module``'s forward recompute in backward while ``options.activation_checkpointing`` is on.

    The module keeps its class, children and state-dict keys: its instance gets a ``forward`` that
    runs the class's through non-reentrant ``torch.utils.checkpoint`` (which restores the RNG
    state, so dropout masks are replayed) when checkpointing is on and gradients are enabled.
    """
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if options.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    module.forward = checkpointed
