"""``"tensor3d_deepspeed"``: Lightning's DeepSpeed strategy on the 3-D grid, in both Lightning namespaces.

``lightning.pytorch`` and ``pytorch_lightning`` have distinct base classes and registries, so each
gets its own class from one definition (:func:`~deepspeed_3d.strategy.factory.define_strategy`):
``deepspeed_3d.strategy.lightning.Tensor3DDeepSpeedStrategy`` and
``deepspeed_3d.strategy.pytorch_lightning.Tensor3DDeepSpeedStrategy``. :func:`register_installed`
(run by ``import deepspeed_3d``) defines and registers the class of every installed namespace.
"""

from __future__ import annotations

import importlib
import importlib.util

# Lightning namespace → the submodule of this package that defines (and registers) its class.
NAMESPACES = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}


def _installed(namespace: str) -> bool:
    return importlib.util.find_spec(namespace.split(".")[0]) is not None


def register_installed() -> list[type]:
    """Define and register ``"tensor3d_deepspeed"`` in every installed Lightning namespace; returns the classes.

    The first is ``lightning.pytorch``'s when installed, else ``pytorch_lightning``'s.
    """
    return [importlib.import_module(f"{__name__}.{sub}").Tensor3DDeepSpeedStrategy for ns, sub in NAMESPACES.items() if _installed(ns)]


__all__ = ["NAMESPACES", "register_installed"]
