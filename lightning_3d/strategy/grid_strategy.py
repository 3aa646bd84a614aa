"""What the Trainer and the Fabric strategies share: their grid arguments, the grid, DDP over dp, ZeRO-1.

``Tensor3DMixin`` (the Trainer's, :mod:`.base`) and ``Tensor3DFabricMixin`` (Fabric's,
:mod:`.fabric_base`) both mix in :class:`GridStrategy` and call :meth:`GridStrategy.take_grid_arguments`
from their constructors; everything here reads only what both Lightning ``DDPStrategy`` classes
have (``world_size``, ``num_processes``, ``root_device``, ``_timeout``). No Lightning import.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import arguments, cost
from ..cost import ModelShape
from ..grid import Grid, init_grid, set_grid
from ..options import RuntimeOptions
from ..parallel import set_options
from ..pipeline import PipelinedModel, PipelineOptions
from . import grid_rules
from .failures import ConfigurationError, same_on_every_rank
from .replicas import GridData
from .stages import split_model
from .zero import ShardedOptimizerState

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

_grids: dict[tuple, Grid] = {}


def _grid(
    shape: tuple[int, int, int], dp: int, pp: int, device_type: str, timeout: datetime.timedelta
) -> Grid:
    """One grid per shape, dp, pipeline size and world group: a second fit/validate (or Fabric) in the same
    processes reuses its groups."""
    key = (shape, dp, pp, device_type, timeout, id(dist.group.WORLD))
    if key not in _grids:
        _grids[key] = init_grid(shape, dp, pipeline_size=pp, device_type=device_type, timeout=timeout)
    return _grids[key]


_DDP_SET_BY_STRATEGY = {"self", "module", "device_ids", "output_device", "process_group", "device_mesh"}


def checked_ddp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` if ``DistributedDataParallel`` takes every name and the strategy sets none of them; else
    ``ValueError``."""
    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - _DDP_SET_BY_STRATEGY
    runtime = sorted(set(kwargs) & {f.name for f in dataclasses.fields(RuntimeOptions)})
    if runtime:
        raise ValueError(
            f"Tensor3DStrategy: {runtime} are the model's run-time options, not strategy arguments: pass "
            f"options=lightning_3d.RuntimeOptions({', '.join(f'{name}=...' for name in runtime)})"
        )
    wrong = sorted(set(kwargs) - accepted)
    if wrong:
        raise ValueError(
            f"Tensor3DStrategy: {wrong} are not DistributedDataParallel arguments the strategy passes on; "
            f"accepted: {sorted(accepted)} (device_ids and process_group are the strategy's)"
        )
    return dict(kwargs)


def _changed(options: RuntimeOptions | None) -> str:
    """``options`` as the fields that differ from the defaults, e.g. ``RuntimeOptions(async_tp=True)``."""
    if options is None:
        return "the model's"
    changed = [
        f"{f.name}={getattr(options, f.name)!r}"
        for f in dataclasses.fields(options)
        if getattr(options, f.name) != f.default
    ]
    return f"RuntimeOptions({', '.join(changed)})"


