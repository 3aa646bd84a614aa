"""The GPT language model (:class:`DenseGPT`), its plan and :class:`GPT3D`, the import of Hugging Face GPT-2
weights into it, and its rebuild from a ``to-dense`` file."""

from ..layers import FusedLinear3D, PositionEmbedding3D
from .config import GPTConfig
from .dense import DenseGPT
from .dense_file import dense_gpt
from .gpt2_import import dense_state_dict_from_hf, gpt3d_from_hf, gpt_config_from_hf
from .gpt3d import GPT3D, gpt_plan

__all__ = [
    "DenseGPT",
    "FusedLinear3D",
    "GPT3D",
    "GPTConfig",
    "PositionEmbedding3D",
    "dense_gpt",
    "dense_state_dict_from_hf",
    "gpt3d_from_hf",
    "gpt_config_from_hf",
    "gpt_plan",
]
