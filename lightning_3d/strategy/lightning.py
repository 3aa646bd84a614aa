"""``Tensor3DStrategy`` for ``lightning.pytorch`` (``import lightning as L``); registered as ``"tensor3d"`` on
import."""

from ..versions import require

require("lightning")  # an unsupported version is refused here, before this module uses it

from lightning.fabric.utilities.seed import pl_worker_init_function  # noqa: E402
from lightning.pytorch import __version__  # noqa: E402
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary  # noqa: E402
from lightning.pytorch.plugins import precision as lp  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry  # noqa: E402
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary  # noqa: E402
from lightning.pytorch.utilities.rank_zero import rank_zero_info  # noqa: E402

from . import registration  # noqa: E402
from .base import Tensor3DMixin  # noqa: E402
from .precision import AgreedOverflow, GlobalNormClipping  # noqa: E402
from .summary import GlobalCounts, GlobalSummaryCallback  # noqa: E402


class GridPrecision(GlobalNormClipping, lp.Precision):
    """``Precision`` (32-true) clipping by the global 3-D norm."""


class GridDoublePrecision(GlobalNormClipping, lp.DoublePrecision):
    """``DoublePrecision`` (64-true) clipping by the global 3-D norm."""


class GridHalfPrecision(GlobalNormClipping, lp.HalfPrecision):
    """``HalfPrecision`` (16-true, bf16-true) clipping by the global 3-D norm."""


class GridMixedPrecision(GlobalNormClipping, AgreedOverflow, lp.MixedPrecision):
    """``MixedPrecision`` (16-mixed, bf16-mixed) clipping by the global 3-D norm, fp16 overflow agreed by every rank."""


class GridSummary(GlobalCounts, Summary):
    """The model summary with the full model's parameter counts."""


class GridModelSummary(GlobalSummaryCallback, ModelSummary):
    """The ``ModelSummary`` callback, summarising with :class:`GridSummary`."""

    summary_class = GridSummary


class GridRichModelSummary(GlobalSummaryCallback, RichModelSummary):
    """The ``RichModelSummary`` callback, summarising with :class:`GridSummary`."""

    summary_class = GridSummary


class Tensor3DStrategy(Tensor3DMixin, DDPStrategy):
    __doc__ = Tensor3DMixin.__doc__
    grid_precisions = {
        lp.Precision: GridPrecision,
        lp.DoublePrecision: GridDoublePrecision,
        lp.HalfPrecision: GridHalfPrecision,
        lp.MixedPrecision: GridMixedPrecision,
    }
    summary_callbacks = {ModelSummary: GridModelSummary, RichModelSummary: GridRichModelSummary}
    info = staticmethod(rank_zero_info)
    worker_init_function = staticmethod(pl_worker_init_function)
    lightning_version = __version__


Tensor3DStrategy.register_strategies(StrategyRegistry)
registration.imported(__name__)  # the strategies that subclass this one, waiting for it

__all__ = ["Tensor3DStrategy"]
