"""``Tensor3DFabricStrategy`` for ``lightning.fabric`` (``import lightning as L``); registered as
``"tensor3d"`` on import."""

from ..versions import require

require("lightning")  # an unsupported version is refused here, before this module uses it

from lightning.fabric.plugins import precision as fp  # noqa: E402
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy  # noqa: E402
from lightning.fabric.utilities.rank_zero import rank_zero_info  # noqa: E402
from lightning.fabric.utilities.seed import pl_worker_init_function  # noqa: E402

from .fabric_base import Tensor3DFabricMixin  # noqa: E402


class Tensor3DFabricStrategy(Tensor3DFabricMixin, DDPStrategy):
    __doc__ = Tensor3DFabricMixin.__doc__
    supported_precisions = (fp.Precision, fp.DoublePrecision, fp.HalfPrecision, fp.MixedPrecision)
    info = staticmethod(rank_zero_info)
    worker_init_function = staticmethod(pl_worker_init_function)


Tensor3DFabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["Tensor3DFabricStrategy"]
