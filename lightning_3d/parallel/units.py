"""The plan's checkpoint units (a model's Transformer blocks): recomputed and compiled as the model's options say.

Compiling a unit fuses the work between its 3-D products (norms, activations, residual adds,
rotary embeddings, attention) with Inductor, as ``torch.compile`` per block does for a dense model.
The steps that communicate (the 3-D products, the all-reduces of norm statistics and replicated
gradients) are custom ops inside the graph, opaque to the compiler, that run as they do eagerly
with their own overlap of communication and computation: a unit is one graph on every grid
(dropout with a probability above zero, whose per-rank masks the compiler's RNG would not follow,
breaks it).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..runtime import Runtime


def run_as_unit(module: nn.Module, runtime: Runtime) -> None:
    """Give ``module`` a forward that follows its model's ``runtime.options.compile`` and
    ``runtime.options.activation_checkpointing``.

    The module keeps its class, children and state-dict keys: its instance gets a ``forward`` that
    runs the class's, compiled (``torch.compile``, built at the first call that asks for it) while
    ``compile`` is on, and through non-reentrant ``torch.utils.checkpoint`` (which restores the
    RNG state, so dropout masks are replayed, and the runtime's ``token_rows``) while checkpointing
    is on and gradients are enabled.
    """
    forward = module.forward
    compiled = None

    @functools.wraps(forward)
    def unit_forward(*args, **kwargs):
        nonlocal compiled
        run, options = forward, runtime.options
        if options.compile:
            if compiled is None:
                compiled = torch.compile(forward)
            run = compiled
        if options.activation_checkpointing and torch.is_grad_enabled():
            rows = runtime.token_rows  # the recomputation runs on this forward's rows
            return checkpoint(
                run,
                *args,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), runtime.on_rows(rows)),
                **kwargs,
            )
        return run(*args, **kwargs)

    module.forward = unit_forward
