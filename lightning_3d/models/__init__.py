"""Language models on the 3-D layers and their dense twins."""

from .config import GPTConfig
from .dense import DenseGPT
from .fused_linear import FusedLinear3D
from .gpt3d import GPT3D
from .hf import dense_state_dict_from_hf, gpt3d_from_hf, gpt_config_from_hf
from .position import PositionEmbedding3D

__all__ = ["DenseGPT", "FusedLinear3D", "GPT3D", "GPTConfig", "PositionEmbedding3D", "dense_state_dict_from_hf", "gpt3d_from_hf", "gpt_config_from_hf"]
