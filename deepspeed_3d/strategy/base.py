"""The behaviour of ``Tensor3DDeepSpeedStrategy``, shared by its ``lightning.pytorch`` and
``pytorch_lightning`` classes.

Each namespace module (:mod:`.lightning`, :mod:`.pytorch_lightning`) defines
``class Tensor3DDeepSpeedStrategy(Tensor3DDeepSpeedMixin, DeepSpeedStrategy)``. This module imports
no Lightning. The class extends Lightning's ``DeepSpeedStrategy`` (launch,
``deepspeed.init_distributed``, config and precision handling, DeepSpeed checkpoints) and changes
what the grid needs:

- ``setup_environment`` builds the grid from the config's ``"tensor3d"`` section (or the
  ``grid=`` argument) before ``configure_model``, makes it current and exposes it as
  ``LightningModule.grid``; it runs on CPU (gloo) as well as CUDA;
- the engine comes from :func:`deepspeed_3d.initialize` (mpu, grad-norm tags, batch check),
  for training and for validate/test/predict alike, so DeepSpeed's start-up broadcast stays
  inside the dp group;
- checkpoints carry the model's sharding record, and one saved on another grid is refused before DeepSpeed
  reads its shards;
- ``configure_model`` runs without ``deepspeed.zero.Init``: ZeRO-3 partitions the 3-D shards
  over dp when the engine is made (``zero.Init`` would partition over the whole world);
- data, ``reduce`` and ``all_gather`` work over dp: every cube rank holds one replica's value;
- Lightning's model summary counts the full model (:mod:`lightning_3d.strategy.summary`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from lightning_3d.grid import Grid, set_grid
from lightning_3d.strategy import grid_rules
from lightning_3d.strategy.failures import ReportFailuresOnce, same_on_every_rank
from lightning_3d.strategy.preemption import StopOnPreemption
from lightning_3d.strategy.replicas import GridReplicas
from lightning_3d.strategy.resume import resume_point, skip_message
from lightning_3d.strategy.summary import SummariseGlobally

from ..config import SECTION, current_grid, grid_shape, init_grid_from_config, pipeline_size
from ..engine import check_checkpoint_grid, engine_record, initialize
from ..sharding_record import RECORD_KEY


class Tensor3DDeepSpeedMixin(ReportFailuresOnce, StopOnPreemption, SummariseGlobally, GridReplicas):
    """DeepSpeed (ZeRO over dp) with 3-D tensor parallelism inside each replica.

    Takes every argument of Lightning's ``DeepSpeedStrategy``; the DeepSpeed config (dict or
    JSON path) may carry ``"tensor3d": {"grid": [px, py, pz]}``; a ``"pipeline_size"`` above 1 is
    refused (no schedule runs here: ``Tensor3DStrategy(pipeline_size=...)`` runs one).

    Args:
        grid: ``(px, py, pz)``; sets the config's ``"tensor3d"`` section (which must then
            agree, if present). Without either: the current grid when one exists, else the
            devices of one node factored as evenly as possible (``"tensor3d"``'s ``"auto"``:
            8 → 2×2×2, 4 → 2×2×1, 2 → 2×1×1).
        checkpoint_on_preemption: where to save a checkpoint when any rank receives SIGTERM or
            SIGINT during training; every rank then stops at the same step and exits with status
            ``128 + signal`` (:mod:`lightning_3d.strategy.preemption`). None: stop without saving.
        **kwargs: as ``DeepSpeedStrategy`` (``config=``, ``stage=``, ...).

    The LightningModule builds its 3-D layers in ``configure_model()`` (the grid is current
    by then and is ``self.grid``); ZeRO ≥ 1 is required with fp16/bf16 on a cube of more
    than one rank (:mod:`deepspeed_3d.precision`).
    """

    # Set by each namespace's class: its DeepSpeedStrategy, seed reset, and hook remover for a model DeepSpeed wrapped.
    deepspeed_strategy: ClassVar[type]
    reset_seed: ClassVar[Callable[[], None]]
    remove_module_hooks: ClassVar[Callable[[torch.nn.Module], None]]

    def __init__(
        self,
        *args,
        grid: tuple[int, int, int] | None = None,
        checkpoint_on_preemption: str | os.PathLike | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_on_preemption = (
            None if checkpoint_on_preemption is None else Path(checkpoint_on_preemption)
        )
        if grid is not None:
            shape = grid_shape({SECTION: {"grid": list(grid)}})
            if grid_shape(self.config) not in (None, shape):
                raise ValueError(
                    f'grid={tuple(grid)} disagrees with the config\'s "{SECTION}": {self.config[SECTION]}; '
                    "give one of them"
                )
            self.config[SECTION] = {**self.config.get(SECTION, {}), "grid": list(shape)}
        self._grid: Grid | None = None
        self._resumed_from: tuple | None = None

    def set_world_ranks(self) -> None:
        """Also check the config's grid against the world: in the launching process, before any other starts."""
        super().set_world_ranks()
        if not isinstance(self.config, dict):
            return
        shape = grid_shape(self.config)
        with same_on_every_rank():
            pp = pipeline_size(self.config)
            if pp > 1:
                raise ValueError(
                    f'the config\'s "{SECTION}": {{"pipeline_size": {pp}}}: Tensor3DDeepSpeedStrategy runs no pipeline '
                    f"schedule; use Tensor3DStrategy(pipeline_size={pp}, zero_stage=1), or drop pipeline_size"
                )
            if shape is not None:
                grid_rules.resolve(shape, "auto", self.world_size, self.num_processes)

    def setup_environment(self) -> None:
        """Processes and DeepSpeed's process group (on any accelerator, CPU included), then the grid."""
        super(self.deepspeed_strategy, self).setup_environment()  # DeepSpeedStrategy's own requires CUDA
        if grid_shape(self.config) is None and current_grid() is None:
            shape, _ = grid_rules.resolve("auto", "auto", self.world_size, self.num_processes)
            self.config[SECTION] = {**self.config.get(SECTION, {}), "grid": list(shape)}
        self._grid = init_grid_from_config(self.config)
        set_grid(self._grid)
        self.lightning_module.grid = self._grid
        self.summarise_globally(self.lightning_module.trainer)

    def setup_distributed(self) -> None:
        """As ``DeepSpeedStrategy``'s, without its CUDA device-index check on CPU."""
        if self.root_device.type == "cuda":
            return super().setup_distributed()
        self.reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @contextlib.contextmanager
    def model_sharded_context(self):
        """No ``deepspeed.zero.Init``: ZeRO-3 partitions the 3-D shards over dp when the engine is made.

        ``configure_model`` runs alike on every rank: its ``ValueError`` is a ``ConfigurationError``.
        """
        self._init_config_if_needed()
        with same_on_every_rank():
            yield

    def _device_args(self) -> argparse.Namespace | None:
        """DeepSpeed's ``args``: the CUDA device index, or None on CPU (DeepSpeed then takes LOCAL_RANK)."""
        return (
            argparse.Namespace(device_rank=self.root_device.index)
            if self.root_device.type == "cuda"
            else None
        )

    def _setup_model_and_optimizer(self, model: torch.nn.Module, optimizer, lr_scheduler=None):
        parameters = [p for p in model.parameters() if p.requires_grad]
        engine, ds_optimizer, _, _ = initialize(
            args=self._device_args(),
            config=self.config,
            model=model,
            model_parameters=parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
        """validate/test/predict without fit: an engine over the grid too (no whole-world broadcast)."""
        config = {
            key: self.config[key]
            for key in ("fp16", "bf16", "zero_optimization", "zero_allow_untested_optimizer", SECTION)
            if key in self.config
        }
        if not self.zero_stage_3:
            config.pop("zero_optimization", None)
        config["train_micro_batch_size_per_gpu"] = 1
        self.remove_module_hooks(model)
        self.model, _, _, _ = initialize(
            args=self._device_args(),
            config=config,
            model=model,
            model_parameters=[],
            dist_init_required=False,
        )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None
    ) -> None:
        """DeepSpeed's checkpoint, with the model's sharding record among the client state (not over the one
        this run resumed from)."""
        if resume_point(self.broadcast(str(filepath)), checkpoint) == self._resumed_from:
            if self.is_global_zero:
                print(skip_message(filepath), flush=True)
            return
        super().save_checkpoint(
            {**checkpoint, RECORD_KEY: engine_record(self.deepspeed_engine)}, filepath, storage_options
        )

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """DeepSpeed's load, after refusing a checkpoint of another grid."""
        if Path(checkpoint_path).is_dir():
            check_checkpoint_grid(self.deepspeed_engine, checkpoint_path)
        client_state = super().load_checkpoint(checkpoint_path, weights_only)
        client_state.pop(RECORD_KEY, None)
        self._resumed_from = resume_point(checkpoint_path, client_state)
        return client_state

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "tensor3d_deepspeed",
            cls,
            description="DeepSpeed ZeRO over dp with 3-D tensor parallelism (deepspeed_3d)",
            override=True,
        )
