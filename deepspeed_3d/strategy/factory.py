"""The one definition of ``Tensor3DDeepSpeedStrategy``, instantiated per Lightning namespace.

It extends Lightning's ``DeepSpeedStrategy`` (launch, ``deepspeed.init_distributed``, config and
precision handling, DeepSpeed checkpoints) and changes what the grid needs:

- ``setup_environment`` builds the grid from the config's ``"tensor3d"`` section (or the
  ``grid=`` argument) before ``configure_model``, makes it current and exposes it as
  ``LightningModule.grid``; it runs on CPU (gloo) as well as CUDA;
- the engine comes from :func:`deepspeed_3d.initialize` (mpu, grad-norm tags, batch check,
  layout in checkpoints), for training and for validate/test/predict alike, so DeepSpeed's
  start-up broadcast stays inside the dp group;
- ``configure_model`` runs without ``deepspeed.zero.Init``: ZeRO-3 partitions the 3-D shards
  over dp when the engine is made (``zero.Init`` would partition over the whole world);
- data, ``reduce`` and ``all_gather`` work over dp: every cube rank holds one replica's value.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib

import torch

from lightning_3d.grid import Grid, set_grid
from lightning_3d.strategy import grid_rules
from lightning_3d.strategy.factory import FABRIC
from lightning_3d.strategy.replicas import replicas_mixin

from ..config import SECTION, current_grid, grid_shape, init_grid_from_config
from ..engine import initialize


def define_strategy(namespace: str, module_name: str) -> type:
    """``Tensor3DDeepSpeedStrategy`` for ``namespace`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``)."""
    strategies = importlib.import_module(f"{namespace}.strategies")
    DeepSpeedStrategy, StrategyRegistry = strategies.DeepSpeedStrategy, strategies.StrategyRegistry
    fabric = FABRIC[namespace]
    reset_seed = importlib.import_module(f"{fabric}.utilities.seed").reset_seed

    class Tensor3DDeepSpeedStrategy(replicas_mixin(fabric), DeepSpeedStrategy):
        """DeepSpeed (ZeRO over dp) with 3-D tensor parallelism inside each replica.

        Takes every argument of Lightning's ``DeepSpeedStrategy``; the DeepSpeed config (dict or
        JSON path) may carry ``"tensor3d": {"grid": [px, py, pz]}``.

        Args:
            grid: ``(px, py, pz)``; sets the config's ``"tensor3d"`` section (which must then
                agree, if present). Without either: the current grid when one exists, else the
                devices of one node factored as evenly as possible (``"tensor3d"``'s ``"auto"``:
                8 → 2×2×2, 4 → 2×2×1, 2 → 2×1×1).
            **kwargs: as ``DeepSpeedStrategy`` (``config=``, ``stage=``, ...).

        The LightningModule builds its 3-D layers in ``configure_model()`` (the grid is current
        by then and is ``self.grid``); ZeRO ≥ 1 is required with fp16/bf16 on a cube of more
        than one rank (:mod:`deepspeed_3d.precision`).
        """

        def __init__(self, *args, grid: tuple[int, int, int] | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if grid is not None:
                shape = grid_shape({SECTION: {"grid": list(grid)}})
                if grid_shape(self.config) not in (None, shape):
                    raise ValueError(f'grid={tuple(grid)} disagrees with the config\'s "{SECTION}": {self.config[SECTION]}; give one of them')
                self.config[SECTION] = {**self.config.get(SECTION, {}), "grid": list(shape)}
            self._grid: Grid | None = None

        def setup_environment(self) -> None:
            """Processes and DeepSpeed's process group (on any accelerator, CPU included), then the grid."""
            super(DeepSpeedStrategy, self).setup_environment()
            if grid_shape(self.config) is None and current_grid() is None:
                shape, _ = grid_rules.resolve("auto", "auto", self.world_size, self.num_processes)
                self.config[SECTION] = {**self.config.get(SECTION, {}), "grid": list(shape)}
            self._grid = init_grid_from_config(self.config)
            set_grid(self._grid)
            self.lightning_module.grid = self._grid

        def setup_distributed(self) -> None:
            """As ``DeepSpeedStrategy``'s, without its CUDA device-index check on CPU."""
            if self.root_device.type == "cuda":
                return super().setup_distributed()
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        @contextlib.contextmanager
        def model_sharded_context(self):
            """No ``deepspeed.zero.Init``: ZeRO-3 partitions the 3-D shards over dp when the engine is made."""
            self._init_config_if_needed()
            yield

        def _device_args(self) -> argparse.Namespace | None:
            """DeepSpeed's ``args``: the CUDA device index, or None on CPU (DeepSpeed then takes LOCAL_RANK)."""
            return argparse.Namespace(device_rank=self.root_device.index) if self.root_device.type == "cuda" else None

        def _setup_model_and_optimizer(self, model: torch.nn.Module, optimizer, lr_scheduler=None):
            parameters = [p for p in model.parameters() if p.requires_grad]
            engine, ds_optimizer, _, _ = initialize(
                args=self._device_args(), config=self.config, model=model,
                model_parameters=parameters, optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False,
            )
            return engine, ds_optimizer

        def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
            """validate/test/predict without fit: an engine over the grid too (no whole-world broadcast)."""
            config = {key: self.config[key] for key in ("fp16", "bf16", "zero_optimization", "zero_allow_untested_optimizer", SECTION) if key in self.config}
            if not self.zero_stage_3:
                config.pop("zero_optimization", None)
            config["train_micro_batch_size_per_gpu"] = 1
            importlib.import_module(f"{namespace}.strategies.deepspeed").remove_module_hooks(model)
            self.model, _, _, _ = initialize(args=self._device_args(), config=config,
                                             model=model, model_parameters=[], dist_init_required=False)

        @classmethod
        def register_strategies(cls, strategy_registry) -> None:
            strategy_registry.register("tensor3d_deepspeed", cls, description="DeepSpeed ZeRO over dp with 3-D tensor parallelism (deepspeed_3d)", override=True)

    Tensor3DDeepSpeedStrategy.__module__, Tensor3DDeepSpeedStrategy.__qualname__ = module_name, "Tensor3DDeepSpeedStrategy"
    Tensor3DDeepSpeedStrategy.register_strategies(StrategyRegistry)
    return Tensor3DDeepSpeedStrategy
