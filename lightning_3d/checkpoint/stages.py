"""What a checkpoint of pipeline stages gathers over the stages: the whole model's names and shapes.

A rank of stage ``s`` holds only its stages' modules, each parameter under its name in the whole
model (:mod:`lightning_3d.pipeline.stages`), so DCP's shards of all stages together hold the whole
model under the same keys as one stage would, and a checkpoint does not depend on the split.
What a single rank knows of the model must be gathered: the sharding record's true shapes and
layouts (written by rank 0, of stage 0), an optimizer's param groups (parameters by name) and the
keys and shapes a load checks against the checkpoint's. Each is gathered over this rank's
``"pipe"`` group (one rank of every stage, with this rank's dp and cube coordinates), so every
rank gets the whole model's; with one stage nothing is communicated.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..grid import Grid
from .files import CheckpointError


def over_stages(value: Any, grid: Grid) -> list[Any]:
    """``value`` of every rank of this rank's ``"pipe"`` group, in stage order (``[value]`` with one stage).
    Collective over that group."""
    if grid.pipeline_size == 1:
        return [value]
    gathered: list[Any] = [None] * grid.pipeline_size
    dist.all_gather_object(gathered, value, group=grid.group("pipe"))
    return gathered


def whole_model(parts: dict[str, dict | list], grid: Grid) -> dict[str, dict | list]:
    """``parts`` (each a dict or a list by state-dict key: shapes, layouts) united over the stages: the whole
    model's. Collective over the ``"pipe"`` group."""
    merged: dict[str, dict | list] = {}
    for stage in over_stages(parts, grid):
        for name, part in stage.items():
            if isinstance(part, dict):
                merged.setdefault(name, {}).update(part)
            else:
                merged[name] = sorted({*merged.get(name, []), *part})
    return merged


def whole_param_groups(param_groups: list[dict], grid: Grid) -> list[dict]:
    """An optimizer's param groups (``"params"``: parameter names) over every stage: group ``k`` holds the
    names of every stage's group ``k`` in stage order, and stage 0's other entries (``lr``, ...). Collective
    over the ``"pipe"`` group.

    Raises:
        CheckpointError: the stages' optimizers have different numbers of param groups (each stage must
            make the same groups, of its own parameters).
    """
    per_stage = over_stages(param_groups, grid)
    counts = [len(groups) for groups in per_stage]
    if len(set(counts)) > 1:
        raise CheckpointError(
            f"the pipeline stages' optimizers have {counts} param groups (stage by stage): each stage must make "
            "the same groups of its own parameters (an empty group where a stage has none of a group's kind)"
        )
    return [
        {**groups[0], "params": list(dict.fromkeys(n for g in groups for n in g["params"]))}
        for groups in zip(*per_stage)
    ]
