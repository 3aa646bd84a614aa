"""``python -m lightning_3d.strategy.fabric_cli run --strategy tensor3d --devices 8 train.py``: ``fabric run``
knowing ``"tensor3d"``.

Fabric's command line checks ``--strategy`` against its strategy registry as the ``fabric``
command starts, in a process that has not imported ``lightning_3d``, so the stock ``fabric run``
refuses ``--strategy tensor3d`` (it launches ``Fabric(strategy="tensor3d")`` scripts fine without
the flag). This module registers the strategy first and then runs Fabric's command line itself:
the same commands and options (``run``, ``consolidate``), the same launch through ``torchrun``.
The script must ``import lightning_3d`` before ``Fabric()`` reads the strategy name.
"""

from __future__ import annotations

import importlib

from . import register
from .registration import installed


def main() -> None:
    """Register ``"tensor3d"`` in the installed Fabric namespace, then run its command line (``sys.argv``)."""
    namespace = "lightning.fabric" if installed("lightning.fabric") else "lightning_fabric"
    register(namespace)
    importlib.import_module(f"{namespace}.cli")._main()


if __name__ == "__main__":
    main()
