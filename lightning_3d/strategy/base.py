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
  broadcast, in any stage) and optionally makes each optimizer ZeRO-1 over dp; with
  ``pipeline_size > 1`` it first splits the LightningModule's model into this rank's pipeline
  stages (:mod:`.stages`);
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
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import arguments, cost
from .. import checkpoint as ckpt
from ..cost import ModelShape
from ..options import RuntimeOptions
from ..pipeline import PipelineOptions
from .checkpoints import FABRIC_STATE_KEY, load_meta, load_sharded, save_sharded
from .failures import ReportFailuresOnce, same_on_every_rank
from .grid_strategy import DEFAULT_TIMEOUT, GridStrategy
from .precision import on_grid
from .preemption import StopOnPreemption
from .replicas import GridReplicas
from .resume import resume_point, skip_message
from .stages import built_for_stages, checked_pipeline, drop_unsplit, into_stages
from .summary import SummariseGlobally

FITTING = "fit"  # TrainerFn.FITTING, a str enum in both namespaces


def unwrap(optimizer):
    """The torch optimizer inside Lightning's ``LightningOptimizer``."""
    return getattr(optimizer, "_optimizer", optimizer)


class Tensor3DMixin(ReportFailuresOnce, StopOnPreemption, SummariseGlobally, GridStrategy, GridReplicas):
    """3-D tensor parallelism (Bian et al. 2021) on a ``dp × px × py × pz`` grid of processes.

    The LightningModule builds its 3-D layers (``Linear3D``, ...) in ``configure_model()``;
    the grid exists by then as ``self.grid`` and is the current grid, so layers need no
    ``grid=`` argument. Every rank of a cube (one model replica) gets the same batch; dp
    replicas get different ones, and their gradients are averaged over dp only.

    Args:
        grid: ``(px, py, pz)``, or ``"auto"``: the devices of one node (``world / dp`` when
            ``data_parallel_size`` is given) factored as evenly as possible, px ≥ py ≥ pz
            (8 → 2×2×2, 4 → 2×2×1, 2 → 2×1×1); with ``model_shape`` (and dp ``"auto"``),
            the grid and dp the cost model predicts fastest (:mod:`lightning_3d.cost`).
        data_parallel_size: model replicas, or ``"auto"``: the rest of the world.
        pipeline_size: pipeline stages, each holding ``world / pipeline_size`` ranks (``dp × px ×
            py × pz``). With more than one, ``configure_model`` builds the plain model (``DenseGPT``,
            a Hugging Face model) on ``meta`` and the strategy runs it as
            :class:`lightning_3d.pipeline.PipelinedModel` (``docs/lightning.md``, "Pipeline stages").
        pipeline: the schedule and split (:class:`lightning_3d.pipeline.PipelineOptions`); default
            ``1F1B`` with ``pipeline_size`` micro-batches, the built-in plan, and equal layer counts, or
            with a ``model_shape`` of the whole model (``vocab``) the split the cost model balances (the
            embedding on the first stage, the head and loss on the last, weighed against the layers).
        zero_stage: 0, or 1 to shard optimizer state over the dp group (ZeRO-1).
        process_group_backend: ``"nccl"`` / ``"gloo"``; default from the device.
        timeout: collective timeout (timedelta or seconds, positive and finite): how long a rank
            waits for a dead or stalled peer before the run fails.
        model_shape: ``cost.ModelShape(hidden, heads, seq, batch, layers, ...)`` of the model
            and global batch (``kv_heads``, ``gated`` for Llama-style blocks; ``vocab``: priced as the
            whole training step), for ``grid="auto"``.
        options: the model's run-time choices (:class:`lightning_3d.RuntimeOptions`: ``async_tp``,
            ``compile``, ``activation_checkpointing``, ...); at setup they replace the options of every
            3-D layer of the model (``set_options``). None keeps those it was built with. With
            ``model_shape``, ``grid="auto"`` prices their ``async_tp`` and ``grads_at_end``
            (the defaults' when None).
        machine: the rates ``grid="auto"`` prices with, e.g. ``cost.Machine.from_rates(...)`` of
            what :func:`lightning_3d.cost.measure_machine` measured on these nodes (slow links
            change the choice); default ``cost.DEFAULT_MACHINE``.
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
        ValueError: a bad ``grid``, ``data_parallel_size``, ``pipeline_size``, ``zero_stage`` or ``timeout``,
            ``pipeline`` not a ``PipelineOptions`` or without ``pipeline_size > 1``,
            ``options`` not a ``RuntimeOptions``, a ``ddp_kwargs`` name ``DistributedDataParallel``
            does not take; at setup, numbers that do not multiply to the world size.
    """

    # Set by each namespace's class: its grid-aware precision plugins, summary callbacks and helpers (info,
    # worker_init_function).
    grid_precisions: ClassVar[dict[type, type]]
    lightning_version: ClassVar[str]

    def __init__(
        self,
        grid: Literal["auto"] | tuple[int, int, int] = "auto",
        data_parallel_size: Literal["auto"] | int = "auto",
        pipeline_size: int = 1,
        pipeline: PipelineOptions | None = None,
        zero_stage: int = 0,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        model_shape: ModelShape | None = None,
        options: RuntimeOptions | None = None,
        machine: cost.Machine | None = None,
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
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=arguments.timeout(timeout),
            start_method="popen",
        )
        self.take_grid_arguments(
            grid,
            data_parallel_size,
            pipeline_size,
            zero_stage,
            model_shape,
            options,
            machine,
            checkpoint_on_preemption,
            ddp_comm_hook,
            ddp_comm_state,
            ddp_kwargs,
        )
        self.pipeline = checked_pipeline(pipeline, self.pipeline_size)
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
        """Also check the grid against the world (and ``model_shape``): in the launching process, before any
        other starts."""
        super().set_world_ranks()
        self._resolve_grid()

    @contextlib.contextmanager
    def model_sharded_context(self):
        """``configure_model`` runs alike on every rank: its ``ValueError`` is a :class:`ConfigurationError`.
        With pipeline stages it builds on ``meta``: each rank materialises its own stages at setup."""
        with super().model_sharded_context(), same_on_every_rank(), built_for_stages(self.pipeline):
            yield

    def setup_environment(self) -> None:
        super().setup_environment()
        grid = self.start_grid()
        self.lightning_module.grid = grid
        self.lightning_module._device_mesh = grid.mesh
        self.summarise_globally(self.lightning_module.trainer)
        self.precision_plugin.grid = grid

    def process_dataloader(self, dataloader: object) -> object:
        """Seed dataloader workers by dp rank, so the cube ranks that share a batch draw alike."""
        return self.seed_workers_by_dp(dataloader)

    # ----- model and optimizers -----

    def setup(self, trainer) -> None:
        """As ``DDPStrategy.setup``, without its whole-world broadcast of module states outside fit.

        Optimizer state needs no move to the device: the optimizers are made after the model is
        on it, and the checkpoint restore (after setup) loads state onto the parameters' device.
        """
        self.accelerator.setup(trainer)
        if self._layer_sync is not None:
            raise ValueError(
                "sync_batchnorm is not supported by the tensor3d strategy; use LayerNorm3D / RMSNorm3D"
            )
        if self.pipeline is not None:
            with same_on_every_rank():
                into_stages(
                    self.lightning_module,
                    self.grid,
                    lambda model: self.split_into_stages(model, self.precision_plugin),
                )
        self.apply_options(self.lightning_module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == FITTING:
            if self.grid.data_parallel_size > 1:
                self.configure_ddp()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        """DDP over the dp group: it averages gradients over the replicas of each shard only."""
        return self.ddp_over_dp(model, self.determine_ddp_device_ids())

    def configure_ddp(self) -> None:
        """Wrap the module in DDP over dp, with ``ddp_comm_hook`` registered (the dp group as its default state)."""
        self.model = self._setup_model(self.model)

    def setup_optimizers(self, trainer) -> None:
        self.unshard_optimizer_states()
        super().setup_optimizers(trainer)
        for optimizer in map(unwrap, self.optimizers):
            self.shard_optimizer_state(optimizer)

    def teardown(self) -> None:
        if self.pipeline is not None and self.lightning_module is not None:
            drop_unsplit(self.lightning_module)
        super().teardown()

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

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None
    ) -> None:
        """A sharded checkpoint directory: DCP shards, ``layout.json``, ``rng/``, and ``meta.pt`` (loops,
        callbacks, ...)."""
        if storage_options is not None:
            raise TypeError(
                "Tensor3DStrategy.save_checkpoint does not take storage_options: it writes with "
                "torch.distributed.checkpoint"
            )
        path = Path(self.broadcast(str(filepath)))
        if resume_point(path, checkpoint) == self._resumed_from:
            self.info(skip_message(path))
            return
        state_dict, optimizer_states = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
        save_sharded(path, self.lightning_module, self.grid, state_dict, optimizer_states, checkpoint)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint written on any grid and dp size; loop state comes back to Lightning.

        A checkpoint Fabric wrote (``Tensor3DFabricStrategy``) gives the model and optimizers; the
        loops and LR schedulers start afresh (Fabric keeps no Lightning loop state).
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        fitting = module.trainer.state.fn == FITTING
        optimizers = dict(enumerate(map(unwrap, self.optimizers))) if fitting else {}
        meta = load_meta(path, trusted=weights_only is False)
        load_sharded(
            path, module, self.grid, optimizers, self.holds_state, meta, strict=module.strict_loading
        )
        if fitting:
            # RNG now: the fit loop draws (dataloader seeds) before on_train_start; sanity checks run isolated
            ckpt.set_rng_state(ckpt.load_rng_state(path, self.grid))
        if FABRIC_STATE_KEY in meta:  # what Lightning reads of a checkpoint, of which Fabric's has none
            meta.setdefault("lr_schedulers", [])
            meta.setdefault("pytorch-lightning_version", self.lightning_version)
        self._resumed_from = resume_point(path, meta)
        return meta

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Done by :meth:`load_checkpoint`."""

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Done by :meth:`load_checkpoint`."""

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "tensor3d",
            cls,
            description="3-D tensor parallelism on a dp×px×py×pz grid (lightning_3d)",
            override=True,
        )
