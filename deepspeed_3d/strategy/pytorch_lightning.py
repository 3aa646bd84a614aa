"""``Tensor3DDeepSpeedStrategy`` for ``pytorch_lightning``; registered as ``"tensor3d_deepspeed"`` on import."""

from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.strategies import DeepSpeedStrategy, StrategyRegistry
from pytorch_lightning.strategies.deepspeed import remove_module_hooks

from lightning_3d.strategy.pytorch_lightning import Tensor3DStrategy

from .base import Tensor3DDeepSpeedMixin


class Tensor3DDeepSpeedStrategy(Tensor3DDeepSpeedMixin, DeepSpeedStrategy):
    __doc__ = Tensor3DDeepSpeedMixin.__doc__
    deepspeed_strategy = DeepSpeedStrategy
    reset_seed = staticmethod(reset_seed)
    remove_module_hooks = staticmethod(remove_module_hooks)
    summary_callbacks = Tensor3DStrategy.summary_callbacks


Tensor3DDeepSpeedStrategy.register_strategies(StrategyRegistry)

__all__ = ["Tensor3DDeepSpeedStrategy"]
