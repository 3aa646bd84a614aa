"""A model's sharding record: how its parameters lie on the grid, as plain data a checkpoint can carry.

``{"grid": [px, py, pz], "data_parallel_size": dp, "pipeline_size": pp, "stage": s, "params": {name:
{"global_shape": [...], "dims": [[axes of dim 0], ...]}}}`` names, for every sharded parameter (under
every name the module's state dict uses for it), the :class:`~lightning_3d.sharding.ShardSpec` that
places it on the grid. Parameters without a spec are replicated over the cube and are not listed.
With pipeline stages the module is stage ``s``'s (:class:`~deepspeed_3d.pipeline.StagePipelineModule`),
and each stage's files carry its own record.
``"dense_shapes"`` holds the shapes that modules declare for dense export
(:func:`lightning_3d.dense_twin.dense_shapes`: padded vocabularies, fused weights);
``"dense_transposed"`` the keys the dense twin stores transposed
(:func:`lightning_3d.dense_twin.dense_transposed`: Hugging Face ``Conv1D`` weights, ``[in, out]``);
``"dense_row_orders"`` the keys whose dense twin orders the rows otherwise
(:func:`lightning_3d.dense_twin.dense_row_orders`: LitGPT's grouped query heads);
``"dense_root"`` the model inside the module whose dense twin to export (its state-dict prefix,
class and config: :func:`lightning_3d.checkpoint.dense_root`).

Engines made by :func:`deepspeed_3d.initialize` save it in every checkpoint (client-state key
``"tensor3d_layout"``, the name checkpoints have always carried it under), so a checkpoint converts
to a dense state dict without the model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_3d.checkpoint import dense_root
from lightning_3d.dense_twin import dense_row_orders, dense_shapes, dense_transposed
from lightning_3d.grid import Grid
from lightning_3d.sharding import ShardSpec, get_spec

RECORD_KEY = "tensor3d_layout"


def sharding_record(module: nn.Module, grid: Grid) -> dict[str, Any]:
    """The sharding record of ``module`` on ``grid``."""
    params, first, ties = {}, {}, {}
    for name, param in module.named_parameters(remove_duplicate=False):
        spec = get_spec(param)
        if spec is not None:
            params[name] = {
                "global_shape": list(spec.global_shape),
                "dims": [list(axes) for axes in spec.dims],
            }
        ties[name] = first.setdefault(id(param), name)  # a tied parameter (an LM head's) → its first name
    return {
        "grid": list(grid.shape),
        "data_parallel_size": grid.data_parallel_size,
        "pipeline_size": grid.pipeline_size,
        "stage": grid.stage,
        "params": params,
        "dense_shapes": dense_shapes(module),
        "dense_transposed": dense_transposed(module),
        "dense_row_orders": dense_row_orders(module),
        "dense_root": dense_root(module),
        "ties": {k: v for k, v in ties.items() if k != v},
    }


def record_specs(record: dict[str, Any]) -> dict[str, ShardSpec]:
    """``{name: ShardSpec}`` of a sharding record."""
    return {
        name: ShardSpec(tuple(p["global_shape"]), tuple(tuple(axes) for axes in p["dims"]))
        for name, p in record["params"].items()
    }


def check_same_grid(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise ``ValueError`` when a checkpoint's grid or pipeline stages differ from the running one's."""
    if _shape(saved) != _shape(current):
        (grid, pp), (now, now_pp) = _shape(saved), _shape(current)
        raise ValueError(
            f"the checkpoint was saved on a {'×'.join(map(str, grid))} grid{_stages(pp)} but this run uses "
            f"{'×'.join(map(str, now))}{_stages(now_pp)}; DeepSpeed loads shards by model-parallel rank (and "
            "pipeline layers by stage), so run on the saved grid, or convert the checkpoint to a dense state "
            "dict (python -m deepspeed_3d.checkpoint to-dense) and load that"
        )


def _shape(record: dict[str, Any]) -> tuple[list[int], int]:
    return list(record["grid"]), record.get("pipeline_size", 1)  # records before pipelines had one stage


def _stages(pp: int) -> str:
    return f" in {pp} pipeline stages" if pp > 1 else ""
