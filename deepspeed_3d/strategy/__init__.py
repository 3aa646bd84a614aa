"""``"tensor3d_deepspeed"``: Lightning's DeepSpeed strategy on the 3-D grid, in both Lightning namespaces.

``lightning.pytorch`` and ``pytorch_lightning`` have distinct base classes and registries, so each
gets its own class, ``Tensor3DDeepSpeedMixin`` (:mod:`.base`, the shared behaviour) on that
namespace's ``DeepSpeedStrategy``:
``deepspeed_3d.strategy.lightning.Tensor3DDeepSpeedStrategy`` and
``deepspeed_3d.strategy.pytorch_lightning.Tensor3DDeepSpeedStrategy``. :func:`register_on_import`
(run by ``import deepspeed_3d``) registers ``"tensor3d_deepspeed"`` in each namespace when that
namespace is imported (at once if it already is), without importing Lightning itself.
"""

from __future__ import annotations

import importlib

from lightning_3d.strategy.registration import installed, register_when_imported

# Lightning namespace → the submodule of this package that defines (and registers) its class.
NAMESPACES = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}


def register(namespace: str) -> type:
    """Import (and so register) the strategy class of ``namespace``; returns it."""
    return importlib.import_module(f"{__name__}.{NAMESPACES[namespace]}").Tensor3DDeepSpeedStrategy


def register_on_import() -> None:
    """Register ``"tensor3d_deepspeed"`` in every installed Lightning namespace, now or when it gets imported."""
    register_when_imported({ns: f"{__name__}.{sub}" for ns, sub in NAMESPACES.items()})


def strategy_class() -> type:
    """``lightning.pytorch``'s class when installed, else ``pytorch_lightning``'s."""
    for namespace in NAMESPACES:
        if installed(namespace):
            return register(namespace)
    raise ImportError(
        "Tensor3DDeepSpeedStrategy needs Lightning: pip install lightning (or pytorch-lightning)"
    )


__all__ = ["NAMESPACES", "register", "register_on_import", "strategy_class"]
