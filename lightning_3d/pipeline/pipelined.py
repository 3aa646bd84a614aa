"""A model's pipeline stages on this rank, called as the model: :class:`PipelinedModel`.

``loss = pipelined(ids, targets)`` runs a whole schedule step for the batch (every micro-batch's
forward and backward) and returns the batch's mean loss, the same on every rank. The step's
gradients wait in the loss: ``loss.backward()`` hands them to the parameters, times the gradient
that reaches the loss (``loss / k``, a loss scale), through autograd, so that whatever runs
between the call and the backward (``optimizer.zero_grad()``, as Lightning's automatic optimization
runs it) leaves them alone, accumulation adds them up, and DDP's hooks reduce them over dp as a
plain model's. Under ``torch.no_grad``/``inference_mode`` the call runs the forward passes only
(:meth:`Pipeline.evaluate`). Called under autocast (mixed precision), the schedule runs each stage's
forward under it, one micro-batch at a time, and the backward passes outside it; with an fp16 loss
scaler, ``loss_scale`` gives the factor its ``scale(loss)`` will multiply the loss by, and the
schedule's backward starts from the loss so scaled (fp16 gradients keep their small values).

The stages' modules are this module's children, merged into one tree: every parameter keeps its
name in the whole model (``transformer.h.5.attn.c_attn.weight``), on whichever stage of this rank
holds it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..grid import Grid, resolve_grid
from ..options import RuntimeOptions
from .options import PipelineOptions
from .schedule import Pipeline, build_schedule
from .stages import Stage, split_stages


class PipelinedModel(nn.Module):
    """The stages of ``model`` this rank runs on ``grid``, called as ``model(ids, targets) -> loss``.

    ``model`` is consumed (:func:`~lightning_3d.pipeline.stages.split_stages`): a plain model,
    built on ``meta`` so that each rank materialises its own stages only. Collective over the
    grid's cube when made, over the pipe group at each call. ``loss_scale``: the factor the caller's
    backward scales the loss by (an fp16 loss scaler's ``get_scale``, read at each call), or None.
    """

    def __init__(
        self,
        model: nn.Module,
        grid: Grid | None = None,
        pipeline: PipelineOptions | None = None,
        *,
        options: RuntimeOptions | None = None,
        device: torch.device | str | None = None,
        loss_scale: Callable[[], float] | None = None,
    ):
        super().__init__()
        self.grid = resolve_grid(grid)
        self.loss_scale = loss_scale
        self.pipeline = pipeline if pipeline is not None else PipelineOptions()
        #: the whole model's parameters (all stages'), and its trainable ones
        self.whole_parameters = sum(p.numel() for p in model.parameters())
        self.whole_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        #: the whole model's class name and config: a checkpoint's dense root records them
        #: (:func:`~lightning_3d.checkpoint.dense_root`), as the unsplit model's own
        self.whole_model_class = type(model).__name__
        self.config = getattr(model, "config", None)
        self.stages: list[Stage] = split_stages(
            model,
            self.grid,
            schedule=self.pipeline.schedule,
            stages_per_rank=self.pipeline.stages_per_rank,
            split_points=self.pipeline.split_points,
            split=self.pipeline.split,
            plan=self.pipeline.plan,
            options=options,
            device=device,
        )
        for name, child in _merged([s.module for s in self.stages]).named_children():
            self.add_module(name, child)
        self._schedule: Pipeline | None = None

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss (float64, the same on every rank); with gradients enabled, one schedule
        step whose gradients ``backward`` of the loss hands on. ``ids``, ``targets``: ``[batch, seq_len]``,
        the same on every rank of a replica."""
        schedule = self._schedule_for(tuple(ids.shape))
        if not torch.is_grad_enabled():
            return schedule.evaluate(ids, targets)
        params = [p for p in self.parameters() if p.requires_grad]
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        scale = float(self.loss_scale()) if self.loss_scale is not None else 1.0
        loss = schedule.step(ids, targets, scale)
        grads = [p.grad for p in params]
        for p, grad in zip(params, held):
            p.grad = grad
        return _StepGradients.apply(loss, grads, scale, *params)

    def _schedule_for(self, batch_shape: tuple[int, int]) -> Pipeline:
        """The schedule for batches of ``batch_shape``, built anew when the shape changes (it binds the stages)."""
        if self._schedule is None or self._schedule.batch_shape != batch_shape:
            self._schedule = build_schedule(
                self.stages,
                self.pipeline.schedule,
                self.pipeline.microbatches(self.grid.pipeline_size),
                batch_shape,
            )
        return self._schedule


class _StepGradients(torch.autograd.Function):
    """The loss of a schedule step, whose backward hands the step's gradients (computed times ``scale``)
    to the parameters, times the gradient reaching the loss."""

    @staticmethod
    def forward(
        ctx, loss: torch.Tensor, grads: list[torch.Tensor | None], scale: float, *params: torch.Tensor
    ):
        ctx.grads, ctx.scale = grads, scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("a pipelined model's loss hands its gradients on once: backward ran twice")
        factor = grad_loss / ctx.scale
        return None, None, None, *(None if g is None else g.mul_(factor) for g in grads)


def _merged(modules: list[nn.Module]) -> nn.Module:
    """One module tree holding every module of ``modules`` under its own name (the stages of one
    rank share only containers, which hold no tensors of their own)."""
    if len({id(m) for m in modules}) == 1:
        return modules[0]
    own = [
        n for m in modules for n, _ in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))
    ]
    if own:
        raise ValueError(
            f"{type(modules[0]).__name__} is in several stages of this rank and holds tensors {own} itself: "
            "keep tensors in modules that one stage holds (layers, the embeddings, the head)"
        )
    merged = nn.Module()
    names = dict.fromkeys(n for m in modules for n, c in m.named_children() if c is not None)
    for name in names:
        children = [m._modules[name] for m in modules if m._modules.get(name) is not None]
        merged.add_module(name, _merged(children))
    return merged
