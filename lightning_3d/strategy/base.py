"""The behaviour of ``Tensor3DStrategy``, shared by its ``lightning.pytorch`` and ``pytorch_lightning`` classes.

``lightning.pytorch`` and ``pytorch_lightning`` ship the same code under two names, with distinct
base classes and registries; each namespace module (:mod:`.lightning`, :mod:`.pytorch_lightning`)
defines ``class Tensor3DStrategy(Tensor3DMixin, DDPStrategy)`` with its own precision plugins,
summary callbacks and helpers. This module imports no Lightning. The class extends Lightning's ``DDPStrategy``
(launcher, process-group setup, barrier, object broadcast, manual-optimization hooks) and
replaces what must change on a grid:

- ``setup_environment`` builds the grid (all groups) before ``configure_model``, makes it current
  and exposes it as ``LightningModule.grid``;
- ``setup`` wraps the module in DDP over the **dp group only** (no whole-world parameter
  broadcast, in any stage) and optionally makes each optimizer ZeRO-1 over dp;
- the precision plugin is Lightning's, as a subclass that clips by the global 3-D norm (and, for
  fp16, agrees on overflow over the world): :mod:`.precision`;
- data, ``reduce``, ``all_gather`` and ``self.log(sync_dist=True)`` work over dp: every cube rank
  holds one replica's value, so reducing over the world would count it ``px·py·pz`` times;
- checkpoints are sharded directories (:mod:`lightning_3d.checkpoint`) plus ``meta.pt``; a resumed
  run does not rewrite the one it started from (:mod:`.resume`);
- ``set_world_ranks`` (in the launching process too) refuses a grid that does not fit the world,
  and an error every rank makes alike is shown once (:mod:`.failures`);
- SIGTERM / SIGINT on any rank stops every rank at the same step (:mod:`.preemption`);
- Lightning's model summary counts the full model (:mod:`.summary`).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import arguments, planner
from .. import checkpoint as ckpt
from ..grid import Grid, init_grid, set_grid
from ..options import RuntimeOptions
from ..parallel import set_options
from ..planner import ModelShape
from . import grid_rules
from .failures import ConfigurationError, ReportFailuresOnce, same_on_every_rank
from .precision import on_grid
from .preemption import StopOnPreemption
from .replicas import GridReplicas
from .resume import resume_point, skip_message
from .summary import SummariseGlobally
from .zero import ShardedOptimizerState

PARAM_GROUPS_KEY = "tensor3d_param_groups"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
FITTING = "fit"  # TrainerFn.FITTING, a str enum in both namespaces

_grids: dict[tuple, Grid] = {}


def _grid(shape: tuple[int, int, int], dp: int, device_type: str, timeout: datetime.timedelta) -> Grid:
    """One grid per shape and world group: a second fit/validate in the same processes reuses its groups."""
    key = (shape, dp, device_type, timeout, id(dist.group.WORLD))
    if key not in _grids:
        _grids[key] = init_grid(shape, dp, device_type=device_type, timeout=timeout)
    return _grids[key]


def unwrap(optimizer):
    """The torch optimizer inside Lightning's ``LightningOptimizer``."""
    return getattr(optimizer, "_optimizer", optimizer)


_DDP_SET_BY_STRATEGY = {"self", "module", "device_ids", "output_device", "process_group", "device_mesh"}


