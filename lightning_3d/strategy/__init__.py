"""``Tensor3DStrategy``: 3-D tensor parallelism as a Lightning strategy, registered as ``"tensor3d"``.

Lightning ships under two names with distinct base classes and registries, ``lightning.pytorch``
and ``pytorch_lightning``; each gets its own class, ``Tensor3DMixin`` (:mod:`.base`, the shared
behaviour) on that namespace's ``DDPStrategy``:
``lightning_3d.strategy.lightning.Tensor3DStrategy`` and
``lightning_3d.strategy.pytorch_lightning.Tensor3DStrategy``. ``Tensor3DStrategy`` here (and
``lightning_3d.Tensor3DStrategy``) is the ``lightning.pytorch`` one when installed.

This package does not import Lightning. :func:`register_on_import` (run by ``import
lightning_3d``) registers ``"tensor3d"`` in each namespace right after that namespace is
imported, or at once if it already is, so ``import lightning_3d`` stays light and
``Trainer(strategy="tensor3d")`` works in either order of imports.
"""

from __future__ import annotations

import importlib

from .registration import installed, register_when_imported

# Lightning namespace → the submodule of this package that defines (and registers) its class.
NAMESPACES = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}


def register(namespace: str) -> type:
    """Import (and so register) the strategy class of ``namespace``; returns it."""
    return importlib.import_module(f"{__name__}.{NAMESPACES[namespace]}").Tensor3DStrategy


def register_on_import() -> None:
    """Register ``"tensor3d"`` in every installed Lightning namespace, now or when it gets imported."""
    register_when_imported({ns: f"{__name__}.{sub}" for ns, sub in NAMESPACES.items()})


def __getattr__(name: str):
    if name == "Tensor3DStrategy":
        for namespace in NAMESPACES:
            if installed(namespace):
                return register(namespace)
        raise ImportError("Tensor3DStrategy needs Lightning: pip install lightning (or pytorch-lightning)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NAMESPACES", "Tensor3DStrategy", "register", "register_on_import"]
