"""A model's pipeline stages on this rank: :func:`split_stages`.

Each stage is the whole model with the other stages' modules removed, as torchtitan's
``pipeline_llm`` makes them: the same class and module tree, so every parameter keeps its fully
qualified name and a checkpoint does not depend on the split. The list of layers becomes a
:class:`StageLayers` holding the stage's layers under their indices in the whole model
(``transformer.h.5`` stays ``transformer.h.5``); the embeddings stay on the first stage only, the
final norm, head and loss on the last only (the others hold None there). Each stage is then
parallelized with the model's plan on the grid, whose cube groups are the stage's own. Calling a
stage's module runs its part of the forward (:meth:`Stage.forward`) inside the hooks ``parallelize``
adds; the plan's input and output hooks are left out, the stage's forward not being the model's.

Under autocast (``bf16-mixed``, ``16-mixed``) a schedule enters it inside each stage's forward, per
micro-batch (:class:`Autocast`), and runs the backward passes outside it; a stage hands on its
hidden block in its parameters' dtype, the residual stream's dtype of the whole model.

A model built on ``meta`` materialises only each stage's own modules. With a plan that initialises by
name (``Plan.init``), a stage first draws and drops the values of the whole model's tensors before
its own, so that the same seed gives each layer the value the whole model would give it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..agreement import agree_on_first_call
from ..grid import Grid, resolve_grid
from ..layers.base import Module3D
from ..layout import Layout
from ..models.dense import init_order
from ..options import RuntimeOptions
from ..parallel import Plan, find_plan, parallelize
from ..parallel.plan import matches
from .kinds import stage_indices
from .split import MicroBatch, StageSplit, find_split, layer_ranges
from .tied import TiedParameter, tie_across_stages


class StageLayers(nn.Module):
    """The layers a stage holds of a model's ``nn.ModuleList``, each under its index in the whole
    model, in order; iterated and counted as the list is."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


@dataclass(frozen=True)
class Autocast:
    """The autocast a schedule's caller runs under (``torch.autocast(device_type, dtype)``), entered
    inside each stage's forward and the loss instead, one micro-batch at a time, so that the backward
    passes the schedule runs between them run outside it, as a training step's backward does. Casts are
    not cached: every micro-batch's backward runs through casts of its own."""

    device_type: str
    dtype: torch.dtype

    @classmethod
    def of_caller(cls, device_type: str) -> Autocast | None:
        """The autocast on ``device_type`` around the caller, or None when it is off."""
        if not torch.is_autocast_enabled(device_type):
            return None
        return cls(device_type, torch.get_autocast_dtype(device_type))

    def __call__(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, self.dtype, cache_enabled=False)


@dataclass(eq=False)
class Stage:
    """Stage ``index`` of ``num_stages``: ``module``, the model holding layers ``layers`` (and the
    embeddings on the first stage, the head on the last), parallelized on ``grid``. Calling
    ``module`` runs :meth:`forward`, for micro-batches of the shape :meth:`bind` fixed, under
    ``autocast`` when a schedule sets it."""

    module: nn.Module
    index: int
    num_stages: int
    layers: range
    split: StageSplit
    grid: Grid
    micro_batch: MicroBatch | None = None
    autocast: Autocast | None = None
    #: the parameters this rank's stages share with another stage (:mod:`.tied`), the same list on each
    tied: list[TiedParameter] = dataclasses.field(default_factory=list)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def bind(self, batch: int, seq_len: int) -> None:
        """Run micro-batches of ``batch`` sequences of ``seq_len`` tokens from now on (checked against the grid)."""
        self.micro_batch = self.split.micro_batch(self.module, self.grid, batch, seq_len)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ids ``[batch, seq_len]`` (first stage) or this rank's z-layout hidden block → the hidden
        block for the next stage (in :attr:`dtype`), or the y-layout logits (last stage)."""
        mb = self._bound()
        with self.autocast() if self.autocast is not None else contextlib.nullcontext():
            if self.is_first:
                agree_on_first_call(self.module, self.grid.group("cube"), "pipeline stage input", ids=x)
                x = self.split.embed(self.module, x, mb)
            x = self.split.blocks(self.module, x, mb)
            if self.is_last:
                return self.split.head(self.module, x, mb)
        return x.to(self.dtype)

    def example_input(self) -> torch.Tensor:
        """A ``meta`` tensor shaped as what the stage receives (ids on the first stage)."""
        mb = self._bound()
        if self.is_first:
            return torch.empty(mb.batch, mb.seq_len, dtype=torch.long, device="meta")
        return self._block("z", self.split.hidden_size(self.module))

    def example_output(self) -> torch.Tensor:
        """A ``meta`` tensor shaped as what the stage hands on (the logits on the last stage)."""
        if self.is_last:
            return self._block("y", self.split.logits_width(self.module))
        return self._block("z", self.split.hidden_size(self.module))

    @property
    def device(self) -> torch.device:
        return next(itertools.chain(self.module.parameters(), self.module.buffers())).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stage's parameters, in which it receives and hands on hidden blocks."""
        return next(p.dtype for p in self.module.parameters() if p.is_floating_point())

    def _block(self, layout: str, width: int) -> torch.Tensor:
        mb = self._bound()
        shape = Layout(layout).spec((mb.rows, mb.row_len, width)).local_shape(self.grid)
        return torch.empty(shape, dtype=self.dtype, device="meta", requires_grad=True)

    def _bound(self) -> MicroBatch:
        if self.micro_batch is None:
            raise RuntimeError(
                f"pipeline stage {self.index} has no micro-batch shape: build_schedule binds its stages "
                "(or call stage.bind(batch, seq_len))"
            )
        return self.micro_batch


