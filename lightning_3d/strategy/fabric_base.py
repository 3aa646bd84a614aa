"""The behaviour of ``Tensor3DFabricStrategy``, shared by its ``lightning.fabric`` and ``lightning_fabric`` classes.

Lightning Fabric ships under two names with distinct base classes and registries; each namespace
module (:mod:`.fabric`, :mod:`.lightning_fabric`) defines ``class Tensor3DFabricStrategy(
Tensor3DFabricMixin, DDPStrategy)`` on that namespace's Fabric ``DDPStrategy`` (launcher, process
group, ``barrier``, ``broadcast``, ``all_reduce`` and ``all_gather`` over the world). This module
imports no Lightning. With the Trainer's ``Tensor3DStrategy`` it shares the arguments, the grid,
DDP over dp and ZeRO-1 (:mod:`.grid_strategy`), the sharded checkpoint (:mod:`.checkpoints`), the
preemption vote (:mod:`.preemption`) and the global gradient norm (:mod:`lightning_3d.grad_norm`).

As Fabric's ``ModelParallelStrategy`` does, the strategy owns the model's placement:

- ``fabric.init_module(empty_init=True)`` builds on ``meta``; ``fabric.setup`` (or
  ``setup_module``) puts the model on the grid: :func:`lightning_3d.parallelize` with the
  strategy's ``plan`` (default: the built-in plan of the model's class), or, for a model already
  made of 3-D layers, materialises it (``reset_parameters``) on this rank's device; with
  ``pipeline_size > 1`` it splits the plain model into this rank's stages, a
  :class:`~lightning_3d.pipeline.PipelinedModel` (:mod:`.stages`, as the Trainer strategy does),
  which ``model(ids, targets)`` runs for a whole batch; the object passed in becomes this rank's
  (last) stage module, so the returned model's ``module`` and ``state_dict()`` hold that stage's
  shards under the whole model's names; then DDP over the dp group. An optimizer
  passed to ``fabric.setup`` with the model is moved onto the model's 3-D parameters by name (those
  of this rank's stages);
- ``fabric.clip_gradients(max_norm=...)`` clips by the global norm; ``fabric.no_backward_sync``
  skips the gradient all-reduce over dp; ``setup_dataloaders`` gives the cube ranks one batch;
- ``fabric.save`` / ``fabric.load`` write and read the sharded checkpoint, which the Trainer
  strategy reads too (and the reverse);
- :meth:`Tensor3DFabricMixin.check_preemption`, called once a step by the loop, stops every rank
  at the same step when any rank got SIGTERM or SIGINT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import arguments, cost
from .. import checkpoint as ckpt
from ..cost import ModelShape
from ..grad_norm import clip_grad_norm_
from ..layers import Module3D
from ..options import RuntimeOptions
from ..parallel import Plan, parallelize
from ..pipeline import PipelineOptions
from .checkpoints import FABRIC_STATE_KEY, PARAM_GROUPS_KEY, load_meta, load_sharded, save_sharded
from .failures import same_on_every_rank
from .grid_strategy import DEFAULT_TIMEOUT, GridStrategy
from .precision import fabric_precision
from .preemption import PreemptionWatch, stop_message
from .stages import checked_pipeline

_PRIVATE_META = (PARAM_GROUPS_KEY, FABRIC_STATE_KEY)


def _bare(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def _is_stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def materialize_(module: nn.Module, device: torch.device) -> None:
    """Give a model of 3-D layers built on ``meta`` its tensors on ``device``: each module's ``reset_parameters()``.

    Raises:
        ValueError: a module holding tensors has no ``reset_parameters()``.
    """
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return
    bare = [
        f"{name or '(the model)'} ({type(m).__name__})"
        for name, m in module.named_modules()
        if any(True for _ in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
        and not callable(getattr(m, "reset_parameters", None))
    ]
    if bare:
        raise ValueError(
            f"the model was built on meta (fabric.init_module(empty_init=True)) but {bare} have no reset_parameters() "
            "to initialise their tensors: build it without empty_init, or give those modules reset_parameters()"
        )
    module.to_empty(device=device)
    for m in module.modules():
        if any(True for _ in (*m.parameters(recurse=False), *m.buffers(recurse=False))):
            m.reset_parameters()


def rebind_parameters_(
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    params: dict[str, list[nn.Parameter]],
    elsewhere: frozenset[str] = frozenset(),
) -> None:
    """Point ``optimizer``'s param groups at ``params`` (the model's parameters after setup, by name; a
    parameter that two pipeline stages of this rank hold, a tied embedding and head, under the first
    stage's name) by the names ``names`` gave the old ones (``id(param)`` → name, from before setup);
    those named in ``elsewhere`` (other pipeline stages' parameters) leave it.

    Raises:
        ValueError: the optimizer already has state, or holds a parameter that is not the model's.
    """
    if optimizer.state:
        raise ValueError(
            "the optimizer passed to fabric.setup already has state: pass a fresh one, and restore its state "
            "after setup with fabric.load(path, {'model': model, 'optimizer': optimizer})"
        )
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if names.get(id(p)) not in elsewhere]
        missing = [
            names.get(id(p), f"a {list(p.shape)} tensor")
            for p in group["params"]
            if names.get(id(p)) not in params
        ]
        if missing:
            raise ValueError(
                f"the optimizer holds parameters that are not the model's ({missing[:4]}): create it from "
                "model.parameters(), or after model = fabric.setup_module(model), then "
                "fabric.setup_optimizers(optimizer)"
            )
        group["params"] = [q for p in group["params"] for q in params[names[id(p)]]]


class DataParallelSync:
    """``fabric.no_backward_sync``: skip DDP's gradient all-reduce over dp (nothing to skip when dp = 1). The 3-D
    layers' reductions inside the cube are part of each gradient and always run."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()


class Tensor3DFabricMixin(GridStrategy):
    """3-D tensor parallelism (Bian et al. 2021) in Lightning Fabric, on a ``dp × px × py × pz`` grid of processes.

    ``fabric.setup(model, optimizer)`` puts the model on the grid (``lightning_3d.parallelize`` with
    ``plan``, or the built-in plan of its class; a model already made of 3-D layers as it is); every
    rank of a cube gets the same batch from ``setup_dataloaders``, the dp replicas different ones,
    and gradients are averaged over dp only. ``fabric.all_reduce``/``all_gather``/``broadcast``/
    ``barrier`` span the world, as in every Fabric strategy (a value on each cube rank counts
    ``px·py·pz`` times in a world-wide sum; ``strategy.grid.group("dp")`` reduces over dp).

    Args:
        grid, data_parallel_size, zero_stage, process_group_backend, timeout, model_shape,
        machine, ddp_comm_hook, ddp_comm_state, **ddp_kwargs: as the Trainer's
            ``Tensor3DStrategy`` (``docs/lightning.md``).
        pipeline_size: pipeline stages of the grid (``strategy.grid.stage``, its ``"pipe"`` group);
            with more than one, ``fabric.setup`` splits the plain model (built under
            ``fabric.init_module(empty_init=True)``) into this rank's stages (the object passed
            in becomes this rank's last stage module: the returned model's ``module``), and
            ``loss = model(ids, targets)`` runs the schedule for the batch (``docs/lightning.md``).
        pipeline: the schedule and split (:class:`lightning_3d.pipeline.PipelineOptions`), as the
            Trainer's ``Tensor3DStrategy`` takes it.
        plan: the :class:`lightning_3d.Plan` that ``fabric.setup`` parallelizes the model (or each
            stage) with; default: the built-in plan of its class.
        options: the model's run-time choices (:class:`lightning_3d.RuntimeOptions`); at
            ``fabric.setup`` they replace the options of every 3-D layer of the model. None keeps the
            plan's (a model ``setup`` parallelizes) or those the model was built with. With
            ``model_shape``, ``grid="auto"`` prices their ``async_tp`` and ``grads_at_end``.
        checkpoint_on_preemption: where :meth:`check_preemption` saves the loop's ``state`` when
            any rank got SIGTERM or SIGINT; None: stop without saving.

    Raises:
        ValueError: a bad argument (as the Trainer's strategy), a precision plugin other than
            Fabric's ``32-true``, ``64-true``, ``16-true``, ``bf16-true``, ``bf16-mixed``,
            ``16-mixed``; at ``Fabric(...)``, numbers that do not multiply to the world size.
    """

    # Set by each namespace's class: Fabric's Precision, DoublePrecision, HalfPrecision and MixedPrecision.
    supported_precisions: ClassVar[tuple[type, ...]]

    def __init__(
        self,
        grid: Literal["auto"] | tuple[int, int, int] = "auto",
        data_parallel_size: Literal["auto"] | int = "auto",
        pipeline_size: int = 1,
        pipeline: PipelineOptions | None = None,
        zero_stage: int = 0,
        plan: Plan | None = None,
        options: RuntimeOptions | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        model_shape: ModelShape | None = None,
        machine: cost.Machine | None = None,
        checkpoint_on_preemption: str | os.PathLike | None = None,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        precision=None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_state: object | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
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
        if plan is not None and not isinstance(plan, Plan):
            raise ValueError(
                f"plan must be a lightning_3d.Plan or None (the built-in plan of the model's class), got {plan!r}"
            )
        self.plan = plan
        self.pipeline = checked_pipeline(pipeline, self.pipeline_size)
        if self.pipeline is not None and plan is not None:
            if self.pipeline.plan is not None:
                raise ValueError(
                    "plan= and pipeline=PipelineOptions(plan=...) both give the stages' plan: pass one of them"
                )
            self.pipeline = dataclasses.replace(self.pipeline, plan=plan)
        self._backward_sync_control = DataParallelSync()
        self._watch: PreemptionWatch | None = None
        self._steps = 0

    # ----- precision and checkpoint IO -----

    @property
    def precision(self):
        return self._precision if self._precision is not None else self.supported_precisions[0]()

    @precision.setter
    def precision(self, precision) -> None:
        self._precision = fabric_precision(precision, self.supported_precisions)

    @property
    def checkpoint_io(self):
        raise NotImplementedError(
            f"{type(self).__name__} writes sharded checkpoints itself: it has no CheckpointIO plugin"
        )

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:
        if io is not None:
            raise NotImplementedError(
                f"{type(self).__name__} writes sharded checkpoints itself: it takes no CheckpointIO plugin"
            )

    # ----- the grid -----

    def _set_world_ranks(self) -> None:
        """Also check the grid against the world: at ``Fabric(...)``, in the launching process, before any
        other starts."""
        super()._set_world_ranks()
        self._resolve_grid()

    def setup_environment(self) -> None:
        super().setup_environment()
        self.start_grid()

    @property
    def device_mesh(self):
        """The grid's ``DeviceMesh`` of shape ``(dp, px, py, pz)``, named ``("dp", "x", "y", "z")``."""
        return self.grid.mesh

    def process_dataloader(self, dataloader: object) -> object:
        """Seed dataloader workers by dp rank, so the cube ranks that share a batch draw alike."""
        return self.seed_workers_by_dp(dataloader)

    # ----- model and optimizers -----

    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Build on ``meta`` with ``empty_init=True`` (``setup`` makes each rank's shards), else on this
        rank's device."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        """Done by :meth:`setup_module`, which places each rank's shards."""

    def put_on_grid(self, module: nn.Module) -> nn.Module:
        """``module`` on the grid: parallelized by the plan in place, or, made of 3-D layers already, materialised
        and moved to this rank's device, with the strategy's ``options``; with pipeline stages, this rank's
        stages of it (:meth:`split_into_stages`), which consumes ``module``: the object becomes this rank's
        (last) stage module, its class unchanged."""
        if isinstance(module, DistributedDataParallel):
            raise TypeError(
                "pass fabric.setup the model itself, not wrapped in DistributedDataParallel: the strategy "
                "wraps it over dp"
            )
        if self.pipeline is not None:
            with same_on_every_rank():
                return self.split_into_stages(module, self.precision)
        with same_on_every_rank():
            if any(isinstance(m, Module3D) for m in module.modules()):
                materialize_(module, self.root_device)
                self.apply_options(module)
            else:
                parallelize(module, self.plan, grid=self.grid, options=self.options, device=self.root_device)
        module.to(self.root_device)
        return module

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Put ``module`` on the grid (:meth:`put_on_grid`), in DDP over dp when dp > 1."""
        module = self.put_on_grid(module)
        if self.grid.data_parallel_size > 1:
            return self.ddp_over_dp(module, self._determine_ddp_device_ids())
        return module

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler=None
    ):
        """As :meth:`setup_module`; each optimizer, made for the model before it went on the grid, is moved onto
        its 3-D parameters by name."""
        names = {id(p): name for name, p in module.named_parameters()}
        module = self.setup_module(module)
        held = ckpt.parameter_names(_bare(module))  # a stage's copy of a tied weight under the weight's name
        params: dict[str, list[nn.Parameter]] = {}
        for p in _bare(module).parameters():
            params.setdefault(held[id(p)], []).append(p)
        elsewhere = frozenset(names.values()) - params.keys() if self.pipeline is not None else frozenset()
        for optimizer in optimizers:
            rebind_parameters_(optimizer, names, params, elsewhere)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """ZeRO-1 over dp with ``zero_stage=1``; the optimizer object stays the user's."""
        self.shard_optimizer_state(optimizer)
        return optimizer

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the model's global norm (each distinct shard counted once); returns that norm, the same on
        every rank."""
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(
            self.precision.main_params(optimizer),
            max_norm,
            self.grid,
            norm_type,
            error_if_nonfinite=error_if_nonfinite,
        )

    # ----- checkpoints -----

    def _split(
        self, state: dict[str, Any]
    ) -> tuple[str, nn.Module, list[tuple[str, torch.optim.Optimizer]], dict[str, Any]]:
        modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
        if len(modules) != 1:
            raise ValueError(
                f"the tensor3d checkpoint holds one model: state must have exactly one nn.Module "
                f"({{'model': model, 'optimizer': optimizer, ...}}), got {len(modules)}: {modules}"
            )
        optimizers = [(k, v) for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        rest = {
            k: v for k, v in state.items() if k != modules[0] and not isinstance(v, torch.optim.Optimizer)
        }
        return modules[0], _bare(state[modules[0]]), optimizers, rest

    def save_checkpoint(
        self,
        path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """A sharded checkpoint directory at ``path`` (``lightning_3d.checkpoint``); collective over the world.

        ``state``: one model, its optimizers, and anything else: objects with ``state_dict()`` /
        ``load_state_dict()`` (LR schedulers) are saved by their state dict, other values (step
        counters, tensors, containers of plain values) as they are, in ``meta.pt``.
        """
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint does not take storage_options: it writes with "
                "torch.distributed.checkpoint"
            )
        if filter is not None:
            raise NotImplementedError(
                f"{type(self).__name__} saves every tensor of the model, sharded: it takes no filter"
            )
        path = Path(self.broadcast(str(path)))
        key, module, optimizers, rest = self._split(state)
        names = ckpt.parameter_names(module)
        meta = {k: v.state_dict() if _is_stateful(v) else v for k, v in rest.items()}
        meta[FABRIC_STATE_KEY] = {"module": key, "optimizers": [k for k, _ in optimizers]}
        save_sharded(
            path,
            module,
            self.grid,
            ckpt.model_state(module, self.grid),
            [ckpt.optimizer_state(optimizer, names, self.grid) for _, optimizer in optimizers],
            meta,
        )

    def load_checkpoint(
        self, path, state=None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a checkpoint written on any grid, by Fabric or the Trainer strategy.

        The model's tensors, each optimizer's state (the checkpoint's optimizer saved under the same
        key, else by position), and every other entry of ``state`` from ``meta.pt`` (read without
        running code; ``weights_only=False`` trusts it). Returns the checkpoint's entries ``state``
        does not name. A bare module as ``state`` (``fabric.load_raw``) loads its tensors only.
        Collective over the world.

        Raises:
            ValueError: no state, or not one model in it.
            KeyError: with ``strict``, entries of ``state`` the checkpoint lacks.
            CheckpointError: an incomplete, altered or unsafe checkpoint, or another model's.
        """
        if not state:
            raise ValueError(
                f"{type(self).__name__}.load_checkpoint needs the objects to restore: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        path = Path(self.broadcast(str(path)))
        if isinstance(state, nn.Module):
            ckpt.load_model_(_bare(state), self.grid, path, strict=strict)
            return {}
        if isinstance(state, torch.optim.Optimizer):
            raise NotImplementedError(
                f"{type(self).__name__} loads an optimizer together with its model: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )
        _, module, optimizers, rest = self._split(state)
        meta = load_meta(path, trusted=weights_only is False)
        missing = sorted(k for k in rest if k not in meta)
        if strict and missing:
            raise KeyError(
                f"{path} holds no {missing} (it holds {sorted(k for k in meta if k not in _PRIVATE_META)}); "
                "load with strict=False to restore the rest"
            )
        saved = meta.get(FABRIC_STATE_KEY, {}).get("optimizers", [])
        indices = {
            saved.index(k) if k in saved else i: optimizer for i, (k, optimizer) in enumerate(optimizers)
        }
        load_sharded(path, module, self.grid, indices, self.holds_state, meta, strict=strict)
        for k, value in rest.items():
            if k not in meta:
                continue
            if _is_stateful(value):
                value.load_state_dict(meta[k])
            else:
                state[k] = meta[k]
        return {k: v for k, v in meta.items() if k not in state and k not in _PRIVATE_META}

    # ----- preemption -----

    def check_preemption(self, state: dict[str, Any] | None = None) -> None:
        """Call once every training step, on every rank: after SIGTERM or SIGINT on any rank, every rank stops here,
        at the same step, within two steps of the signal.

        The first call takes SIGTERM and SIGINT over (a signal then only notes itself) and, like every
        call, votes over the world in the background. At the agreed step every rank saves ``state``
        to ``checkpoint_on_preemption`` (if given), rank 0 says what happened, and every rank raises
        :class:`~lightning_3d.strategy.preemption.Preempted`, a ``SystemExit`` of status
        ``128 + signal`` (143 for SIGTERM). Collective over the world.

        Raises:
            ValueError: ``checkpoint_on_preemption`` was given but ``state`` was not.
        """
        if self.checkpoint_on_preemption is not None and state is None:
            raise ValueError(
                "check_preemption(state) needs the state to save to "
                f"checkpoint_on_preemption={str(self.checkpoint_on_preemption)!r}: "
                "pass what fabric.save would take ({'model': model, 'optimizer': optimizer, ...})"
            )
        if self._watch is None:
            self._watch = PreemptionWatch(self.global_rank)
            self._watch.install(self._timeout)
        self._steps += 1
        stop = self._watch.agreed()
        if stop is not None:
            self._stop(*stop, state)

    def _stop(self, signum: int, rank: int, state: dict[str, Any] | None) -> None:
        path = self.checkpoint_on_preemption
        message = stop_message(
            signum,
            rank,
            f"check_preemption call {self._steps}",
            path,
            resume="fabric.load({path!r}, state)",
            strategy="Tensor3DFabricStrategy",
        )
        self._watch.stop(
            signum, message, None if path is None else partial(self.save_checkpoint, path, state)
        )

    def teardown(self) -> None:
        if self._watch is not None:
            self._watch.uninstall()
            self._watch = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "tensor3d",
            cls,
            description="3-D tensor parallelism on a dp×px×py×pz grid (lightning_3d)",
            override=True,
        )
