"""``measure_machine`` under its earlier module: it lives in :mod:`lightning_3d.cost.machine`."""

from .cost.machine import CPU, GPU, Sizes, measure_machine  # noqa: F401
