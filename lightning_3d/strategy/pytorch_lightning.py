"""``Tensor3DStrategy`` for ``pytorch_lightning``; registered as ``"tensor3d"`` on import."""

from .factory import define_strategy

Tensor3DStrategy = define_strategy("pytorch_lightning", __name__)

__all__ = ["Tensor3DStrategy"]
