"""GPT3D: the GPT language model on the 3-D layers, equal to :class:`DenseGPT` on every grid.

Data flow on rank ``(i, j, l)`` (``b`` sequences of ``s`` tokens, the same ids on every cube rank):
ids ``[b, s]`` → embedding → z-layout ``[b/(px·py), s, h/pz]`` → blocks (z in, z out) → final norm →
LM head (z→y) → y-layout logits ``[b/(px·pz), s, V'/py]`` → vocab-parallel cross-entropy.

The vocabulary is padded to ``V' = config.padded_vocab_size(px·py)`` rows (zeros, never looked
up); padded logits are set to the dtype's lowest value, so they drop out of the loss (their
gradient is zero) and of generation. The dense state dict drops the padding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..grid import Grid
from ..layers import Dropout3D, Linear3D, Module3D, VocabParallelEmbedding3D
from ..layers.base import dense_state_dict, load_dense_state_dict
from ..layout import gather_activation
from ..ops import matmul_abt, vocab_parallel_cross_entropy
from ..sharding import get_spec, shard_tensor
from .attention import rope_tables
from .blocks3d import Block3D, norm3d
from .config import GPTConfig
from .dense import DenseGPT
from .grid_checks import batch_multiple, check_grid, check_tokens
from .init import init_dense_tensor_
from .position import PositionEmbedding3D
from .sampling import generate_tokens

# Dense keys whose first dim is the vocabulary (padded on the grid).
VOCAB_KEYS = ("transformer.wte.weight", "lm_head.weight")


class GPT3D(Module3D):
    """GPT on the 3-D grid, with :class:`DenseGPT`'s parameter names.

    Args:
        config: the model.
        grid: defaults to the current grid.
        device, dtype: where and in what dtype the shards live.
        activation_checkpointing: recompute each block in backward (non-reentrant
            ``torch.utils.checkpoint``; dropout masks are replayed exactly). Settable later.
        save_gathered: keep the gathered activations and weights of every 3-D matmul for backward
            (default) or re-gather them there.

    Raises:
        ValueError: a size of ``config`` does not split on the grid (see :func:`check_grid`).
    """

    def __init__(self, config: GPTConfig, grid: Grid | None = None, *, device=None, dtype=None,
                 activation_checkpointing: bool = False, save_gathered: bool = True):
        super().__init__(grid)
        check_grid(config, self.grid)
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        self.save_gathered = save_gathered
        px, py, _ = self.grid.shape
        self.padded_vocab_size = config.padded_vocab_size(px * py)
        grid, h, factory = self.grid, config.n_embd, {"device": "meta", "dtype": dtype}
        modules = {"wte": VocabParallelEmbedding3D(self.padded_vocab_size, h, grid=grid, **factory)}
        if config.style == "gpt2":
            modules["wpe"] = PositionEmbedding3D(config.block_size, h, grid=grid, **factory)
        modules["drop"] = Dropout3D(config.dropout)
        modules["h"] = nn.ModuleList(Block3D(config, grid, save_gathered, **factory) for _ in range(config.n_layer))
        modules["ln_f"] = norm3d(config, grid, **factory)
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = None if config.tie_embeddings else Linear3D(
            h, self.padded_vocab_size, bias=False, input_layout="z", grid=grid, save_gathered=save_gathered, **factory)
        self.dense_shapes = {k: tuple(t.shape) for k, t in DenseGPT(config, device="meta").state_dict().items()}
        self.to_empty(device=device if device is not None else torch.get_default_device())
        self.reset_parameters()

    # ----- dense exchange: the global tensor of every key is its dense tensor, padded and reshaped -----

    def _to_global(self, key: str, dense: torch.Tensor) -> torch.Tensor:
        """Dense tensor → this model's global tensor (vocab rows padded with zeros, fused weights viewed as groups)."""
        if tuple(dense.shape) != self.dense_shapes[key]:
            raise ValueError(f"{key}: the dense state dict holds shape {list(dense.shape)}, DenseGPT has {list(self.dense_shapes[key])}")
        if key in VOCAB_KEYS:
            pad = dense.new_zeros((self.padded_vocab_size - dense.shape[0],) + tuple(dense.shape[1:]))
            dense = torch.cat([dense, pad])
        return dense.reshape(get_spec(self.get_parameter(key)).global_shape)

    def _to_dense(self, key: str, full: torch.Tensor) -> torch.Tensor:
        """Global tensor → dense tensor: drop vocab padding, flatten fused groups."""
        if key in VOCAB_KEYS:
            full = full[: self.config.vocab_size]
        return full.reshape(self.dense_shapes[key])

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under exactly ``DenseGPT(config).state_dict()``'s keys, on every cube rank (collective)."""
        return {k: self._to_dense(k, t) for k, t in dense_state_dict(self, self.grid).items()}

    def load_dense_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a ``DenseGPT`` state dict (from any grid's :meth:`dense_state_dict`, or a DenseGPT)."""
        unexpected = [k for k in state_dict if k not in self.dense_shapes]
        missing = [k for k in self.dense_shapes if k not in state_dict]
        if strict and (missing or unexpected):
            raise KeyError(f"dense state dict does not match GPT3D: missing {missing}, unexpected {unexpected}")
        load_dense_state_dict(self, {k: self._to_global(k, t) for k, t in state_dict.items() if k in self.dense_shapes},
                              self.grid, strict=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's init drawn in DenseGPT's state-dict order: the same weights as DenseGPT from the same seed."""
        own = self.state_dict(keep_vars=True)
        for key, shape in self.dense_shapes.items():
            param = own[key]
            full = torch.empty(shape, device=param.device, dtype=param.dtype)
            init_dense_tensor_(key, full, self.config)
            param.copy_(shard_tensor(self._to_global(key, full), get_spec(param), self.grid))

    # ----- forward -----

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx`` ``[b, s]`` token ids, the same on every cube rank.

        Returns the mean loss over the non-ignored (``-100``) ``targets`` ``[b, s]`` (the same scalar
        on every cube rank), or, without targets, the y-layout logits ``[b/(px·pz), s, V'/py]``.
        """
        check_tokens(idx, self.config, self.grid)
        s = idx.shape[1]
        x = self.transformer.wte(idx)
        rope = None
        if self.config.style == "gpt2":
            x = x + self.transformer.wpe(s)
        else:
            rope = rope_tables(s, self.config.head_dim, self.config.rope_theta, x.device, x.dtype)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        logits = self._mask_padding(self._head(self.transformer.ln_f(x)))
        if targets is None:
            return logits
        if targets.shape != idx.shape:
            raise ValueError(f"GPT3D: targets {list(targets.shape)} must have the shape of idx {list(idx.shape)}")
        return vocab_parallel_cross_entropy(logits, targets, grid=self.grid)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """z-layout ``[b/(px·py), s, h/pz]`` → y-layout logits; the tied head reads the embedding weight as a z→y weight."""
        if self.lm_head is not None:
            return self.lm_head(x)
        return matmul_abt(x, self.transformer.wte.weight, ("y", "x", "z"), self.grid, self.save_gathered)

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits of padded vocabulary entries (in this rank's block ``j``) to the dtype's lowest value."""
        width = logits.shape[-1]
        start = self.grid.coord("y") * width
        if start + width <= self.config.vocab_size:
            return logits
        padded = torch.arange(start, start + width, device=logits.device) >= self.config.vocab_size
        return logits.masked_fill(padded, torch.finfo(logits.dtype).min)

    # ----- generation -----

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``[b, s]``; every cube rank returns the same tokens.

        Any batch works (it is padded with copies to a multiple the grid needs). Each step gathers
        the last position's logits on every cube rank, drops the padded vocabulary, samples, and
        takes cube rank 0's draw (a broadcast), so ranks agree even if their RNGs do not.
        """
        b = idx.shape[0]
        pad = -b % batch_multiple(self.grid)

        def next_logits(ids: torch.Tensor) -> torch.Tensor:
            ids = torch.cat([ids, ids[-1:].expand(pad, -1)]) if pad else ids
            last = self(ids)[:, -1]  # y-layout [b/(px·pz), V'/py]
            return gather_activation(last, "y", self.grid)[:b, : self.config.vocab_size]

        return generate_tokens(next_logits, idx, max_new_tokens, self.config.block_size, temperature, top_k, self._agree)

    def _agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cube rank 0's ``tokens`` on every cube rank."""
        if self.grid.cube_size > 1:
            group = self.grid.group("cube")
            dist.broadcast(tokens, src=dist.get_global_rank(group, 0), group=group)
        return tokens
