"""A training step over this rank's pipeline stages: :func:`build_schedule` and :meth:`Pipeline.step`.

The schedule is ``torch.distributed.pipelining``'s, over the grid's ``"pipe"`` group: each cube
rank hands its own z-layout hidden block ``[rows/(px·py), row_len, h/pz]`` to the rank with the
same cube coordinates in the next stage, and receives its gradient back; nothing is gathered. Every
rank of a cube runs the same schedule step in lockstep, so the collectives inside each stage's
forward and backward match.

Zero-bubble schedules (``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``: those with
weight actions, W) defer the weight gradients of the 3-D products whose weights are gathered over x
(px > 1, ``RuntimeOptions.grads_at_end`` on, the default; eager products, not compiled ones):
during such a step each stage's model is :meth:`~lightning_3d.runtime.WeightGradsAtEnd.deferring`,
a backward (I) computes the input gradients and every other gradient (norms, biases, embeddings,
products of a group of one) and queues those products; the stage's ``dw_builder`` takes what that
backward queued, and the W action runs it: each product computed, reduce-scattered over x (one
collective per run of one group), added to its parameter's ``.grad``. Every cube rank runs the same
W actions in the same order, so their collectives match. Other schedules compute every gradient in
the backward.

The loss is the mean over the whole batch's counted targets, as the model's own forward computes
it: micro-batch ``k`` contributes its mean times ``n_k / n`` (``n_k`` of its targets counted, ``n``
of the batch's), and gradients are not scaled again. Each micro-batch must hold a counted target.

A step called under autocast runs each stage's forward and the loss under it, per micro-batch, and
the backward passes outside it (:class:`~lightning_3d.pipeline.stages.Autocast`). ``loss_scale``
(an fp16 loss scaler's factor) multiplies the loss the backward passes start from, so that fp16
gradients keep their small values; the gradients stay so scaled, the loss returned does not.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from .. import arguments
from ..layers.base import Module3D
from ..runtime import Runtime
from .kinds import (
    ZERO_BUBBLE,
    canonical_name,
    fixed_stages_per_rank,
    schedule_class,
    stage_indices,
    stage_owner,
)
from .stages import Autocast, Stage


class Pipeline:
    """This rank's stages under one schedule, for batches ``[batch, seq_len]`` cut into
    ``n_microbatches`` micro-batches. Build it with :func:`build_schedule`."""

    def __init__(self, stages: list[Stage], schedule: str, n_microbatches: int, batch_shape: tuple[int, int]):
        self.stages, self.schedule_name = stages, canonical_name(schedule)
        self.n_microbatches, self.batch_shape = n_microbatches, batch_shape
        self.grid = stages[0].grid
        self.first = next((s for s in stages if s.is_first), None)
        self.last = next((s for s in stages if s.is_last), None)
        group = self.grid.group("pipe")
        #: each stage's models' runtimes (one per parallelized model)
        self.runtimes = [list({id(m.runtime): m.runtime for m in _layers(s)}.values()) for s in stages]
        torch_stages = [
            PipelineStage(
                s.module,
                s.index,
                s.num_stages,
                s.device,
                input_args=s.example_input(),
                output_args=s.example_output(),
                group=group,
                dw_builder=functools.partial(_weight_pass, runtimes),
            )
            for s, runtimes in zip(stages, self.runtimes)
        ]
        cls = schedule_class(self.schedule_name)
        single = issubclass(cls, PipelineScheduleSingle)
        self.schedule = cls(
            torch_stages[0] if single else torch_stages, n_microbatches, loss_fn=self._loss, scale_grads=False
        )
        #: whether the schedule has weight actions, so that the stages' backward passes defer weight gradients
        self.defers_weights = self.schedule_name in ZERO_BUBBLE

    def step(
        self, ids: torch.Tensor | None = None, targets: torch.Tensor | None = None, loss_scale: float = 1.0
    ) -> torch.Tensor:
        """One forward and backward of the batch: ``ids`` ``[batch, seq_len]`` where this rank runs
        the first stage, ``targets`` ``[batch, seq_len]`` where it runs the last (the same on every
        cube rank; elsewhere they may be None). Gradients accumulate into each stage's ``.grad``, as a
        ``backward`` does, times ``loss_scale``.

        A parameter that the first and the last stage share (a tied embedding and head) gets the sum
        of both stages' gradients on each (:mod:`.tied`).

        Returns the batch's mean loss (detached, float64, not scaled) on every rank: one broadcast over
        the ``"pipe"`` group from the rank of the last stage.
        """
        loss = self._run(self.schedule.step, ids, targets, loss_scale)
        for tied in self.stages[0].tied:
            tied.sum_grads()
        return loss

    def evaluate(self, ids: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The batch's mean loss, as :meth:`step` returns it, from the forward passes only (no gradients)."""
        return self._run(self.schedule.eval, ids, targets)

    def _run(
        self, run: Callable, ids: torch.Tensor | None, targets: torch.Tensor | None, loss_scale: float = 1.0
    ) -> torch.Tensor:
        args, kwargs, losses = (), {}, []
        if self.first is not None:
            args = (self._checked(ids, "ids"),)
        if self.last is not None:
            targets = self._checked(targets, "targets")
            total = self._counted(targets)
            kwargs = {
                "target": targets,
                "losses": losses,
                "loss_kwargs": {"total": total, "scale": loss_scale},
            }
        device = self.stages[0].device
        caller = Autocast.of_caller(device.type)
        for stage in self.stages:
            stage.autocast = caller
        try:
            with torch.autocast(device.type, enabled=False), contextlib.ExitStack() as deferring:
                if self.defers_weights:
                    for runtime in {id(r): r for runtimes in self.runtimes for r in runtimes}.values():
                        deferring.enter_context(runtime.late_grads.deferring())
                run(*args, return_outputs=False, **kwargs)
        finally:
            for stage in self.stages:
                stage.autocast = None
        loss = (
            torch.stack(losses).sum().detach().double() / loss_scale
            if losses
            else torch.zeros((), dtype=torch.float64, device=device)
        )
        owner = stage_owner(self.stages[0].num_stages - 1, self.grid.pipeline_size, self.schedule_name)
        if self.grid.pipeline_size > 1:
            dist.broadcast(loss, group=self.grid.group("pipe"), group_src=owner)
        return loss

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, *, total: int, scale: float) -> torch.Tensor:
        """A micro-batch's share of the batch's mean loss, times ``scale``: its own mean times its counted
        targets / ``total``."""
        split, last = self.last.split, self.last
        with last.autocast() if last.autocast is not None else contextlib.nullcontext():
            mean = split.loss(last.module, logits, targets, last.micro_batch)
        return mean * split.counted(targets).sum() * scale / total

    def _checked(self, t: torch.Tensor | None, what: str) -> torch.Tensor:
        if t is None or tuple(t.shape) != tuple(self.batch_shape):
            got = None if t is None else list(t.shape)
            raise ValueError(
                f"pipeline step: {what} must be {list(self.batch_shape)} (the batch build_schedule was given) on a "
                f"rank that runs the {'first' if what == 'ids' else 'last'} stage, got {got}"
            )
        return t

    def _counted(self, targets: torch.Tensor) -> int:
        """The batch's counted targets; ``ValueError`` when a micro-batch has none (its mean would be 0/0)."""
        counts = self.last.split.counted(targets).reshape(self.n_microbatches, -1).sum(1).tolist()
        empty = [k for k, n in enumerate(counts) if n == 0]
        if empty:
            raise ValueError(
                f"pipeline step: micro-batches {empty} of {self.n_microbatches} have every target ignored, so "
                "their mean loss is 0/0; put counted targets in every micro-batch (reorder the batch) or use "
                "fewer micro-batches"
            )
        return sum(counts)


