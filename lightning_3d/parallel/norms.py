"""Which normalisation classes a :class:`~lightning_3d.parallel.rules.Norm` rule can replace.

A norm class is registered by the class or by its name (so a library's class, such as Hugging
Face's ``LlamaRMSNorm``, can be registered without importing the library) with what it computes:
``"layernorm"`` (centre, scale, optional bias) or ``"rmsnorm"`` (scale only), and the attribute that
holds its epsilon. Its affine weight must be ``weight`` (``[N]``, applied as ``x̂ · weight``) and its
bias ``bias``; anything else (e.g. a ``(1 + weight)`` scale) must not be registered.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

KINDS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class NormKind:
    """What a registered norm class computes: ``center`` (LayerNorm) or not (RMSNorm); ``eps_attr`` holds its
    epsilon."""

    center: bool
    eps_attr: str


_registry: dict[type | str, NormKind] = {}


def register_norm(cls: type | str, kind: str, eps_attr: str = "eps") -> None:
    """Register a norm class (or class name) as ``kind`` (``"layernorm"`` or ``"rmsnorm"``)."""
    if kind not in KINDS:
        raise ValueError(f"norm kind must be one of {KINDS}, got {kind!r}")
    _registry[cls] = NormKind(kind == "layernorm", eps_attr)


def norm_kind(module: nn.Module) -> NormKind | None:
    """The registered kind of ``module``'s class (or of a base class), by class or by name; None if unregistered."""
    for cls in type(module).__mro__:
        for key in (cls, cls.__name__):
            if key in _registry:
                return _registry[key]
    return None


register_norm(nn.LayerNorm, "layernorm")
register_norm(nn.RMSNorm, "rmsnorm")
