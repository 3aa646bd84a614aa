"""DeepSpeed with 3-D tensor parallelism inside each model replica and ZeRO across replicas.

- :class:`GridMPU`: the grid as DeepSpeed's model-parallel unit (model parallel = the cube,
  data parallel = dp).
- :func:`initialize`: ``deepspeed.initialize`` reading ``"tensor3d": {"grid": [px, py, pz]}``.
- :func:`init_grid_from_config`: the grid of a config, to build the model on before ``initialize``.
- :func:`tag_grad_norm_params`: the parameter tags that make DeepSpeed's gradient norm exact.
- :func:`save_checkpoint` / :func:`load_checkpoint`: the engine's, with the model's sharding record saved and checked.
- :func:`to_dense` / ``python -m deepspeed_3d.checkpoint to-dense``: a checkpoint's dense state dict.
- ``"tensor3d_deepspeed"``: the Lightning strategy (:mod:`deepspeed_3d.strategy`), registered
  when Lightning is imported; ``Tensor3DDeepSpeedStrategy`` is the class of ``lightning.pytorch``
  when installed, else of ``pytorch_lightning``.

This is the only package of the project that imports DeepSpeed.
"""

from lightning_3d.versions import require

require("deepspeed")  # an unsupported version is refused here, before this package uses it

from .checkpoint import to_dense  # noqa: E402
from .config import check_batch_size, init_grid_from_config, load_config  # noqa: E402
from .engine import initialize, load_checkpoint, save_checkpoint  # noqa: E402
from .grad_norm_tags import tag_grad_norm_params  # noqa: E402
from .mpu import GridMPU  # noqa: E402
from .strategy import register_on_import as _register_on_import  # noqa: E402

_register_on_import()


def __getattr__(name: str):
    """``Tensor3DDeepSpeedStrategy`` on first use (it imports Lightning)."""
    if name == "Tensor3DDeepSpeedStrategy":
        from .strategy import strategy_class

        return strategy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GridMPU",
    "Tensor3DDeepSpeedStrategy",
    "check_batch_size",
    "init_grid_from_config",
    "initialize",
    "load_checkpoint",
    "load_config",
    "save_checkpoint",
    "tag_grad_norm_params",
    "to_dense",
]
