"""``parallelize(model, plan)``: replace a model's modules by 3-D ones in place, as the plan says.

Every rank runs it with the same model. A module the plan maps is replaced (``setattr`` on its
parent) by the module its rule builds, whose parameters hold this rank's shards of the dense
ones; nothing else of the model changes (its class, forward, other modules, state-dict keys).

- A materialised model keeps its weights: each module is sharded in turn and its dense tensors
  are dropped with it, so the peak is the dense model plus one rank's shards.
- A model on the ``meta`` device is initialised module by module: each module's full-size tensors
  are drawn (``plan.init``, or its ``reset_parameters()``) in the order the dense model draws
  them, so the same seed gives the same values on every grid, then sharded and freed: at most
  one module's full tensors exist at a time.
- Weights shared by several modules (a tied LM head) stay shared: the 3-D parameter of the first
  module is reused by the others, which must lay it out the same way.
"""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch import nn

from ..dense_twin import dense_to_global
from ..grid import Grid, resolve_grid
from ..layers.base import Module3D
from ..options import RuntimeOptions
from ..runtime import Runtime
from ..sharding import get_spec, shard_tensor
from .attention import check_attention, lay_out_token_rows
from .hooks import attach_model_hooks
from .norms import norm_kind
from .plan import Plan, find_plan, matches
from .rules import Rule
from .state import check_options
from .units import run_as_unit