def split_stages(
    model: nn.Module,
    grid: Grid | None = None,
    *,
    schedule: str = "1F1B",
    stages_per_rank: int | None = None,
    split_points: Sequence[int] | None = None,
    split: StageSplit | None = None,
    plan: Plan | None = None,
    options: RuntimeOptions | None = None,
    device: torch.device | str | None = None,
) -> list[Stage]:
    """The stages of ``model`` this rank runs under ``schedule``, each parallelized on ``grid``.

    Collective over the grid's cube; every rank passes the same model and arguments. ``model`` is
    consumed: its modules move into the stages (copies share its tensors, nothing is allocated).

    Args:
        model: a plain ``torch.nn`` model, materialised or on ``meta`` (not yet parallelized).
        grid: a grid with a pipeline axis (``init_grid(..., pipeline_size=pp)``); the current one by default.
        schedule: a name of :data:`~lightning_3d.pipeline.kinds.SCHEDULES`; it decides which stages
            a rank runs (:func:`~lightning_3d.pipeline.kinds.stage_indices`).
        stages_per_rank: for looped schedules (``Interleaved1F1B`` ...): stages per rank, default 2.
        split_points: the first layer of stages ``1 … S-1`` (``S = pp · stages per rank``); default
            equal layer counts (:func:`~lightning_3d.pipeline.split.layer_ranges`).
        split: how the model's forward splits; default the built-in split of its class.
        plan, options, device: as :func:`~lightning_3d.parallel.parallelize` takes them.

    Raises:
        ValueError: no built-in split or plan; a parameter that no stage holds, or that two stages
            hold other than the first and the last (a tied embedding and head, see :mod:`.tied`);
            more stages than layers; bad split points;
            a plan pattern that matches no module of the model; a plan that names attention modules;
            what ``parallelize`` refuses.
    """
    grid = resolve_grid(grid)
    if any(isinstance(m, Module3D) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} already holds 3-D layers: split the plain model (built on meta, e.g. "
            "DenseGPT(config, device='meta')) into stages; each stage is parallelized as it is made"
        )
    split = split if split is not None else find_split(model)
    plan = plan if plan is not None else find_plan(model)
    if plan.attention:
        raise ValueError(
            f"the plan of {type(model).__name__} names attention modules {list(plan.attention)}, which run token rows "
            "through the whole model's forward: such a plan is not split into pipeline stages; run it with "
            "pipeline_size=1, or split a model whose split is built in (DenseGPT, the Hugging Face causal LMs)"
        )
    indices = stage_indices(grid, schedule, stages_per_rank)
    num_stages = grid.pipeline_size * len(indices)
    ranges = layer_ranges(len(model.get_submodule(split.layers)), num_stages, split_points)
    _check_patterns(model, plan)
    ties = _ties(model, split, ranges)
    device = torch.device(device) if device is not None else torch.get_default_device()
    drawn = init_order(model) if plan.init is not None and _on_meta(model) else []
    modules = [_share_tensors_copy(model) for _ in indices[1:]] + [model]
    stages = []
    for k, (index, module) in enumerate(zip(indices, modules)):
        _keep_only(module, split, index, num_stages, ranges[index])
        with _restored_generator(device) if k < len(indices) - 1 else contextlib.nullcontext():
            _draw_before(module, drawn, plan, device)
            parallelize(module, _stage_plan(plan, module), grid=grid, options=options, device=device)
        stage = Stage(module, index, num_stages, ranges[index], split, grid)
        module.forward = stage.forward
        stages.append(stage)
    tied = tie_across_stages({s.index: s.module for s in stages}, ties, num_stages - 1, grid)
    for stage in stages:
        stage.tied = tied
    return stages


