"""``Tensor3DDeepSpeedStrategy`` for ``lightning.pytorch``; registered as ``"tensor3d_deepspeed"`` on import."""

from .factory import define_strategy

Tensor3DDeepSpeedStrategy = define_strategy("lightning.pytorch", __name__)

__all__ = ["Tensor3DDeepSpeedStrategy"]
