"""``Tensor3DDeepSpeedStrategy`` for ``lightning.pytorch``; registered as ``"tensor3d_deepspeed"`` on import."""

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.strategies.deepspeed import remove_module_hooks

from lightning_3d.strategy.lightning import Tensor3DStrategy

from .base import Tensor3DDeepSpeedMixin


class Tensor3DDeepSpeedStrategy(Tensor3DDeepSpeedMixin, DeepSpeedStrategy):
    __doc__ = Tensor3DDeepSpeedMixin.__doc__
    deepspeed_strategy = DeepSpeedStrategy
    reset_seed = staticmethod(reset_seed)
    remove_module_hooks = staticmethod(remove_module_hooks)
    summary_callbacks = Tensor3DStrategy.summary_callbacks


Tensor3DDeepSpeedStrategy.register_strategies(StrategyRegistry)

__all__ = ["Tensor3DDeepSpeedStrategy"]