def _checked_ddp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` if ``DistributedDataParallel`` takes every name and the strategy sets none of them; else ``ValueError``."""
    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - _DDP_SET_BY_STRATEGY
    wrong = sorted(set(kwargs) - accepted)
    if wrong:
        raise ValueError(f"Tensor3DStrategy: {wrong} are not DistributedDataParallel arguments the strategy passes on; "
                         f"accepted: {sorted(accepted)} (device_ids and process_group are the strategy's)")
    return dict(kwargs)


class Tensor3DMixin(ReportFailuresOnce, StopOnPreemption, SummariseGlobally, GridReplicas):
    """3-D tensor parallelism (Bian et al. 2021) on a ``dp × px × py × pz`` grid of processes.

    The LightningModule builds its 3-D layers (``Linear3D``, ...) in ``configure_model()``;
    the grid exists by then as ``self.grid`` and is the current grid, so layers need no
    ``grid=`` argument. Every rank of a cube (one model replica) gets the same batch; dp
    replicas get different ones, and their gradients are averaged over dp only.

    Args:
        grid: ``(px, py, pz)``, or ``"auto"``: the devices of one node (``world / dp`` when
            ``data_parallel_size`` is given) factored as evenly as possible, px ≥ py ≥ pz
            (8 → 2×2×2, 4 → 2×2×1, 2 → 2×1×1); with ``model_shape`` (and dp ``"auto"``),
            the grid and dp the cost model predicts fastest (:mod:`lightning_3d.planner`).
        data_parallel_size: model replicas, or ``"auto"``: the rest of the world.
        zero_stage: 0, or 1 to shard optimizer state over the dp group (ZeRO-1).
        process_group_backend: ``"nccl"`` / ``"gloo"``; default from the device.
        timeout: collective timeout (timedelta or seconds, positive and finite): how long a rank
            waits for a dead or stalled peer before the run fails.
        model_shape: ``planner.ModelShape(hidden, heads, seq, batch, layers, ...)`` of the model
            and global batch (``kv_heads``, ``gated`` for Llama-style blocks; ``vocab``: priced as the
            whole training step), for ``grid="auto"``.
        async_tp: run the activation gathers and scatters of the 3-D products as collective
            matmuls over symmetric memory (the model's ``RuntimeOptions.async_tp``, set at setup; GPUs of one NVLink
            domain); see ``docs/benchmarks.md`` for where it pays.
        machine: the rates ``grid="auto"`` prices with, e.g. ``planner.Machine.from_rates(...)`` of
            what :func:`lightning_3d.machine.measure_machine` measured on these nodes (slow links
            change the choice); default ``planner.DEFAULT_MACHINE``.
        checkpoint_on_preemption: where to save a checkpoint when any rank receives SIGTERM or
            SIGINT during training; every rank then stops at the same step and exits with status
            ``128 + signal`` (:mod:`lightning_3d.strategy.preemption`). None: stop without saving.
        ddp_comm_hook: a ``DistributedDataParallel`` communication hook for the gradient
            reduction over dp (e.g. ``default_hooks.bf16_compress_hook``: half the bytes), as in
            Lightning's ``DDPStrategy``; registered on every device type.
        ddp_comm_state: the hook's state; default: the dp process group.
        **ddp_kwargs: further ``DistributedDataParallel`` arguments (``bucket_cap_mb``,
            ``gradient_as_bucket_view``, ``static_graph``, ...); the strategy sets ``device_ids``
            and ``process_group``.

    Raises:
        ValueError: a bad ``grid``, ``data_parallel_size``, ``zero_stage``, ``timeout`` or
            ``async_tp``, a ``ddp_kwargs`` name ``DistributedDataParallel`` does not take; at setup,
            numbers that do not multiply to the world size.
    """

    # Set by each namespace's class: its grid-aware precision plugins, summary callbacks and helpers.
    grid_precisions: ClassVar[dict[type, type]]
    info: ClassVar[Callable[[str], None]]
    worker_init_function: ClassVar[Callable[..., None]]

    def __init__(
        self,
        grid: Literal["auto"] | tuple[int, int, int] = "auto",
        data_parallel_size: Literal["auto"] | int = "auto",
        zero_stage: int = 0,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        model_shape: ModelShape | None = None,
        async_tp: bool = False,
        machine: planner.Machine | None = None,
        checkpoint_on_preemption: str | os.PathLike | None = None,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_state: object | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=arguments.timeout(timeout), start_method="popen")
        self._grid_arg = grid_rules.check_grid_arg(grid)
        self._dp_arg = grid_rules.check_dp_arg(data_parallel_size)
        self._model_shape = model_shape
        self._machine = machine
        self.async_tp = arguments.flag(async_tp, "async_tp")
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1):
            raise ValueError(f"zero_stage must be 0 or 1 (optimizer state sharded over dp), got {zero_stage!r}")
        self.zero_stage = zero_stage
        self.checkpoint_on_preemption = None if checkpoint_on_preemption is None else Path(checkpoint_on_preemption)
        self.ddp_comm_hook, self.ddp_comm_state = ddp_comm_hook, ddp_comm_state
        self.ddp_kwargs = _checked_ddp_kwargs(ddp_kwargs)
        self._grid: Grid | None = None
        self._zero: dict[int, ShardedOptimizerState] = {}
        self._resumed_from: tuple | None = None

    # ----- precision: Lightning's plugin, as its grid-aware subclass -----

    @property
    def precision_plugin(self):
        if self._precision_plugin is None:
            self._precision_plugin = on_grid(super().precision_plugin, self.grid_precisions)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        self._precision_plugin = on_grid(plugin, self.grid_precisions)

    # ----- the grid -----

    def set_world_ranks(self) -> None:
        """Also check the grid against the world (and ``model_shape``): in the launching process, before any other starts."""
        super().set_world_ranks()
        self._resolve_grid()

    def _resolve_grid(self) -> tuple[tuple[int, int, int], int]:
        """``(px, py, pz)`` and dp for this world; :class:`ConfigurationError` naming the fix when they cannot be."""
        with same_on_every_rank():
            # the model and its options are made in configure_model, after the grid: price the default options
            shape, dp = grid_rules.resolve(self._grid_arg, self._dp_arg, self.world_size, self.num_processes, self._model_shape,
                                           self.async_tp, self._machine, grid_rules.halves_gradients(self.ddp_comm_hook),
                                           RuntimeOptions.grads_at_end)
        why = None if self._model_shape is None else planner.grid_error(self._model_shape, shape, dp)
        if why is not None:
            raise ConfigurationError(f"model_shape={self._model_shape} does not split on the {'×'.join(map(str, shape))} grid "
                                     f"with data_parallel_size={dp}: {why} != 0; pick a grid whose axes divide it, "
                                     f"or grid='auto' to let the cost model choose")
        return shape, dp

    @contextlib.contextmanager
    def model_sharded_context(self):
        """``configure_model`` runs alike on every rank: its ``ValueError`` is a :class:`ConfigurationError`."""
        with super().model_sharded_context(), same_on_every_rank():
            yield

    def setup_environment(self) -> None:
        super().setup_environment()
        shape, dp = self._resolve_grid()
        self._grid = _grid(shape, dp, self.root_device.type, self._timeout)
        set_grid(self._grid)
        self.lightning_module.grid = self._grid
        self.lightning_module._device_mesh = self._grid.mesh
        self.summarise_globally(self.lightning_module.trainer)
        self.precision_plugin.grid = self._grid
        px, py, pz = shape
        self.info(f"tensor3d: grid {px}×{py}×{pz}, data_parallel_size={dp}, zero_stage={self.zero_stage}, async_tp={self.async_tp}"
                  f", across nodes: {'+'.join(self._grid.axes_across_nodes) or 'nothing'}")

    def process_dataloader(self, dataloader: object) -> object:
        """Seed dataloader workers by dp rank, so the cube ranks that share a batch draw alike."""
        if int(os.environ.get("PL_SEED_WORKERS", "0")) and getattr(dataloader, "worker_init_fn", False) is None:
            dataloader.worker_init_fn = partial(self.worker_init_function, rank=self.grid.coord("dp"))
        return dataloader

    # ----- model and optimizers -----

    def setup(self, trainer) -> None:
        """As ``DDPStrategy.setup``, without its whole-world broadcast of module states outside fit.

        Optimizer state needs no move to the device: the optimizers are made after the model is
        on it, and the checkpoint restore (after setup) loads state onto the parameters' device.
        """
        self.accelerator.setup(trainer)
        if self._layer_sync is not None:
            raise ValueError("sync_batchnorm is not supported by the tensor3d strategy; use LayerNorm3D / RMSNorm3D")
        if self.async_tp:
            set_options(self.lightning_module, async_tp=True)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == FITTING:
            if self.grid.data_parallel_size > 1:
                self.configure_ddp()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        """DDP over the dp group: it averages gradients over the replicas of each shard only."""
        return DistributedDataParallel(model, device_ids=self.determine_ddp_device_ids(), process_group=self.grid.group("dp"),
                                       **self.ddp_kwargs)

    def configure_ddp(self) -> None:
        """Wrap the module in DDP over dp and register ``ddp_comm_hook`` (with the dp group as its default state)."""
        self.model = self._setup_model(self.model)
        if self.ddp_comm_hook is not None:
            state = self.ddp_comm_state if self.ddp_comm_state is not None else self.grid.group("dp")
            self.model.register_comm_hook(state, self.ddp_comm_hook)

    def setup_optimizers(self, trainer) -> None:
        for zero in self._zero.values():
            zero.remove()
        self._zero = {}
        super().setup_optimizers(trainer)
        if self.zero_stage == 1:
            self._zero = {id(opt): ShardedOptimizerState(opt, self.grid) for opt in map(unwrap, self.optimizers)}

    def _holds_state(self, optimizer):
        zero = self._zero.get(id(optimizer))
        return zero.holds_state if zero is not None else (lambda p: True)

    # ----- checkpoints -----

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return ckpt.model_state(self.lightning_module, self.grid)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return ckpt.optimizer_state(unwrap(optimizer), ckpt.parameter_names(self.lightning_module), self.grid)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """A sharded checkpoint directory: DCP shards, ``layout.json``, ``rng/``, and ``meta.pt`` (loops, callbacks, ...)."""
        if storage_options is not None:
            raise TypeError("Tensor3DStrategy.save_checkpoint does not take storage_options: it writes with torch.distributed.checkpoint")
        path = Path(self.broadcast(str(filepath)))
        if resume_point(path, checkpoint) == self._resumed_from:
            self.info(skip_message(path))
            return
        tensors = {ckpt.MODEL_KEY: checkpoint.pop("state_dict")}
        groups = []
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[ckpt.optimizer_key(i)] = {"state": state["state"]}
            groups.append(state["param_groups"])
        ckpt.save(path, tensors, self.grid, self.lightning_module, meta={**checkpoint, PARAM_GROUPS_KEY: groups})

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint written on any grid and dp size; loop state comes back to Lightning."""
        path = Path(self.broadcast(str(checkpoint_path)))
        meta = ckpt.load_meta(path, trusted=weights_only is False)
        module = self.lightning_module
        ckpt.load_model_(module, self.grid, path, strict=module.strict_loading)
        if module.trainer.state.fn == FITTING:
            groups = meta.get(PARAM_GROUPS_KEY, [])
            names = ckpt.parameter_names(module)
            for i, (optimizer, saved) in enumerate(zip(map(unwrap, self.optimizers), groups)):
                ckpt.load_optimizer_(optimizer, i, names, self.grid, path, saved, self._holds_state(optimizer))
            # RNG now: the fit loop draws (dataloader seeds) before on_train_start; sanity checks run isolated
            ckpt.set_rng_state(ckpt.load_rng_state(path, self.grid))
        self._resumed_from = resume_point(path, meta)
        return meta

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Done by :meth:`load_checkpoint`."""

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Done by :meth:`load_checkpoint`."""

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("tensor3d", cls, description="3-D tensor parallelism on a dp×px×py×pz grid (lightning_3d)", override=True)
