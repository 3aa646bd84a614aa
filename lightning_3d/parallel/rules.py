"""The rules of a plan: how one ``torch.nn`` module becomes its 3-D counterpart.

A rule builds the 3-D module on the ``meta`` device from the dense one (sizes, dtype, options) and
names the dense tensors its parameters come from; :func:`~lightning_3d.parallel.parallelize`
allocates, fills and shards them. Parameters of the built module have the dense module's names
(``weight``, ``bias``), so a state dict keeps its keys. Subclass :class:`Rule` for a module kind
not covered here.

Activations between the layers are in the ``"z"`` or ``"y"`` layout
(:mod:`lightning_3d.layout`); a linear turns its input layout into the other one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from ..grid import Grid
from ..layers import (
    CrossEntropyLoss3D,
    Dropout3D,
    FusedLinear3D,
    LayerNorm3D,
    Linear3D,
    LMHead3D,
    PaddedEmbedding3D,
    PositionEmbedding3D,
    RMSNorm3D,
    padded_vocab_size,
)
from ..layout import as_layout
from ..options import RuntimeOptions
from .norms import norm_kind

META = torch.device("meta")


def _refuse(name: str, module: nn.Module, why: str, fix: str) -> None:
    raise ValueError(f"{name} ({type(module).__name__}): {why}; {fix}")


def _dtype(module: nn.Module) -> torch.dtype | None:
    p = next(module.parameters(recurse=False), None)
    return p.dtype if p is not None else None


class Rule(ABC):
    """Turns one dense module into a 3-D module."""

    @abstractmethod
    def build(self, name: str, module: nn.Module, grid: Grid, options: RuntimeOptions) -> nn.Module:
        """The 3-D module replacing ``module`` (at ``name`` in the model), parameters on ``meta``.

        Raises ``ValueError`` naming ``name`` for a module it cannot represent exactly.
        """

    def dense_tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """For each parameter of the built module, the dense tensor of ``module`` it holds, as
        ``module`` stores it: the built module's dense state dict entry (its ``dense_shapes`` where
        declared, else its global shape; transposed where it declares ``dense_transposed``)."""
        return {n: p for n, p in module.named_parameters(recurse=False)}


def _linear_sizes(name: str, module: nn.Module, transposed: bool) -> tuple[int, int]:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        _refuse(name, module, "a Linear rule needs a 2-D `weight`", "map it with another rule")
    out_features, in_features = weight.shape[::-1] if transposed else weight.shape
    return in_features, out_features


@dataclass(frozen=True)
class Linear(Rule):
    """``y = x Wᵀ + b`` (``nn.Linear``, or any module with ``weight`` ``[out, in]`` and an optional ``bias``).

    Args:
        input_layout: the layout of the activation the module reads, ``"z"`` or ``"y"``; its
            output is in the other layout.
        groups: ``G > 1`` for ``G`` projections packed in one weight ``[G·out, in]`` whose output
            the model splits with ``chunk(G, -1)`` (q/k/v: 3; gate/up: 2). Every rank then holds
            the same block of each group, and the output still chunks into the groups.
        transposed: the weight is stored ``[in, out]`` (Hugging Face's ``Conv1D``). The built layer
            records it (``dense_transposed``), so dense state dicts, loads and exports keep that layout.
    """

    input_layout: str = "z"
    groups: int = 1
    transposed: bool = False

    def __post_init__(self):
        as_layout(self.input_layout)
        if self.groups < 1:
            raise ValueError(f"Linear rule: groups must be >= 1, got {self.groups}")

    def build(self, name, module, grid, options):
        in_features, out_features = _linear_sizes(name, module, self.transposed)
        bias = getattr(module, "bias", None) is not None
        common = dict(
            bias=bias,
            input_layout=self.input_layout,
            grid=grid,
            device=META,
            dtype=_dtype(module),
            options=options,
            transposed=self.transposed,
        )
        if self.groups == 1:
            return Linear3D(in_features, out_features, **common)
        if out_features % self.groups:
            _refuse(
                name,
                module,
                f"{out_features} output features do not split into groups={self.groups}",
                "use the number of projections packed in the weight",
            )
        return FusedLinear3D(in_features, out_features // self.groups, self.groups, **common)


@dataclass(frozen=True)
class Norm(Rule):
    """A LayerNorm or RMSNorm over the last dim of a ``layout`` activation (norm classes by
    :func:`~lightning_3d.parallel.norms.register_norm`; ``nn.LayerNorm`` and ``nn.RMSNorm`` built in)."""

    layout: str = "z"

    def __post_init__(self):
        as_layout(self.layout)

    def build(self, name, module, grid, options):
        kind = norm_kind(module)
        if kind is None:
            _refuse(
                name,
                module,
                "this norm class is not registered",
                f"call lightning_3d.parallel.register_norm({type(module).__name__!r}, 'layernorm' or "
                "'rmsnorm', eps_attr=...)",
            )
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        shape = tuple(getattr(module, "normalized_shape", ())) or (
            tuple(weight.shape) if weight is not None else ()
        )
        if len(shape) != 1:
            _refuse(
                name,
                module,
                f"normalized_shape {shape} is not one feature dim",
                "3-D norms normalise the last dim only",
            )
        eps = getattr(module, kind.eps_attr)
        common = dict(
            elementwise_affine=weight is not None,
            layout=self.layout,
            grid=grid,
            device=META,
            dtype=_dtype(module),
        )
        if kind.center:
            return LayerNorm3D(shape[0], eps=eps, bias=bias is not None, **common)
        if bias is not None:
            _refuse(
                name,
                module,
                "an RMSNorm with a bias",
                "register its class as 'layernorm' if it centres, else drop the bias",
            )
        return RMSNorm3D(shape[0], eps=eps, **common)


def _check_embedding(name: str, module: nn.Module, padding: bool = False) -> None:
    """Refuse what the rule cannot represent exactly (``padding``: a ``padding_idx`` is supported)."""
    if not isinstance(module, nn.Embedding):
        _refuse(name, module, "an embedding rule needs an nn.Embedding", "map it with another rule")
    if (
        (module.padding_idx is not None and not padding)
        or module.max_norm is not None
        or module.scale_grad_by_freq
        or module.sparse
    ):
        _refuse(
            name,
            module,
            f"{'' if padding else 'padding_idx, '}max_norm, scale_grad_by_freq and sparse are not supported",
            "build the embedding without them",
        )


@dataclass(frozen=True)
class VocabEmbedding(Rule):
    """``nn.Embedding(V, h)`` of token ids: full ids ``[b, ...]`` (the same on every cube rank) in,
    z-layout ``[b/(px·py), ..., h/pz]`` out. The vocabulary is padded to a multiple of
    ``lcm(pad_to_multiple, px·py)`` rows (zeros, never looked up). A ``padding_idx`` is kept: its
    lookups pass no gradient to its row, as in ``nn.Embedding``."""

    pad_to_multiple: int = 1

    def build(self, name, module, grid, options):
        _check_embedding(name, module, padding=True)
        v, h = module.weight.shape
        return PaddedEmbedding3D(
            v,
            padded_vocab_size(v, grid, self.pad_to_multiple),
            h,
            grid=grid,
            device=META,
            dtype=_dtype(module),
            padding_idx=module.padding_idx,
        )


@dataclass(frozen=True)
class PositionEmbedding(Rule):
    """``nn.Embedding(positions, h)`` read by position ids ``[..., s]`` (e.g. ``arange(s)``): output
    ``[..., s, h/pz]``, the features of a z-layout activation (weight replicated over x and y)."""

    def build(self, name, module, grid, options):
        _check_embedding(name, module)
        n, h = module.weight.shape
        return PositionEmbedding3D(n, h, grid=grid, device=META, dtype=_dtype(module))


@dataclass(frozen=True)
class LMHead(Rule):
    """The LM head ``nn.Linear(h, V)``: z-layout in, y-layout logits ``[b/(px·pz), ..., V'/py]`` over
    the vocabulary padded as the :class:`VocabEmbedding` pads it (padded logits at the dtype's
    lowest value). A head whose weight is the embedding's (tied) shares the 3-D embedding weight."""

    pad_to_multiple: int = 1

    def build(self, name, module, grid, options):
        h, v = _linear_sizes(name, module, False)
        return LMHead3D(
            h,
            v,
            padded_vocab_size(v, grid, self.pad_to_multiple),
            bias=getattr(module, "bias", None) is not None,
            grid=grid,
            device=META,
            dtype=_dtype(module),
            options=options,
        )


@dataclass(frozen=True)
class Loss(Rule):
    """``nn.CrossEntropyLoss`` (mean, ``ignore_index`` kept) → vocabulary-parallel cross-entropy of
    y-layout logits ``[b/(px·pz), ..., V'/py]`` against full targets ``[b, ...]``; the model may
    flatten both first (``logits.flatten(0, -2)``, ``targets.flatten()``). Every cube rank gets the same scalar.
    ``vocab_size``: the true vocabulary when the logits are padded; targets outside it raise.
    ``check_targets=False`` where the model's ``before_forward`` checks the targets itself, at the
    start of the forward, where the check costs the GPU no wait (GPT3D's plan does)."""

    vocab_size: int | None = None
    check_targets: bool = True

    def build(self, name, module, grid, options):
        if not isinstance(module, nn.CrossEntropyLoss):
            _refuse(name, module, "the Loss rule replaces nn.CrossEntropyLoss", "map it with another rule")
        if module.weight is not None or module.label_smoothing or module.reduction != "mean":
            _refuse(
                name,
                module,
                "class weights, label smoothing and reductions other than 'mean' are not supported",
                "use nn.CrossEntropyLoss(ignore_index=...) with the defaults",
            )
        return CrossEntropyLoss3D(
            ignore_index=module.ignore_index,
            grid=grid,
            vocab_size=self.vocab_size,
            options=options,
            check_targets=self.check_targets,
        )


@dataclass(frozen=True)
class Dropout(Rule):
    """``nn.Dropout`` → :class:`~lightning_3d.layers.Dropout3D`: an independent mask on every rank's block."""

    def build(self, name, module, grid, options):
        if not isinstance(module, nn.Dropout):
            _refuse(name, module, "the Dropout rule replaces nn.Dropout", "map it with another rule")
        return Dropout3D(module.p)
