"""``Tensor3DFabricStrategy`` for ``lightning_fabric``; registered as ``"tensor3d"`` on import."""

from lightning_fabric.plugins import precision as fp
from lightning_fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning_fabric.utilities.rank_zero import rank_zero_info
from lightning_fabric.utilities.seed import pl_worker_init_function

from .fabric_base import Tensor3DFabricMixin


class Tensor3DFabricStrategy(Tensor3DFabricMixin, DDPStrategy):
    __doc__ = Tensor3DFabricMixin.__doc__
    supported_precisions = (fp.Precision, fp.DoublePrecision, fp.HalfPrecision, fp.MixedPrecision)
    info = staticmethod(rank_zero_info)
    worker_init_function = staticmethod(pl_worker_init_function)


Tensor3DFabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["Tensor3DFabricStrategy"]