def _owner(name: str, split: StageSplit, ranges: list[range]) -> int | None:
    """The stage that holds the parameter or module ``name`` of the whole model (None: no rule says)."""
    prefix = split.layers + "."
    if name.startswith(prefix):
        layer = int(name[len(prefix) :].split(".")[0])
        return next(s for s, r in enumerate(ranges) if layer in r)
    for modules, stage in ((split.first, 0), (split.last, len(ranges) - 1)):
        if any(name == m or name.startswith(m + ".") for m in modules):
            return stage
    return None


def _ties(model: nn.Module, split: StageSplit, ranges: list[range]) -> list[dict[int, str]]:
    """The parameters that the first and the last stage both hold (a tied embedding and head): for each,
    ``{stage: the name that stage holds it under}``. Every other parameter belongs to exactly one stage."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    last, ties = len(ranges) - 1, []
    for held in names.values():
        owners = {n: _owner(n, split, ranges) for n in held}
        if None in owners.values():
            name = next(n for n, s in owners.items() if s is None)
            raise ValueError(
                f"{type(model).__name__}.{name} lies outside {split.layers!r} and outside the modules the split "
                f"gives the first stage {split.first} or the last {split.last}: every stage would hold a copy; "
                "name its module in the split's first or last modules"
            )
        stages = set(owners.values())
        if len(stages) == 1:
            continue
        if stages != {0, last}:
            where = ", ".join(f"{n} (stage {s})" for n, s in owners.items())
            raise ValueError(
                f"{type(model).__name__}: one parameter is held under {where}; only the first and the last "
                "pipeline stage may share a parameter (a tied embedding and head): untie it or move the split points"
            )
        ties.append({s: next(n for n, o in owners.items() if o == s) for s in (0, last)})
    return ties


def _check_patterns(model: nn.Module, plan: Plan) -> None:
    """A strict plan's patterns each match a module of the whole model (a stage's plan keeps those of its own)."""
    if not plan.strict:
        return
    names = [n for n, _ in model.named_modules()]
    unused = [p for p in (*plan.rules, *plan.checkpoint) if not any(matches(p, n) for n in names)]
    if unused:
        raise ValueError(
            f"plan patterns {unused} match no module of {type(model).__name__} (names look like {names[1:9]}); "
            "fix them or pass Plan(strict=False)"
        )


def _stage_plan(plan: Plan, module: nn.Module) -> Plan:
    """``plan`` for one stage: the patterns that match its modules, no model input/output hooks."""
    names = [n for n, _ in module.named_modules()]
    ours = [p for p in (*plan.rules, *plan.checkpoint) if any(matches(p, n) for n in names)]
    return dataclasses.replace(
        plan,
        rules={p: rule for p, rule in plan.rules.items() if p in ours},
        checkpoint=tuple(p for p in plan.checkpoint if p in ours),
        before_forward=None,
        after_forward=None,
    )


def _share_tensors_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules holding the very same parameters and buffers."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def _keep_only(module: nn.Module, split: StageSplit, index: int, num_stages: int, layers: range) -> None:
    """Remove from ``module`` what stage ``index`` does not hold (see the module's docstring)."""
    parent, _, name = split.layers.rpartition(".")
    whole = module.get_submodule(split.layers)
    module.get_submodule(parent).register_module(name, StageLayers({i: whole[i] for i in layers}))
    dropped = (split.first if index > 0 else ()) + (split.last if index < num_stages - 1 else ())
    for name in dropped:
        parent, _, child = name.rpartition(".")
        holder = module.get_submodule(parent)
        if getattr(holder, child, None) is not None:
            holder.register_module(child, None)


def _on_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


@torch.no_grad()
def _draw_before(module: nn.Module, drawn: list[tuple[str, torch.Tensor]], plan: Plan, device) -> None:
    """Draw and drop the initial values of the whole model's tensors ``drawn`` (in draw order) that
    come before the stage's first, one at a time."""
    ours = set(module.state_dict())
    for key, t in drawn:
        if key in ours:
            return
        plan.init(key, torch.empty_like(t, device=device))


def _restored_generator(device: torch.device):
    """The default generators (CPU, and ``device``'s) restored on exit: every stage of a rank draws from one state."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)
