"""The oldest version of each library that the project's tests ran with, and the refusal of older ones.

:data:`MINIMUMS` is the single source of the supported ranges: ``pyproject.toml``'s lower bounds
equal it (a test checks). Each integration calls :func:`require` for its library before using it
(the strategy modules of ``lightning_3d.strategy``: the Lightning package of their namespace, as
they are imported; ``deepspeed_3d``: DeepSpeed, as it is imported; the Hugging Face plans:
transformers, as a model is parallelized), so an unsupported version is refused with one message
rather than failing inside a forward. torch's minimum is enforced by the install alone. No upper
bounds: CI runs the newest versions as well as these.
"""

from __future__ import annotations

import importlib

# distribution name → the oldest supported version
MINIMUMS = {
    "torch": "2.11",
    "lightning": "2.6",
    "pytorch-lightning": "2.6",
    "lightning-fabric": "2.6",
    "deepspeed": "0.16",
    "transformers": "5.3",
}

# distribution name → the module whose __version__ is the installed version
_MODULES = {
    "torch": "torch",
    "lightning": "lightning",
    "pytorch-lightning": "pytorch_lightning",
    "lightning-fabric": "lightning_fabric",
    "deepspeed": "deepspeed",
    "transformers": "transformers",
}


def unsupported(package: str, installed: str) -> str | None:
    """Why version ``installed`` of ``package`` (a key of :data:`MINIMUMS`) is refused, with the fix; None if
    supported."""
    from packaging.version import Version  # a dependency of every integrated library, not of the core

    minimum = MINIMUMS[package]
    if Version(installed) >= Version(minimum):
        return None
    return (
        f"{package} {installed} is installed; lightning-3d supports {package}>={minimum}: "
        f'pip install "{package}>={minimum}"'
    )


def require(package: str) -> None:
    """Raise ``ImportError`` naming the installed version, the supported range and the fix if ``package`` is too old."""
    why = unsupported(package, str(importlib.import_module(_MODULES[package]).__version__))
    if why is not None:
        raise ImportError(why)
