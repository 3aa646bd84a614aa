"""``Tensor3DStrategy``: 3-D tensor parallelism as a Lightning strategy, registered as ``"tensor3d"``.

Lightning ships under two names with distinct base classes and registries, ``lightning.pytorch``
and ``pytorch_lightning``; each gets its own class, built from one definition
(:func:`~lightning_3d.strategy.factory.define_strategy`):
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
import importlib.abc
import importlib.util
import sys

# Lightning namespace → the submodule of this package that defines (and registers) its class.
NAMESPACES = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}


def _installed(namespace: str) -> bool:
    top = namespace.split(".")[0]
    return sys.modules.get(top) is not None or importlib.util.find_spec(top) is not None


def register(namespace: str) -> type:
    """Define (once) and register the strategy class of ``namespace``; returns it."""
    return importlib.import_module(f"{__name__}.{NAMESPACES[namespace]}").Tensor3DStrategy


class _ThenRegister(importlib.abc.Loader):
    """Wraps a module's loader: executes the module, then registers the strategy for it."""

    def __init__(self, loader, namespace: str):
        self._loader, self._namespace = loader, namespace

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if f"{__name__}.{NAMESPACES[self._namespace]}" not in sys.modules:  # else that import, under way, registers
            register(self._namespace)

    def __getattr__(self, name):  # everything else (get_data, is_package, resource readers) as the real loader
        return getattr(self._loader, name)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds a watched Lightning namespace with the other finders and wraps its loader in :class:`_ThenRegister`."""

    def __init__(self, namespaces: list[str]):
        self.pending = set(namespaces)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenRegister(spec.loader, fullname)
                return spec
        return None


def register_on_import() -> None:
    """Register ``"tensor3d"`` in every installed Lightning namespace, now or when it gets imported."""
    watch = []
    for namespace in NAMESPACES:
        if namespace in sys.modules:
            register(namespace)
        elif _installed(namespace):
            watch.append(namespace)
    if watch and not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport(watch))


def __getattr__(name: str):
    if name == "Tensor3DStrategy":
        for namespace in NAMESPACES:
            if _installed(namespace):
                return register(namespace)
        raise ImportError("Tensor3DStrategy needs Lightning: pip install lightning (or pytorch-lightning)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NAMESPACES", "Tensor3DStrategy", "register", "register_on_import"]