def _layers(stage: Stage) -> list[Module3D]:
    return [m for m in stage.module.modules() if isinstance(m, Module3D)]


def _weight_pass(runtimes: list[Runtime]) -> Callable[[], None]:
    """A stage's weight pass for the backward that ran last (its ``dw_builder``): the weight
    gradients its models deferred (:meth:`~lightning_3d.runtime.WeightGradsAtEnd.deferred_pass`),
    none unless the schedule defers them."""
    passes = [runtime.late_grads.deferred_pass() for runtime in runtimes]

    def run() -> None:
        for deferred in passes:
            deferred()

    return passes[0] if len(passes) == 1 else run


def build_schedule(
    stages: list[Stage], schedule: str, n_microbatches: int, batch_shape: tuple[int, int]
) -> Pipeline:
    """The :class:`Pipeline` running ``stages`` (this rank's, from
    :func:`~lightning_3d.pipeline.stages.split_stages` with the same ``schedule``) under ``schedule``
    with ``n_microbatches`` micro-batches of batches ``batch_shape = (batch, seq_len)``.

    Collective over the grid's ``"pipe"`` group at the first step. ``ValueError`` when the stages are
    not those this rank runs under ``schedule``, or the batch does not cut into equal micro-batches
    that run on the grid.
    """
    if not stages:
        raise ValueError("build_schedule needs this rank's stages (split_stages makes them)")
    name, grid = canonical_name(schedule), stages[0].grid
    indices = [s.index for s in stages]
    expected = stage_indices(grid, name, len(stages) if fixed_stages_per_rank(name) is None else None)
    if indices != expected:
        raise ValueError(
            f"under {name} this rank runs stages {expected}, but got stages {indices}; pass split_stages the "
            "same schedule (and stages_per_rank)"
        )
    batch, seq_len = batch_shape
    if batch % arguments.positive_int(n_microbatches, "n_microbatches"):
        raise ValueError(
            f"a batch of {batch} sequences does not cut into {n_microbatches} equal micro-batches; "
            f"pick n_microbatches among the divisors of {batch}"
        )
    for stage in stages:
        stage.bind(batch // n_microbatches, seq_len)
    return Pipeline(stages, name, n_microbatches, (batch, seq_len))
