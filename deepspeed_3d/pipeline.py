"""DeepSpeed's pipeline engine over the grid's stages: :class:`StagePipelineModule`.

With ``"tensor3d": {"pipeline_size": pp}`` (pp > 1), :func:`deepspeed_3d.initialize` splits the plain
model into ``pp`` stages with :func:`lightning_3d.pipeline.split_stages` (each stage the whole model's
class holding its own layers, parallelized on its stage's cube; on ``meta``, only this rank's stage is
materialised) and wraps this rank's stage in a DeepSpeed ``PipelineModule``: its one layer is the
stage, whose forward runs the model's own pieces (embeddings on the first stage, the head on the last),
and its ``loss_fn`` is the model's loss (:meth:`StageSplit.loss`). DeepSpeed's ``PipelineEngine`` then
runs ``train_batch`` / ``eval_batch``.

Topology: ``PipeModelDataParallelTopology(pp, px·py·pz, dp)``, DeepSpeed's order of the grid's ranks
(stage, then dp, then the cube). DeepSpeed hands activations between the ranks of neighbouring stages
that share their data and model coordinates: each cube rank sends its own z-layout block
``[rows/(px·py), row_len, h/pz]`` to the rank of the same cube coordinates in the next stage, as
:mod:`lightning_3d.pipeline.schedule` does. DeepSpeed's partitioning of those activations over its
model group (``"pipe_partitioned"``, ``"grad_partitioned"``) assumes a tensor that every model rank
holds whole, so it is turned off.

Every parameter keeps its name in the whole model (``transformer.h.3.attn.c_attn.weight``): the
stage's modules are this module's children, not a child named by the layer's index.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from lightning_3d import arguments
from lightning_3d.grid import Grid
from lightning_3d.parallel import set_options
from lightning_3d.pipeline import Stage, split_stages
from lightning_3d.sharding import get_spec

from .config import SECTION

PIPELINE = "pipeline"
#: DeepSpeed's ``"pipeline"`` keys that 3-D stages take with one value only: the value, and why
_FIXED = {
    "pipe_partitioned": (
        False,
        "each cube rank hands on its own block of the activation, which DeepSpeed's partitioning over "
        "the model group would take for a replicated one",
    ),
    "grad_partitioned": (
        False,
        "each cube rank hands back its own block of the activation's gradient, which DeepSpeed's "
        "partitioning over the model group would take for a replicated one",
    ),
    "activation_checkpoint_interval": (
        0,
        "a stage is DeepSpeed's one layer; recompute its blocks with "
        f'"{SECTION}": {{"options": {{"activation_checkpointing": true}}}}',
    ),
}


def take_pipeline_section(config: dict[str, Any], grid: Grid) -> tuple[int, ...] | None:
    """Check the config's ``"pipeline"`` section against the grid, set what the 3-D stages need in it,
    and take out the key that is this package's, ``"split_points"`` (returned; None when absent).

    DeepSpeed's own keys: ``"stages"`` is ``"auto"`` or the grid's pipeline size; ``"partition"`` is
    ``"best"`` or ``"uniform"`` (equal layer counts; ``"split_points"`` moves layers);
    ``"pipe_partitioned"`` and ``"grad_partitioned"`` are false (set so when absent), and
    ``"activation_checkpoint_interval"`` 0 (``"tensor3d": {"options": {"activation_checkpointing": true}}``
    recomputes blocks instead). Anything else raises ``ValueError`` naming the key and the fix.
    """
    section = config.setdefault(PIPELINE, {})
    if not isinstance(section, dict):
        raise ValueError(f'the "{PIPELINE}" section must be a dict, got {section!r}')
    pp = grid.pipeline_size
    if section.get("stages", "auto") not in ("auto", pp):
        raise ValueError(
            f'"{PIPELINE}": {{"stages": {section["stages"]!r}}} but "{SECTION}": {{"pipeline_size": {pp}}}; '
            f'the stages are the grid\'s: set "stages": {pp} or "auto", or leave it out'
        )
    if section.get("partition", "best") not in ("best", "uniform"):
        raise ValueError(
            f'"{PIPELINE}": {{"partition": {section["partition"]!r}}}: the stages hold equal layer counts '
            f'("uniform"); to place them otherwise give "split_points": [first layer of stage 1, ...]'
        )
    for key, (value, why) in _FIXED.items():
        if section.setdefault(key, value) != value:
            raise ValueError(f'"{PIPELINE}": {{"{key}": {section[key]!r}}}: {why}; set it to {value!r}')
    points = section.pop("split_points", None)
    if points is None:
        return None
    if not isinstance(points, (list, tuple)):
        raise ValueError(
            f'"{PIPELINE}": {{"split_points": ...}} must be a list of layer indices, got {points!r}'
        )
    return tuple(arguments.positive_int(p, "a split point") for p in points)


class StagePipelineModule(PipelineModule):
    """DeepSpeed's ``PipelineModule`` running ``stage``, this rank's stage of a model on ``grid``.

    Its one layer (``forward_funcs``) is the stage's module, called on what the stage receives (token
    ids ``[batch, seq_len]`` on the first stage, this rank's z-layout hidden block elsewhere), and saved
    in DeepSpeed's layer checkpoints under the whole model's names; its ``loss_fn`` is the model's mean
    loss over a micro-batch's counted targets, the same on every cube rank. Between the stages each
    rank sees micro-batches of ``micro_batch_size`` sequences (:meth:`bind_micro_batches`, which
    :func:`deepspeed_3d.initialize` calls with the engine's). ``grid`` is the 3-D grid; ``mpu()`` is
    DeepSpeed's own ``PipelineParallelGrid`` of the same topology.
    """

    def __init__(self, stage: Stage, grid: Grid):
        topology = PipeModelDataParallelTopology(grid.pipeline_size, grid.cube_size, grid.data_parallel_size)
        places = [_OtherStage(s) for s in range(grid.pipeline_size)]
        super().__init__(places, topology=topology, loss_fn=self._loss, partition_method="uniform")
        self.grid, self.stage, self.micro_batch_size = grid, stage, None
        #: the whole model's class name and config, which a checkpoint's dense root records
        #: (:func:`~lightning_3d.checkpoint.dense_root`), as the unsplit model's own
        self.whole_model_class, self.config = (
            type(stage.module).__name__,
            getattr(stage.module, "config", None),
        )
        for name, child in stage.module.named_children():
            self.add_module(name, child)
        stage.module.register_forward_pre_hook(lambda module, args: self._bind(args[0]))
        self.forward_funcs = [stage.module]  # DeepSpeed's one layer: called, saved and loaded as the stage
        for p in self.parameters():  # a stage's copy of another stage's parameter (a tied head) counts there
            p.ds_pipe_replicated = getattr(get_spec(p), "copy_of", None) is not None

    def get_tied_weights_and_groups(self) -> list:
        """DeepSpeed's pipeline engine calls this once a step, after the backward passes and before it
        reduces the gradients over dp: here the gradients of a parameter that the first and the last
        stage share (a tied embedding and head, :mod:`lightning_3d.pipeline.tied`) are summed over the
        two stages, wherever DeepSpeed accumulates them (:func:`_accumulated_grad`), and nothing is
        returned for the engine to sum again (it would read ``.grad``, which ZeRO leaves empty when it
        accumulates in another dtype)."""
        for tied in self.stage.tied:
            (param,) = tied.held
            grad = _accumulated_grad(param)
            if grad is not None:
                dist.all_reduce(grad, group=tied.group)
        return []

    def bind_micro_batches(self, micro_batch_size: int) -> None:
        """Run micro-batches of ``micro_batch_size`` sequences (the engine's ``train_micro_batch_size_per_gpu``)."""
        self.micro_batch_size = arguments.positive_int(micro_batch_size, "micro_batch_size")

    def train(self, mode: bool = True) -> StagePipelineModule:
        super().train(mode)
        self.stage.module.training = mode  # the stage's root, whose children are this module's
        return self

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's ``loss_fn`` on the last stage: the model's loss of the micro-batch, from this rank's
        y-layout logits and the micro-batch's targets ``[batch, seq_len]``."""
        stage = self.stage
        return stage.split.loss(stage.module, logits, targets, stage.micro_batch)

    def _bind(self, x: torch.Tensor) -> None:
        """Bind the stage to the micro-batch whose input on this rank is ``x``: the ids' shape on the
        first stage; elsewhere the z-layout block ``[rows/(px·py), row_len, h/pz]`` of ``batch`` sequences
        of ``row_len · rows / batch`` tokens (whole sequences: ``rows = batch``; token rows cut each
        sequence into ``rows / batch``)."""
        stage, grid = self.stage, self.grid
        if stage.is_first:
            if x.dim() != 2:
                raise ValueError(
                    f"the first pipeline stage takes token ids [batch, seq_len], got a tensor of shape {list(x.shape)}"
                )
            batch, seq_len = x.shape
        else:
            if self.micro_batch_size is None:
                raise RuntimeError(
                    "bind_micro_batches(micro_batch_size) first (deepspeed_3d.initialize does)"
                )
            px, py, _ = grid.shape
            batch, rows = self.micro_batch_size, x.shape[0] * px * py
            seq_len = x.shape[1] * rows // batch
        bound = stage.micro_batch
        if bound is not None and (bound.batch, bound.seq_len) == (batch, seq_len):
            return
        stage.bind(batch, seq_len)
        expected = stage.example_input().shape
        if tuple(expected) != tuple(x.shape):
            raise ValueError(
                f"pipeline stage {stage.index} received a block of shape {list(x.shape)}, but micro-batches of "
                f"{batch} sequences of {seq_len} tokens hand it {list(expected)}; feed every stage micro-batches "
                f"of train_micro_batch_size_per_gpu = {batch} sequences"
            )


def _accumulated_grad(param: nn.Parameter) -> torch.Tensor | None:
    """Where DeepSpeed holds ``param``'s gradient between the backward passes and their reduction: ZeRO's
    accumulator in its own dtype (``grad_accum``), ``.grad``, or the bf16 optimizer's fp32 ``_hp_grad``.
    Private to DeepSpeed: its engine reads the same attributes."""
    for attr in ("grad_accum", "grad", "_hp_grad"):
        grad = getattr(param, attr, None)
        if isinstance(grad, torch.Tensor):
            return grad
    return None


class _OtherStage:
    """Stage ``index`` as this rank's ``PipelineModule`` lists it: held by other ranks."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"pipeline stage {self.index}"


def pipeline_module(
    model: nn.Module,
    grid: Grid,
    *,
    split_points: Sequence[int] | None = None,
    options: dict[str, Any] | None = None,
) -> StagePipelineModule:
    """This rank's stage of the plain ``model`` (consumed), parallelized on ``grid`` with ``options``
    (``RuntimeOptions`` fields) and wrapped for DeepSpeed's pipeline engine.

    Collective over the grid's cube. Raises ``ValueError`` for what ``split_stages`` refuses (a model
    already holding 3-D layers, more stages than layers, bad split points).
    """
    deepspeed.init_distributed()  # DeepSpeed's comm, over the process group that exists
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        raise ValueError(
            "LOCAL_RANK is not set: DeepSpeed's PipelineModule places its layers by it; launch with "
            "deepspeed or torchrun, or set LOCAL_RANK"
        )
    device = get_accelerator().device_name(int(local_rank))
    (stage,) = split_stages(model, grid, schedule="1F1B", split_points=split_points, device=device)
    if options:
        set_options(stage.module, **options)
    return StagePipelineModule(stage, grid)
