"""The 3-D parallel operations as autograd functions."""

from ..runtime import WeightPrefetch
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import vocab_parallel_embedding
from .matmul import matmul_ab, matmul_abt, matmul_atb
from .norm import normalize
from .replicated import use_replicated

__all__ = [
    "WeightPrefetch",
    "matmul_ab",
    "matmul_abt",
    "matmul_atb",
    "normalize",
    "use_replicated",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]
