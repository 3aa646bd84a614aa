"""The 3-D layers a Transformer is made of."""

from .base import Module3D, dense_state_dict, load_dense_state_dict
from .dropout import Dropout3D
from .embedding import VocabParallelEmbedding3D
from .linear import Linear3D
from .loss import CrossEntropyLoss3D
from .norm import LayerNorm3D, RMSNorm3D

__all__ = ["CrossEntropyLoss3D", "Dropout3D", "LayerNorm3D", "Linear3D", "Module3D", "RMSNorm3D", "VocabParallelEmbedding3D", "dense_state_dict", "load_dense_state_dict"]
