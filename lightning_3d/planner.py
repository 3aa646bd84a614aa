"""The cost model's names under their earlier module: everything here lives in :mod:`lightning_3d.cost`
(:mod:`~lightning_3d.cost.formulas`, :mod:`~lightning_3d.cost.search`, :mod:`~lightning_3d.cost.machine`)."""

from .cost import (  # noqa: F401
    BYTES,
    DEFAULT_MACHINE,
    FP32,
    OPS,
    Link,
    Machine,
    ModelShape,
    Prediction,
    best_grid,
    candidates,
    cube_grids,
    fits,
    grid_error,
    node_axes,
    predict_3d,
    predict_job,
    sent_bytes,
)