def parallelize(
    model: nn.Module,
    plan: Plan | None = None,
    *,
    grid: Grid | None = None,
    options: RuntimeOptions | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Put ``model`` on the grid in place and return it.

    Args:
        model: a materialised model, or one built on the ``meta`` device.
        plan: the rules; None takes the built-in plan of the model's class
            (:func:`~lightning_3d.parallel.plan.find_plan`).
        grid: defaults to the current grid.
        options: the run-time choices; defaults to ``plan.options``. They are fixed into the
            model's :class:`~lightning_3d.runtime.Runtime`, which every 3-D layer of the model
            holds (``set_options(model, ...)`` changes them).
        device: where the shards of a ``meta`` model are made; defaults to torch's default device.
            A materialised model's shards stay on its tensors' device.

    Raises:
        ValueError: no built-in plan; a module holding parameters that no rule maps; a pattern
            matching nothing (strict plans); a module a rule cannot represent; an attention entry
            its module cannot take; sizes that do not split on the grid. All raised before the
            model is changed.
    """
    grid = resolve_grid(grid)
    plan = plan if plan is not None else find_plan(model)
    options = options if options is not None else plan.options
    check_options(options, grid)
    if any(isinstance(m, Module3D) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} already holds 3-D layers: parallelize a model once")
    if plan.validate is not None:
        plan.validate(model, grid)
    order, rules = _match(model, plan)
    units = _checkpoint_units(model, plan)
    attention = plan.attention_of(model)
    if plan.strict:
        _check_used(model, plan.attention, attention, "attention")
    check_attention(model, attention)
    modules = dict(order)
    runtime = Runtime(options, gathers_weights=grid.size("x") > 1)
    built = {name: _build(name, modules[name], rule, grid, options, runtime) for name, rule in rules.items()}
    del modules
    device = torch.device(device) if device is not None else torch.get_default_device()
    _Converter(model, plan, grid, device).run(order, rules, built)
    if plan.prepare is not None:
        plan.prepare(model, grid)
    if not plan.rows_in_model:
        lay_out_token_rows(model, plan.attention_of(model), grid, runtime)  # the modules prepare left
    for unit in units:
        run_as_unit(unit, runtime)
    attach_model_hooks(model, plan, grid, runtime)
    return model


def _generalise(name: str) -> str:
    """``layers.3.mlp.fc1`` → ``layers.*.mlp.fc1``: a pattern for every layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _suggest(name: str, module: nn.Module) -> str:
    if isinstance(module, nn.Embedding):
        rule = "VocabEmbedding() for token ids, PositionEmbedding() for positions"
    elif norm_kind(module) is not None:
        rule = 'Norm("z")'
    elif isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 2:
        rule = 'Linear("z") or Linear("y") (the layout of its input)'
    else:
        rule = "a Rule subclass that builds its 3-D counterpart"
    return f"{_generalise(name)!r}: {rule}"


def _match(model: nn.Module, plan: Plan) -> tuple[list[tuple[str, nn.Module]], dict[str, Rule]]:
    """The modules in pre-order (skipping those inside a replaced one) and the rule of each replaced one.

    Raises, before anything changes, for modules with parameters no rule maps and for unused patterns.
    """
    order, rules, unmapped = [], {}, []
    for name, module in model.named_modules():
        if any(".".join(name.split(".")[:k]) in rules for k in range(1, name.count(".") + 1)):
            continue
        order.append((name, module))
        rule = plan.rule_for(name)
        if rule is not None:
            rules[name] = rule
        elif any(p is not None for p in module._parameters.values()):
            unmapped.append(
                f"  {name or '(the model)'} ({type(module).__name__}): add {_suggest(name, module)}"
            )
    if unmapped:
        raise ValueError(
            f"no rule of the plan maps these modules of {type(model).__name__}, which hold parameters:\n"
            + "\n".join(unmapped)
        )
    names = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    shared = [name for name in rules if names[id(model.get_submodule(name))] > 1]
    if shared:
        raise ValueError(
            f"{shared} are registered under several names in {type(model).__name__}: a module replaced at one "
            "name would stay dense at the others; give each place a module of its own"
        )
    if plan.strict:
        _check_used(model, plan.rules, rules, "rule")
    return order, rules


def _check_used(model: nn.Module, patterns, names, what: str) -> None:
    unused = [p for p in patterns if not any(matches(p, n) for n in names)]
    if unused:
        sample = [n for n, _ in model.named_modules() if n][:8]
        raise ValueError(
            f"{what} patterns {unused} match no module of {type(model).__name__} (names look like {sample}); "
            "fix them or pass Plan(strict=False)"
        )


def _build(
    name: str, module: nn.Module, rule: Rule, grid: Grid, options: RuntimeOptions, runtime: Runtime
) -> nn.Module:
    """The rule's 3-D module on ``meta``, every 3-D layer in it running with the model's ``runtime``;
    errors name the module."""
    try:
        new = rule.build(name, module, grid, options)
    except ValueError as e:
        raise ValueError(e.args[0] if str(e).startswith(name) else f"{name}: {e}") from e
    for layer in new.modules():
        if isinstance(layer, Module3D):
            layer.runtime = runtime
    return new


def _checkpoint_units(model: nn.Module, plan: Plan) -> list[nn.Module]:
    names = dict(model.named_modules())
    units = [m for n, m in names.items() if any(matches(p, n) for p in plan.checkpoint)]
    if plan.strict:
        _check_used(model, plan.checkpoint, names, "checkpoint")
    return units


class _Converter:
    """One pass over the model in pre-order: initialise meta tensors, build, shard and swap in each mapped module."""

    def __init__(self, model: nn.Module, plan: Plan, grid: Grid, device: torch.device):
        self.model, self.plan, self.grid, self.device = model, plan, grid, device
        # parameters held by several modules (ties): the dense one kept alive until its last holder is converted
        counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        self.holders = {k: n for k, n in counts.items() if n > 1}
        self.converted: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}

    def run(
        self, order: list[tuple[str, nn.Module]], rules: dict[str, Rule], built: dict[str, nn.Module]
    ) -> None:
        """Convert the modules of ``order`` (emptied as it goes, so that each replaced module's
        dense tensors are freed as soon as the module is swapped out)."""
        order.reverse()
        while order:
            name, module = order.pop()
            originals = {n: p for n, p in module._parameters.items() if p is not None}
            self._materialise(name, module, originals)
            if name in rules:
                self._replace(name, module, rules[name], built.pop(name), originals)
            del module, originals

    def _tied(self, p: torch.Tensor) -> nn.Parameter | None:
        entry = self.converted.get(id(p))
        return entry[1] if entry is not None and entry[0] is p else None

    @torch.no_grad()
    def _materialise(self, name: str, module: nn.Module, originals: dict[str, nn.Parameter]) -> None:
        """Give ``module``'s own meta tensors their dense initial values (tied ones are skipped)."""
        params = [n for n, p in originals.items() if p.is_meta and self._tied(p) is None]
        buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not params and not buffers:
            return
        prefix = f"{name}." if name else ""
        if self.plan.init is None:
            if not hasattr(module, "reset_parameters"):
                raise ValueError(
                    f"{name} ({type(module).__name__}) is on the meta device and has no reset_parameters(): "
                    "give the plan an init(name, tensor) that fills its tensors"
                )
            module.to_empty(device=self.device, recurse=False)
            module.reset_parameters()
            return
        for n in params:
            t = torch.empty_like(originals[n], device=self.device)
            self.plan.init(prefix + n, t)
            setattr(module, n, nn.Parameter(t, requires_grad=originals[n].requires_grad))
        for n in buffers:
            t = torch.empty_like(module._buffers[n], device=self.device)
            self.plan.init(prefix + n, t)
            module._buffers[n] = t

    @torch.no_grad()
    def _replace(
        self, name: str, module: nn.Module, rule: Rule, new: nn.Module, originals: dict[str, nn.Parameter]
    ) -> None:
        dense, transposed, orders = (
            rule.dense_tensors(module),
            getattr(new, "dense_transposed", ()),
            getattr(new, "dense_row_order", {}),
        )
        real = [t for t in dense.values() if t is not None and not t.is_meta]
        new.to_empty(device=real[0].device if real else self.device)
        for pname, p in list(new.named_parameters(recurse=False)):
            source = originals.get(pname)
            shared = self._tied(source) if source is not None else None
            if shared is not None:
                if get_spec(shared) != get_spec(p):
                    raise ValueError(
                        f"{name}.{pname} is tied to a weight laid out as {get_spec(shared)}, but its rule lays it "
                        f"out as {get_spec(p)}: give both modules rules with the same layout and padding"
                    )
                setattr(new, pname, shared)
            else:
                spec = get_spec(p)
                full = dense[pname].to(p.device)
                p.copy_(
                    full
                    if spec is None
                    else shard_tensor(
                        dense_to_global(full, spec.global_shape, pname in transposed, orders.get(pname)),
                        spec,
                        self.grid,
                    )
                )
            if source is not None and id(source) in self.holders:
                self._hold(source, shared if shared is not None else p)
        parent_name, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent_name), child, new)

    def _hold(self, source: nn.Parameter, converted: nn.Parameter) -> None:
        """Remember a shared parameter's 3-D form until every holder has been converted."""
        key = id(source)
        self.holders[key] -= 1
        if self.holders[key]:
            self.converted[key] = (source, converted)
        else:
            self.converted.pop(key, None)
