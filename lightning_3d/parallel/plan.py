"""A plan: which module of a model becomes which 3-D module, and how the model runs on the grid.

``rules`` maps module-name patterns to :mod:`~lightning_3d.parallel.rules`. A pattern is matched
against the names of ``model.named_modules()`` one dot-separated atom at a time, each atom by
``fnmatch`` (``"layers.*.mlp.fc?"`` matches ``layers.0.mlp.fc1``, not ``layers.0.mlp.fc1.x``); the
first pattern that matches a module wins, and the modules inside a replaced one are not visited.

Built-in plans are registered by class name (:func:`register_plan`), so that a library's class
gets a plan without the library being imported here; ``parallelize(model)`` looks one up along
the model's class hierarchy.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..grid import Grid
from ..options import RuntimeOptions
from .attention import Attention
from .rules import Rule

BeforeForward = Callable[[nn.Module, Grid, tuple, dict], "tuple[tuple, dict] | None"]
AfterForward = Callable[[nn.Module, Grid, tuple, dict, Any], Any]


@dataclass
class Plan:
    """How :func:`~lightning_3d.parallel.parallelize` puts a model on the grid.

    Args:
        rules: ``{pattern: rule}``; every module that holds parameters must be matched.
        options: the run-time choices the model runs with (``parallelize`` fixes them into its runtime).
        checkpoint: patterns of the modules recomputed in backward while
            ``options.activation_checkpointing`` is on (the Transformer blocks).
        before_forward: ``(model, grid, args, kwargs) -> (args, kwargs) or None``, run before the
            model's forward: check the inputs, lay them out for this rank (masks, position ids).
        after_forward: ``(model, grid, args, kwargs, output) -> output or None``, run after it
            (e.g. compute the loss from the y-layout logits).
        init: for a model built on the ``meta`` device, fills each dense tensor: called as
            ``init(name, tensor)`` with the full tensor of every parameter (and ``meta`` buffer) in
            state-dict order, as the dense model's own initialisation would draw it. Without it,
            each module's ``reset_parameters()`` runs on its full-size tensors, in module order.
        validate: ``(model, grid) -> None``, raising ``ValueError`` naming the numbers and the fix
            when the model does not split on the grid (e.g. heads over py); run before any change.
        prepare: ``(model, grid) -> None``, run once after the modules are replaced: set what the
            model's own code reads per rank and no rule owns (per-rank sizes of unreplaced
            modules, hooks, the model's loss function).
        attention: ``{pattern: Attention(...)}``, the modules that compute the model's causal
            self-attention and how their core attention is called
            (:class:`~lightning_3d.parallel.attention.Attention`): with them the model takes any
            batch, one that whole-sequence rows do not split running on token rows; without, a
            batch must be a multiple of ``lcm(px·py, px·pz)`` and ``RuntimeOptions(rows="tokens")``
            is refused, unless ``rows_in_model``.
        rows_in_model: the model's own code lays out token rows before its token embedding (the
            built-in plans of ``DenseGPT`` and the Hugging Face models): it takes any batch without
            ``attention`` entries.
        strict: every pattern of ``rules``, ``checkpoint`` and ``attention`` must match some module.
    """

    rules: dict[str, Rule]
    options: RuntimeOptions = field(default_factory=RuntimeOptions)
    checkpoint: tuple[str, ...] = ()
    before_forward: BeforeForward | None = None
    after_forward: AfterForward | None = None
    init: Callable[[str, torch.Tensor], None] | None = None
    validate: Callable[[nn.Module, Grid], None] | None = None
    prepare: Callable[[nn.Module, Grid], None] | None = None
    attention: dict[str, Attention] = field(default_factory=dict)
    rows_in_model: bool = False
    strict: bool = True

    def rule_for(self, name: str) -> Rule | None:
        """The rule of the first pattern matching module ``name``, or None."""
        return next((rule for pattern, rule in self.rules.items() if matches(pattern, name)), None)

    def attention_of(self, model: nn.Module) -> dict[str, Attention]:
        """``{name: entry}``: each module of ``model`` an ``attention`` pattern matches, with the first
        matching pattern's entry."""
        found = {}
        for name, _ in model.named_modules():
            entry = next((e for pattern, e in self.attention.items() if matches(pattern, name)), None)
            if entry is not None:
                found[name] = entry
        return found


def matches(pattern: str, name: str) -> bool:
    """``pattern`` matches module ``name`` atom by atom (``fnmatch`` per dot-separated part)."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))


_plans: dict[str, Callable[[nn.Module], Plan]] = {}


def register_plan(class_name: str, make_plan: Callable[[nn.Module], Plan]) -> None:
    """Make ``make_plan(model)`` the built-in plan of models whose class (or a base class) is named
    ``class_name``: a plain name (``"LlamaForCausalLM"``) or one qualified by its module
    (``"litgpt.model.GPT"``, for a name as common as ``GPT``)."""
    _plans[class_name] = make_plan


def find_plan(model: nn.Module) -> Plan:
    """The built-in plan of ``model``'s class; ``ValueError`` naming the class and the fix when there is none."""
    for cls in type(model).__mro__:
        for name in (f"{cls.__module__}.{cls.__qualname__}", cls.__name__):
            if name in _plans:
                return _plans[name](model)
    raise ValueError(
        f"no built-in plan for {type(model).__name__} (built in: {', '.join(sorted(_plans)) or 'none'}); "
        f"pass parallelize(model, plan=Plan(rules={{...}})) or register one with "
        f"lightning_3d.parallel.register_plan({type(model).__name__!r}, make_plan)"
    )
