"""``Tensor3DStrategy`` (the Trainer's) and ``Tensor3DFabricStrategy`` (Fabric's), both registered as ``"tensor3d"``.

Lightning ships under two names with distinct base classes and registries: ``lightning.pytorch``
and ``pytorch_lightning`` for the Trainer, ``lightning.fabric`` and ``lightning_fabric`` for
Fabric. Each gets its own class on that namespace's ``DDPStrategy``: ``Tensor3DMixin``
(:mod:`.base`) for the Trainer, ``Tensor3DFabricMixin`` (:mod:`.fabric_base`) for Fabric, both
sharing what does not depend on the namespace (:mod:`.grid_strategy`, :mod:`.checkpoints`, ...).
``Tensor3DStrategy`` here (and ``lightning_3d.Tensor3DStrategy``) is the ``lightning.pytorch`` one
when installed; ``Tensor3DFabricStrategy`` the ``lightning.fabric`` one.

This package does not import Lightning. :func:`register_on_import` (run by ``import
lightning_3d``) registers ``"tensor3d"`` in each namespace right after that namespace is
imported, or at once if it already is, so ``import lightning_3d`` stays light and
``Trainer(strategy="tensor3d")`` / ``Fabric(strategy="tensor3d")`` work in either order of imports.
"""

from __future__ import annotations

import importlib

from .registration import installed, register_when_imported

# Lightning namespace → the submodule of this package that defines (and registers) its class.
NAMESPACES = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}
FABRIC_NAMESPACES = {"lightning.fabric": "fabric", "lightning_fabric": "lightning_fabric"}
_CLASSES = {"Tensor3DStrategy": NAMESPACES, "Tensor3DFabricStrategy": FABRIC_NAMESPACES}


def register(namespace: str) -> type:
    """Import (and so register) the strategy class of ``namespace`` (a Trainer's or Fabric's); returns it."""
    for name, namespaces in _CLASSES.items():
        if namespace in namespaces:
            return getattr(importlib.import_module(f"{__name__}.{namespaces[namespace]}"), name)
    raise KeyError(f"{namespace!r} is none of the Lightning namespaces {[*NAMESPACES, *FABRIC_NAMESPACES]}")


def register_on_import() -> None:
    """Register ``"tensor3d"`` in every installed Lightning namespace, now or when it gets imported."""
    register_when_imported(
        {ns: f"{__name__}.{sub}" for ns, sub in {**NAMESPACES, **FABRIC_NAMESPACES}.items()}
    )


def __getattr__(name: str):
    if name in _CLASSES:
        for namespace in _CLASSES[name]:
            if installed(namespace):
                return register(namespace)
        raise ImportError(
            f"{name} needs Lightning: pip install lightning (or pytorch-lightning / lightning-fabric)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FABRIC_NAMESPACES",
    "NAMESPACES",
    "Tensor3DFabricStrategy",
    "Tensor3DStrategy",
    "register",
    "register_on_import",
]
