"""The cost model: what a training step on a 3-D grid costs, and which grid ``grid="auto"`` picks.

Four parts, each above what it prices (the grid, the layers' collectives): the machine's rates and
their measurement (:mod:`.machine`), the formulas for step time, memory and bytes sent
(:mod:`.formulas`), pipeline stages' balanced split, bubble and hand-overs (:mod:`.pipeline`), and the
search over grids (:mod:`.search`).
"""

from .formulas import (
    BYTES,
    FP32,
    ModelShape,
    Prediction,
    grid_error,
    node_axes,
    predict_3d,
    predict_job,
    sent_bytes,
    token_rows,
)
from .machine import CPU, DEFAULT_MACHINE, GPU, OPS, Link, Machine, Sizes, measure_machine
from .pipeline import (
    StageCosts,
    balanced_counts,
    bubble_fraction,
    hand_over_bytes,
    order_bubble,
    pipeline_error,
    predict_pipeline,
    split_points,
    stage_costs,
)
from .search import best_grid, candidates, cube_grids, fits

__all__ = [
    "BYTES",
    "CPU",
    "DEFAULT_MACHINE",
    "FP32",
    "GPU",
    "OPS",
    "Link",
    "Machine",
    "ModelShape",
    "Prediction",
    "Sizes",
    "StageCosts",
    "balanced_counts",
    "best_grid",
    "bubble_fraction",
    "candidates",
    "cube_grids",
    "fits",
    "grid_error",
    "hand_over_bytes",
    "measure_machine",
    "node_axes",
    "order_bubble",
    "pipeline_error",
    "predict_3d",
    "predict_job",
    "predict_pipeline",
    "sent_bytes",
    "split_points",
    "stage_costs",
    "token_rows",
]
