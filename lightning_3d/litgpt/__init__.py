"""LitGPT's ``litgpt.model.GPT`` on the grid: its built-in plan, registered by class name, and its loss.

``lightning_3d.parallelize(model)`` (and the ``"tensor3d"`` strategies) find the plan of a
``litgpt.model.GPT`` by its qualified class name (:mod:`.plan`); the parallelized model returns
y-layout logits, whose loss :func:`cross_entropy` computes. ``lightning_3d.dense_state_dict(model)``
is LitGPT's own state dict. ``litgpt`` is imported only when such a model is parallelized.
"""

from .loss import cross_entropy
from .plan import register_builtin_plan

register_builtin_plan()

__all__ = ["cross_entropy"]
