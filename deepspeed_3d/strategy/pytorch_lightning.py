"""``Tensor3DDeepSpeedStrategy`` for ``pytorch_lightning``; registered as ``"tensor3d_deepspeed"`` on import."""

from .factory import define_strategy

Tensor3DDeepSpeedStrategy = define_strategy("pytorch_lightning", __name__)

__all__ = ["Tensor3DDeepSpeedStrategy"]
