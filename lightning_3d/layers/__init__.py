"""The 3-D layers a Transformer is made of."""

from .base import Module3D
from .dropout import Dropout3D
from .embedding import VocabParallelEmbedding3D
from .fused_linear import FusedLinear3D
from .linear import Linear3D
from .loss import CrossEntropyLoss3D
from .norm import LayerNorm3D, RMSNorm3D
from .position import PositionEmbedding3D
from .vocab import LMHead3D, PaddedEmbedding3D, padded_vocab_size

__all__ = [
    "CrossEntropyLoss3D",
    "Dropout3D",
    "FusedLinear3D",
    "LMHead3D",
    "LayerNorm3D",
    "Linear3D",
    "Module3D",
    "PaddedEmbedding3D",
    "PositionEmbedding3D",
    "RMSNorm3D",
    "VocabParallelEmbedding3D",
    "padded_vocab_size",
]
