"""Hugging Face ``transformers`` models on the grid: built-in plans, their call interface, ``save_pretrained``.

``lightning_3d.parallelize(model)`` finds the plan of a ``GPT2LMHeadModel``, ``LlamaForCausalLM``,
``MistralForCausalLM`` or ``Qwen2ForCausalLM`` by its class name (:mod:`.plans`); the parallelized
model keeps its call interface (:mod:`.interface`); :func:`from_pretrained` reads a folder onto the
grid one tensor at a time (:mod:`.load`); :func:`save_pretrained` writes the model back as a folder
``transformers``' ``from_pretrained`` loads. ``transformers`` is imported only when such a model runs or is saved.
"""

from .export import checkpoint_to_pretrained, save_pretrained
from .load import from_pretrained
from .plans import register_builtin_plans

register_builtin_plans()

__all__ = ["checkpoint_to_pretrained", "from_pretrained", "save_pretrained"]
