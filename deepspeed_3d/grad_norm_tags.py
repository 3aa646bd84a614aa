"""Tag parameters so that DeepSpeed's gradient norm counts every distinct shard exactly once.

Every DeepSpeed norm path (``runtime.utils.clip_grad_norm_`` and ``get_weight_norm``, ZeRO 1/2
and ZeRO 3 ``get_grad_norm_direct``, the bf16 optimizer's ``get_grads_for_norm``) squares a
parameter's gradient on a rank when ``is_model_parallel_parameter(p)`` (``p.model_parallel`` or
``p.tensor_model_parallel``) is true, or when the rank's model-parallel rank is 0; then it sums
over the model-parallel group (the cube) and, under ZeRO, over the dp partitions.

So a parameter is tagged true exactly where the project's counting rule counts it
(:func:`lightning_3d.grad_norm.counts_once`: coordinate 0 along every axis that replicates it; a
plain parameter on cube rank 0 only). Cube rank 0 is ``(0, 0, 0)``, a representative of every
value, so DeepSpeed's "or model-parallel rank 0" adds nothing twice.
"""

from __future__ import annotations

from torch import nn

from lightning_3d.grad_norm import counts_once
from lightning_3d.grid import Grid

TAGS = ("model_parallel", "tensor_model_parallel")


def tag_grad_norm_params(module: nn.Module, grid: Grid) -> None:
    """Set ``model_parallel`` and ``tensor_model_parallel`` on every parameter of ``module``."""
    for param in module.parameters():
        for tag in TAGS:
            setattr(param, tag, counts_once(param, grid))
