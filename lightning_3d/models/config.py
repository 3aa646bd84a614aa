"""GPTConfig: the hyper-parameters shared by :class:`GPT3D` and its dense twin :class:`DenseGPT`."""

from __future__ import annotations

import math
from dataclasses import dataclass

STYLES = ("gpt2", "llama")


@dataclass
class GPTConfig:
    """A decoder-only Transformer.

    ``style="gpt2"``: learned positions, LayerNorm, 4h tanh-GELU MLP (GPT-2's ``gelu_new``).
    ``style="llama"``: RoPE, RMSNorm, SwiGLU MLP with fused gate/up weights.
    Either style may use grouped-query attention (``n_kv_head < n_head``).

    Args:
        vocab_size: real vocabulary size (the dense model's; :class:`GPT3D` pads it, see
            :meth:`padded_vocab_size`).
        block_size: longest sequence.
        n_layer, n_head, n_embd: depth, attention heads, width.
        n_kv_head: key/value heads (grouped-query attention); ``None`` takes ``n_head``. Query
            head ``i`` attends with key/value head ``i // (n_head / n_kv_head)``, as in Llama.
        dropout: after the embeddings and on each residual branch (0 disables it).
        bias: biases in linear layers and LayerNorm; ``None`` picks the style's default
            (True for gpt2, False for llama).
        tie_embeddings: the LM head reuses the token embedding weight.
        ffn_hidden: MLP width; ``None`` picks ``4·n_embd`` (gpt2) or ``8·n_embd/3`` rounded up to
            a multiple of 64 (llama).
        norm_eps: epsilon of LayerNorm / RMSNorm.
        rope_theta: RoPE base (llama).
        vocab_multiple: :class:`GPT3D` pads the vocabulary to a multiple of
            ``lcm(vocab_multiple, px·py)``; keep it a multiple of every grid's ``px·py`` so the
            padded size, hence a sharded checkpoint, is the same on every grid.
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: int | None = None
    dropout: float = 0.0
    bias: bool | None = None
    tie_embeddings: bool = True
    style: str = "gpt2"
    ffn_hidden: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    vocab_multiple: int = 64

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"GPTConfig.style must be one of {STYLES}, got {self.style!r}")
        if self.bias is None:
            self.bias = self.style == "gpt2"
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.ffn_hidden is None:
            self.ffn_hidden = (
                4 * self.n_embd if self.style == "gpt2" else 64 * math.ceil(8 * self.n_embd / 3 / 64)
            )
        for name in (
            "vocab_size",
            "block_size",
            "n_layer",
            "n_head",
            "n_kv_head",
            "n_embd",
            "ffn_hidden",
            "vocab_multiple",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd {self.n_embd} is not divisible by n_head {self.n_head} "
                f"({self.n_embd} % {self.n_head} = {self.n_embd % self.n_head}); pick n_embd a multiple of n_head"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"GPTConfig: n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}: every key/value head "
                f"serves the same number of query heads; pick n_kv_head among the divisors of {self.n_head}"
            )
        if self.style == "llama" and self.head_dim % 2:
            raise ValueError(
                f"GPTConfig: RoPE needs an even head dim, got n_embd/n_head = {self.head_dim}; change n_embd or n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def queries_per_kv(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.n_head // self.n_kv_head

    def padded_vocab_size(self, multiple: int = 1) -> int:
        """``vocab_size`` rounded up to a multiple of ``lcm(vocab_multiple, multiple)``."""
        m = math.lcm(self.vocab_multiple, multiple)
        return m * math.ceil(self.vocab_size / m)
