"""``Tensor3DStrategy`` for ``lightning.pytorch`` (``import lightning as L``); registered as ``"tensor3d"`` on import."""

from .factory import define_strategy

Tensor3DStrategy = define_strategy("lightning.pytorch", __name__)

__all__ = ["Tensor3DStrategy"]
