"""The cost model: what a training step on a 3-D grid costs, and which grid ``grid="auto"`` picks.

Three parts, each above what it prices (the grid, the layers' collectives): the machine's rates and
their measurement (:mod:`.machine`), the formulas for step time, memory and bytes sent
(:mod:`.formulas`), and the search over grids (:mod:`.search`).
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
    "best_grid",
    "candidates",
    "cube_grids",
    "fits",
    "grid_error",
    "measure_machine",
    "node_axes",
    "predict_3d",
    "predict_job",
    "sent_bytes",
    "token_rows",
]
