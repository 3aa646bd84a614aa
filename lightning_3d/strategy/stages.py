"""The strategies' pipeline stages (``pipeline_size > 1``): a plain model, split at setup, runs as a
:class:`~lightning_3d.pipeline.PipelinedModel` (:func:`split_model`, shared by the Trainer's and
Fabric's strategies; no Lightning import).

What a LightningModule writes differently: ``configure_model`` builds the plain model (``DenseGPT``,
a Hugging Face model: one with a pipeline split and a plan) in one attribute, ``self.model = ...``;
it runs on ``meta`` (:func:`built_for_stages`), so no rank allocates the whole model. At setup the
strategy puts this rank's stages in its place (:func:`into_stages`), under the same attribute and
parameter names (Fabric: the model object passed to ``fabric.setup`` becomes them,
:func:`split_in_place`). ``training_step`` is unchanged: ``loss = self.model(ids, targets)`` runs the whole
schedule for the batch (its micro-batches are the pipeline's) and returns the batch's mean loss on
every rank, so ``self.log`` logs it as usual; Lightning's ``backward`` of the returned loss hands
the schedule's gradients to the parameters (scaled by ``1 / accumulate_grad_batches``), DDP
averages them over dp, and clipping (by the norm over every stage's cube) and the optimizer step
follow as without stages. ``validation_step`` calls the model the same way: forward passes only.
Under mixed precision the schedule runs each stage's forward under the step's autocast, one
micro-batch at a time, and an fp16 loss scaler's scale reaches the schedule's backward
(:func:`loss_scale_of`). Checkpoints are the strategies' as without stages: each rank saves its
stages' tensors under the whole model's names, so a checkpoint loads at any pipeline size and grid
(:mod:`lightning_3d.checkpoint.stages`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import torch
from torch import nn

from ..grid import Grid
from ..options import RuntimeOptions
from ..pipeline import PipelinedModel, PipelineOptions, find_split


def checked_pipeline(pipeline: PipelineOptions | None, pipeline_size: int) -> PipelineOptions | None:
    """The options the strategy runs its stages with: None with one stage, else ``pipeline`` or the defaults."""
    if pipeline is not None and not isinstance(pipeline, PipelineOptions):
        raise ValueError(
            f"pipeline must be a lightning_3d.pipeline.PipelineOptions or None, got {pipeline!r}: "
            'e.g. pipeline=PipelineOptions(schedule="GPipe", n_microbatches=8)'
        )
    if pipeline_size == 1:
        if pipeline is not None:
            raise ValueError(
                "pipeline=PipelineOptions(...) needs pipeline stages: pass pipeline_size=2 (or more) with it"
            )
        return None
    return pipeline if pipeline is not None else PipelineOptions()


def built_for_stages(pipeline: PipelineOptions | None) -> contextlib.AbstractContextManager:
    """Where ``configure_model`` builds: on ``meta`` with pipeline stages, else where it would."""
    return torch.device("meta") if pipeline is not None else contextlib.nullcontext()


def loss_scale_of(precision) -> Callable[[], float] | None:
    """The scale of ``precision``'s loss scaler (a Lightning precision plugin's ``scaler``, read at each
    call), or None when it has none."""
    if getattr(precision, "scaler", None) is None:
        return None
    return lambda: precision.scaler.get_scale()


def split_model(
    model: nn.Module,
    grid: Grid,
    pipeline: PipelineOptions,
    options: RuntimeOptions | None,
    device: torch.device,
    precision,
    priced_layers: int | None = None,
) -> PipelinedModel:
    """This rank's stages of the plain ``model`` (on ``meta``, or materialised) on ``grid``, run with
    ``pipeline`` and ``options``, their gradients scaled as ``precision``'s loss scaler scales the loss.

    ``priced_layers``: the layers of the model the cost model split (``model_shape.layers``), which
    ``model`` must have.

    Raises:
        ValueError: ``model`` has other than ``priced_layers`` layers; what
            :class:`~lightning_3d.pipeline.PipelinedModel` refuses.
    """
    if priced_layers is not None:
        split = pipeline.split if pipeline.split is not None else find_split(model)
        layers = len(model.get_submodule(split.layers))
        if layers != priced_layers:
            raise ValueError(
                f"model_shape has layers={priced_layers}, but {type(model).__name__} has {layers} ({split.layers}): "
                f"the cost model split another model into stages; pass the model's shape as model_shape, or "
                "PipelineOptions(split_points=...)"
            )
    return PipelinedModel(
        model, grid, pipeline, options=options, device=device, loss_scale=loss_scale_of(precision)
    )


def into_stages(module: nn.Module, grid: Grid, split: Callable[[nn.Module], nn.Module]) -> None:
    """Put this rank's stages of ``module``'s model in its place, ``split(model)`` (nothing when they are
    there already).

    Raises:
        ValueError: ``module`` holding parameters outside one child module; what ``split`` refuses.
    """
    holders = [n for n, m in module.named_children() if any(True for _ in m.parameters())]
    own = [n for n, _ in module.named_parameters(recurse=False)]
    if len(holders) != 1 or own:
        raise ValueError(
            f"with pipeline_size={grid.pipeline_size} the strategy splits the LightningModule's model into stages, "
            f"so configure_model must build it in one attribute (self.model = DenseGPT(config)); "
            f"{type(module).__name__} holds parameters in {holders + own or 'nothing'}"
        )
    name = holders[0]
    model = getattr(module, name)
    if not isinstance(model, PipelinedModel):
        setattr(module, name, split(model))


def drop_unsplit(module: nn.Module) -> None:
    """Drop ``module``'s children that still hold ``meta`` tensors (setup failed before their split):
    Lightning's teardown moves the module to the CPU, which a ``meta`` tensor cannot be."""
    for name, child in list(module.named_children()):
        if any(t.is_meta for t in itertools.chain(child.parameters(), child.buffers())):
            setattr(module, name, None)
