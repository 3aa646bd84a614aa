"""3-D tensor parallelism for PyTorch (Bian, Xu, Wang, You 2021) on any px×py×pz grid.

The core (grid, ops, layers) imports torch only; ``lightning_3d.strategy`` brings Lightning in.
"""

from . import litgpt as litgpt  # registers LitGPT's plan by class name (no litgpt import)
from .grid import Grid, destroy_grid, get_grid, init_grid, set_grid
from .hf import (
    save_pretrained,
)  # also registers the Hugging Face plans by class name (no transformers import)
from .layers import (
    CrossEntropyLoss3D,
    Dropout3D,
    LayerNorm3D,
    Linear3D,
    Module3D,
    RMSNorm3D,
    VocabParallelEmbedding3D,
)
from .layout import Layout, gather_activation, split_activation
from .ops import WeightPrefetch, matmul_ab, matmul_abt, matmul_atb, vocab_parallel_cross_entropy
from .options import RuntimeOptions
from .parallel import Plan, dense_state_dict, load_dense_state_dict, parallelize
from .sharding import ShardSpec, get_spec

__all__ = [
    "CrossEntropyLoss3D",
    "Dropout3D",
    "Grid",
    "LayerNorm3D",
    "Layout",
    "Linear3D",
    "Module3D",
    "Plan",
    "RMSNorm3D",
    "RuntimeOptions",
    "ShardSpec",
    "VocabParallelEmbedding3D",
    "WeightPrefetch",
    "dense_state_dict",
    "destroy_grid",
    "gather_activation",
    "get_grid",
    "get_spec",
    "init_grid",
    "load_dense_state_dict",
    "matmul_ab",
    "matmul_abt",
    "matmul_atb",
    "parallelize",
    "save_pretrained",
    "set_grid",
    "split_activation",
    "vocab_parallel_cross_entropy",
]

# Lightning integration: "tensor3d" joins Lightning's strategy registries as soon as Lightning is
# imported (at once if it already is); Lightning itself is never imported here.
from .strategy import register_on_import as _register_on_import  # noqa: E402

_register_on_import()


def __getattr__(name: str):
    """``Tensor3DStrategy`` (the Trainer's) and ``Tensor3DFabricStrategy`` (Fabric's) on first use (they
    import Lightning)."""
    if name in ("Tensor3DStrategy", "Tensor3DFabricStrategy"):
        from . import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
