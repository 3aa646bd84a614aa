"""Bring your own model: ``parallelize(model, plan)`` puts a ``torch.nn`` model on the 3-D grid in place.

A :class:`Plan` maps module-name patterns to rules (:class:`Linear`, :class:`Norm`,
:class:`VocabEmbedding`, :class:`PositionEmbedding`, :class:`LMHead`, :class:`Loss`,
:class:`Dropout`) and carries the :class:`~lightning_3d.options.RuntimeOptions` the model runs
with, the checkpoint units, the model-level input/output hooks, and the modules that compute its
attention (:class:`Attention`: with them any batch runs, on token rows where whole sequences do
not split). ``parallelize`` gives the model one :class:`~lightning_3d.runtime.Runtime`, which all
its 3-D layers hold (:func:`runtime_of`).
"""

from ..options import RuntimeOptions
from .attention import Attention
from .norms import register_norm
from .parallelize import parallelize
from .plan import Plan, find_plan, register_plan
from .rules import Dropout, Linear, LMHead, Loss, Norm, PositionEmbedding, Rule, VocabEmbedding
from .state import dense_state_dict, grid_of, load_dense_state_dict, options_of, runtime_of, set_options

__all__ = [
    "Attention",
    "Dropout",
    "LMHead",
    "Linear",
    "Loss",
    "Norm",
    "Plan",
    "PositionEmbedding",
    "Rule",
    "RuntimeOptions",
    "VocabEmbedding",
    "dense_state_dict",
    "find_plan",
    "grid_of",
    "load_dense_state_dict",
    "options_of",
    "parallelize",
    "register_norm",
    "register_plan",
    "runtime_of",
    "set_options",
]
