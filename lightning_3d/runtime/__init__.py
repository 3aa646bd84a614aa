"""The run-time state of a model's 3-D layers, owned by the model and passed to each product.

A :class:`Runtime` (one per parallelized model, held by each of its 3-D layers) carries the
model's :class:`~lightning_3d.options.RuntimeOptions` and the scheduling around its products: the
weight prefetch (:mod:`.prefetch`), the weight gradients left for the end of backward
(:mod:`.late_grads`) and the token-range checks read at the end of each forward
(:mod:`.token_checks`). Each product fixes how it runs in a :class:`MatmulSchedule`
(:mod:`.schedule`). Nothing here is module state: every object belongs to one model.
"""

from .late_grads import WeightGradsAtEnd
from .prefetch import WeightPrefetch
from .runtime import Runtime, runtime_named
from .schedule import MatmulSchedule
from .token_checks import DeferredTokenChecks, check_token_range

__all__ = [
    "DeferredTokenChecks",
    "MatmulSchedule",
    "Runtime",
    "WeightGradsAtEnd",
    "WeightPrefetch",
    "check_token_range",
    "runtime_named",
]
