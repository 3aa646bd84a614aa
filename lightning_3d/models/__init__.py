"""The GPT language model (:class:`DenseGPT`), its plan and :class:`GPT3D`, and the Hugging Face GPT-2 import."""

from ..layers import FusedLinear3D, PositionEmbedding3D
from .config import GPTConfig
from .dense import DenseGPT
from .gpt3d import GPT3D, gpt_plan
from .gpt2_import import dense_state_dict_from_hf, gpt3d_from_hf, gpt_config_from_hf

__all__ = ["DenseGPT", "FusedLinear3D", "GPT3D", "GPTConfig", "PositionEmbedding3D", "dense_state_dict_from_hf", "gpt3d_from_hf",
           "gpt_config_from_hf", "gpt_plan"]