class GridStrategy(GridData):
    """Strategy mixin: the grid arguments, the grid itself, DDP over its dp group and ZeRO-1 optimizers."""

    #: the schedule and split of the pipeline stages (None with one stage), set by each strategy
    pipeline: PipelineOptions | None = None
    info: ClassVar[Callable[[str], None]]  # rank-zero print of the namespace
    worker_init_function: ClassVar[
        Callable[..., None]
    ]  # Lightning's pl_worker_init_function of the namespace

    def take_grid_arguments(
        self,
        grid: Literal["auto"] | tuple[int, int, int],
        data_parallel_size: Literal["auto"] | int,
        pipeline_size: int,
        zero_stage: int,
        model_shape: ModelShape | None,
        options: RuntimeOptions | None,
        machine: cost.Machine | None,
        checkpoint_on_preemption: str | os.PathLike | None,
        ddp_comm_hook: Callable | None,
        ddp_comm_state: object | None,
        ddp_kwargs: dict[str, Any],
    ) -> None:
        """Check and keep the arguments both strategies take (see ``Tensor3DMixin``); ``ValueError`` naming a
        bad one."""
        self._grid_arg = grid_rules.check_grid_arg(grid)
        self._dp_arg = grid_rules.check_dp_arg(data_parallel_size)
        self.pipeline_size = arguments.positive_int(pipeline_size, "pipeline_size")
        self._model_shape = model_shape
        self._machine = machine
        if options is not None and not isinstance(options, RuntimeOptions):
            raise ValueError(
                f"options must be a lightning_3d.RuntimeOptions or None (the model's own), got {options!r} "
                f"(a {type(options).__name__}): e.g. options=RuntimeOptions(async_tp=True)"
            )
        self.options = options
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1):
            raise ValueError(
                f"zero_stage must be 0 or 1 (optimizer state sharded over dp), got {zero_stage!r}"
            )
        self.zero_stage = zero_stage
        self.checkpoint_on_preemption = (
            None if checkpoint_on_preemption is None else Path(checkpoint_on_preemption)
        )
        self.ddp_comm_hook, self.ddp_comm_state = ddp_comm_hook, ddp_comm_state
        self.ddp_kwargs = checked_ddp_kwargs(ddp_kwargs)
        self._grid: Grid | None = None
        self._zero: dict[int, ShardedOptimizerState] = {}

    def _resolve_grid(self) -> tuple[tuple[int, int, int], int]:
        """``(px, py, pz)`` and dp for this world; :class:`ConfigurationError` naming the fix when they cannot be."""
        with same_on_every_rank():
            # the model is made after the grid: price the options it will run with, else the defaults
            shape, dp = grid_rules.resolve(
                self._grid_arg,
                self._dp_arg,
                self.world_size,
                self.num_processes,
                self._model_shape,
                pipeline_size=self.pipeline_size,
                pipeline=self.pipeline,
                options=self.options,
                machine=self._machine,
                half_grads=grid_rules.halves_gradients(self.ddp_comm_hook),
            )
        why = None if self._model_shape is None else cost.grid_error(self._model_shape, shape, dp)
        if why is not None:
            raise ConfigurationError(
                f"model_shape={self._model_shape} does not split on the {'×'.join(map(str, shape))} grid "
                f"with data_parallel_size={dp}: {why} != 0; pick a grid whose axes divide it, "
                f"or grid='auto' to let the cost model choose"
            )
        return shape, dp

    def start_grid(self) -> Grid:
        """Build (or reuse) this world's grid and make it current; collective over the world, once the
        processes are up."""
        shape, dp = self._resolve_grid()
        self._grid = _grid(shape, dp, self.pipeline_size, self.root_device.type, self._timeout)
        set_grid(self._grid)
        px, py, pz = shape
        self.info(
            f"tensor3d: grid {px}×{py}×{pz}, data_parallel_size={dp}, pipeline_size={self.pipeline_size}, "
            f"zero_stage={self.zero_stage}, "
            f"options: {_changed(self.options)}, across nodes: {'+'.join(self._grid.axes_across_nodes) or 'nothing'}"
        )
        return self._grid

    def split_into_stages(self, model: torch.nn.Module, precision) -> PipelinedModel:
        """This rank's pipeline stages of the plain ``model`` (:func:`.stages.split_model`), split where the
        cost model balances them when ``model_shape`` prices the whole model and ``pipeline`` gives no split
        points (:func:`.grid_rules.priced_split`); ``precision``: the precision plugin, whose fp16 loss scale
        the schedule's backward starts from."""
        pipeline = grid_rules.priced_split(
            self.pipeline,
            self._model_shape,
            self.grid.shape,
            self.grid.data_parallel_size,
            self.pipeline_size,
            self.num_processes,
            options=self.options,
            machine=self._machine,
            half_grads=grid_rules.halves_gradients(self.ddp_comm_hook),
        )
        priced = self._model_shape.layers if pipeline is not self.pipeline else None
        return split_model(model, self.grid, pipeline, self.options, self.root_device, precision, priced)

    def apply_options(self, module: torch.nn.Module) -> None:
        """Give every 3-D layer of ``module`` the strategy's ``options`` (none given: keep the model's)."""
        if self.options is not None:
            with same_on_every_rank():
                set_options(module, **dataclasses.asdict(self.options))

    def seed_workers_by_dp(self, dataloader: object) -> object:
        """Seed dataloader workers by dp rank (``seed_everything(workers=True)``), so the cube ranks that share a batch
        draw alike: in place of no ``worker_init_fn`` or Lightning's own, seeded by global rank."""
        if not int(os.environ.get("PL_SEED_WORKERS", "0")):
            return dataloader
        current = getattr(dataloader, "worker_init_fn", False)
        if current is None or (isinstance(current, partial) and current.func is self.worker_init_function):
            dataloader.worker_init_fn = partial(self.worker_init_function, rank=self.grid.coord("dp"))
        return dataloader

    def ddp_over_dp(self, module: torch.nn.Module, device_ids: list[int] | None) -> DistributedDataParallel:
        """``module`` in DDP over the dp group (it averages gradients over the replicas of each shard only), with
        ``ddp_comm_hook`` registered (its state defaults to the dp group)."""
        ddp = DistributedDataParallel(
            module, device_ids=device_ids, process_group=self.grid.group("dp"), **self.ddp_kwargs
        )
        if self.ddp_comm_hook is not None:
            state = self.ddp_comm_state if self.ddp_comm_state is not None else self.grid.group("dp")
            ddp.register_comm_hook(state, self.ddp_comm_hook)
        return ddp

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """With ``zero_stage=1``, make ``optimizer`` ZeRO-1 over dp."""
        if self.zero_stage == 1 and id(optimizer) not in self._zero:
            self._zero[id(optimizer)] = ShardedOptimizerState(optimizer, self.grid)

    def unshard_optimizer_states(self) -> None:
        """Make every optimizer :meth:`shard_optimizer_state` sharded a plain one again."""
        for zero in self._zero.values():
            zero.remove()
        self._zero = {}

    def holds_state(self, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], bool]:
        """Whether this rank keeps a parameter's state in ``optimizer`` (its ZeRO-1 share; every parameter
        without ZeRO)."""
        zero = self._zero.get(id(optimizer))
        return zero.holds_state if zero is not None else (lambda p: True)
