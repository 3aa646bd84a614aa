"""Pipeline stages of a 3-D model: layer ranges on the grid's pipeline axis, run by ``torch.distributed.pipelining``.

On a grid with ``pipeline_size = pp`` (:func:`~lightning_3d.grid.init_grid`), each rank runs one
stage of the model, or several under looped and V-shaped schedules, parallelized on its stage's
cube::

    grid = init_grid((px, py, pz), pipeline_size=pp)
    stages = split_stages(DenseGPT(config, device="meta"), grid, schedule="1F1B")
    pipeline = build_schedule(stages, "1F1B", n_microbatches=8, batch_shape=(batch, seq_len))
    loss = pipeline.step(ids, targets)  # gradients in each stage's parameters; optimizer.step() per rank

- :mod:`.split`: how a model family's forward splits (:class:`StageSplit`) and the layers of each
  stage (:func:`layer_ranges`: equal counts, or the split points given).
- :mod:`.stages`: :func:`split_stages`, each stage the model with only its own modules, every
  parameter under its name in the whole model.
- :mod:`.kinds`: the schedules by name and which stages a rank runs under each.
- :mod:`.schedule`: :func:`build_schedule` and :meth:`Pipeline.step`, the hand-over of each cube
  rank's own block to its peer in the next stage, the loss as the whole batch's mean.
- :mod:`.pipelined`: :class:`PipelinedModel`, this rank's stages called as the model
  (``loss = model(ids, targets)``, ``loss.backward()``), as ``Tensor3DStrategy(pipeline_size=pp)``
  runs them; :class:`PipelineOptions` (:mod:`.options`), its schedule and split.
- Built-in splits: :class:`DenseGPT` (:mod:`.gpt`); Hugging Face ``LlamaForCausalLM``,
  ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and ``GPT2LMHeadModel`` (:mod:`.hf`), registered by
  class name.
"""

from . import gpt as gpt  # registers DenseGPT's split
from . import hf as hf  # registers the Hugging Face splits by class name (no transformers import)
from .kinds import SCHEDULES, stage_indices
from .options import PipelineOptions
from .pipelined import PipelinedModel
from .schedule import Pipeline, build_schedule
from .split import MicroBatch, StageSplit, find_split, layer_ranges, register_split
from .stages import Stage, StageLayers, split_stages

__all__ = [
    "SCHEDULES",
    "MicroBatch",
    "Pipeline",
    "PipelineOptions",
    "PipelinedModel",
    "Stage",
    "StageLayers",
    "StageSplit",
    "build_schedule",
    "find_split",
    "layer_ranges",
    "register_split",
    "split_stages",
    "stage_indices",
]
