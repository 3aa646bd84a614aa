"""Register strategies in Lightning's registries when Lightning gets imported, without importing it.

Lightning ships as ``lightning.pytorch`` and ``pytorch_lightning``, with distinct registries. A
module that defines a strategy class for one namespace registers it as it is imported;
:func:`register_when_imported` imports such modules at once when their namespace already is
imported, and otherwise right after it is (a finder on ``sys.meta_path`` wraps the namespace's
loader). ``import lightning_3d`` thus stays light, and ``Trainer(strategy="tensor3d")`` works in
either order of imports.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys


def installed(namespace: str) -> bool:
    """Whether the Lightning package of ``namespace`` can be imported (without importing it)."""
    top = namespace.split(".")[0]
    return sys.modules.get(top) is not None or importlib.util.find_spec(top) is not None


_after: dict[str, list[str]] = {}  # a strategy module under way → the pending modules that wait for it


def _import_pending(modules: list[str]) -> None:
    """Import ``modules`` in order. One already in ``sys.modules`` is under way (its import imported
    the namespace, which brought us here): it registers itself, and the modules after it, which may
    import it (DeepSpeed's strategy subclasses the plain one), wait until it calls :func:`imported`."""
    for i, name in enumerate(modules):
        if name in sys.modules:
            _after.setdefault(name, []).extend(modules[i + 1 :])
            return
        importlib.import_module(name)


def imported(module: str) -> None:
    """Called by a strategy module at its end: import the pending modules that waited for it."""
    _import_pending(_after.pop(module, []))


class _ThenRegister(importlib.abc.Loader):
    """Wraps a namespace's loader: executes the namespace, then imports its pending strategy modules."""

    def __init__(self, loader, pending: dict[str, list[str]]):
        self._loader, self._pending = loader, pending

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _import_pending(self._pending.pop(module.__name__, []))

    def __getattr__(
        self, name
    ):  # everything else (get_data, is_package, resource readers) as the real loader
        return getattr(self._loader, name)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds a watched namespace with the other finders and wraps its loader in :class:`_ThenRegister`."""

    def __init__(self):
        self.pending: dict[str, list[str]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:  # find_spec may be called without an import: pop only on exec
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenRegister(spec.loader, self.pending)
                return spec
        return None


_finder = _RegisterAfterImport()


def register_when_imported(strategy_modules: dict[str, str]) -> None:
    """``{namespace: module}``: import each module now if its namespace is imported, else right after it is."""
    for namespace, module in strategy_modules.items():
        if namespace in sys.modules:
            _import_pending([module])
        elif installed(namespace):
            _finder.pending.setdefault(namespace, []).append(module)
    if _finder.pending and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
