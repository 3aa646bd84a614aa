"""Tag parameters so that DeepSpeed's gradient norm counts every distinct shard exactly once.

Every DeepSpeed norm path (``runtime.utils.clip_grad_norm_``, ``get_weight_norm``, ZeRO 1/2
``get_grad_norm_direct``, ZeRO 3 ``get_grad_norm_direct``, the bf16 optimizer's
``get_grads_for_norm``) squares a parameter's gradient on a rank when
``is_model_parallel_parameter(p)`` (``p.model_parallel`` or ``p.tensor_model_parallel``) is true,
or when the rank's model-parallel rank is 0; then it sums over the model-parallel group (the cube).

So a parameter is tagged true exactly on its representative ranks (coordinate 0 along every axis
that replicates it, :meth:`~lightning_3d.sharding.ShardSpec.is_representative`). Cube rank 0 is
``(0, 0, 0)``, a representative of every value, so the untagged-but-rank-0 rule adds nothing
twice; a plain parameter without a shard spec is replicated over the whole cube and counted on
cube rank 0 alone.
"""

from __future__ import annotations

from torch import nn

from lightning_3d.grid import Grid
from lightning_3d.sharding import get_spec

TAGS = ("model_parallel", "tensor_model_parallel")


def counts_here(param: nn.Parameter, grid: Grid) -> bool:
    """Whether this rank holds the copy of ``param`` that the global gradient norm counts."""
    spec = get_spec(param)
    return spec.is_representative(grid) if spec is not None else grid.rank_in("cube") == 0


def tag_grad_norm_params(module: nn.Module, grid: Grid) -> None:
    """Set ``model_parallel`` and ``tensor_model_parallel`` on every parameter of ``module``."""
    for param in module.parameters():
        for tag in TAGS:
            setattr(param, tag, counts_here(param, grid))
