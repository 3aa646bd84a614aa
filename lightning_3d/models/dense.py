"""DenseGPT: the GPT language model in plain ``torch.nn``; :class:`GPT3D` is this model parallelized.

nanoGPT's structure and state-dict keys. Fused weights: ``attn.c_attn.weight`` ``[3h, h]`` stacks
q, k, v (each ``[h, h]``, heads in order); for llama, ``mlp.c_fc.weight`` ``[2·ffn, h]`` stacks gate
and up. With grouped-query attention (``r = n_head / n_kv_head`` query heads per key/value head),
``c_attn.weight`` ``[(r + 2)·n_kv·d, h]`` stacks r query slots, then k, then v, each
``[n_kv·d, h]``: slot ``g`` holds the query heads ``t·r + g`` for ``t = 0 … n_kv−1`` (those of
key/value head ``t``). Every slot splits over y like k and v, so a y rank holds whole query
groups with their key/value heads. With ``tie_embeddings`` the head's weight is the token embedding's
(``lm_head.weight`` and ``transformer.wte.weight`` are one parameter, under both keys, as in Hugging Face's
GPT-2).

Every module works on whatever part of the activation it is given, so the same code runs
parallelized: attention views its input as ``-1`` heads of ``head_dim`` (the heads of a rank), the
packed projections' outputs are split into their groups (``output_groups``), and positions, the head and the loss are
modules a plan can replace.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.packed_elementwise import packed_rope, packed_swiglu
from ..token_rows import Attend, TokenRows, cached_token_rows, choose_rows
from .attention import apply_rope, causal_attention, rope_tables
from .config import GPTConfig
from .init import init_dense_tensor_
from .mlp import mlp_activation
from .sampling import generate_tokens


def init_order(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model``'s state dict in order, each tensor once (a tied weight under its first key)."""
    seen, out = set(), []
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((key, t.detach()))
    return out


def check_sequence(seq_len: int, config: GPTConfig) -> None:
    """Raise ``ValueError`` when a sequence is longer than the model's ``block_size``."""
    if seq_len > config.block_size:
        raise ValueError(
            f"sequence length {seq_len} exceeds block_size {config.block_size}; "
            f"crop the input to its last {config.block_size} tokens or build the model with block_size >= {seq_len}"
        )


def norm(config: GPTConfig, **factory) -> nn.Module:
    if config.style == "gpt2":
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias, **factory)
    return nn.RMSNorm(config.n_embd, eps=config.norm_eps, **factory)


def output_groups(linear: nn.Module, x: torch.Tensor, runs: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """A packed projection's output ``linear(x)`` ``[..., G·out]`` cut into runs of ``runs[i]`` of its
    ``G = sum(runs)`` equal groups (query slots, k, v; gate, up), each ``[..., P, runs[i], out/P]``:
    every group's output as ``P`` consecutive blocks.

    A plain layer gives ``P = 1``, views of its output. A layer with ``forward_groups``
    (:class:`~lightning_3d.layers.FusedLinear3D`) gives the groups where its product leaves them
    (``P = px``), so that per-feature and per-head work reads them without a copy into the packed
    order; on one rank, one product per run, whose backward takes each run's gradient as it
    comes, where the pieces of one output would have their gradients concatenated first.
    """
    forward_groups = getattr(linear, "forward_groups", None)
    if forward_groups is not None:
        return forward_groups(x, runs)
    return linear(x).unflatten(-1, (1, sum(runs), -1)).split(list(runs), -2)


class DenseAttention(nn.Module):
    def __init__(self, config: GPTConfig, **factory):
        super().__init__()
        h = config.n_embd
        self.head_dim, self.queries_per_kv = config.head_dim, config.queries_per_kv
        self.c_attn = nn.Linear(
            h, (config.queries_per_kv + 2) * config.n_kv_head * config.head_dim, bias=config.bias, **factory
        )
        self.c_proj = nn.Linear(h, h, bias=config.bias, **factory)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope=None, attend: Attend = causal_attention) -> torch.Tensor:
        return self.resid_dropout(
            self.c_proj(packed_attention(self.c_attn, x, self.queries_per_kv, self.head_dim, rope, attend))
        )


def packed_attention(
    qkv: nn.Module,
    x: torch.Tensor,
    queries_per_kv: int,
    head_dim: int,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    attend: Attend = causal_attention,
) -> torch.Tensor:
    """Causal self-attention of the heads that the packed projection ``qkv`` makes of ``x``.

    ``qkv(x)`` is ``[b, s, (r + 2)·n]`` as :class:`DenseAttention`'s ``c_attn`` lays it out: ``r =
    queries_per_kv`` query slots, then k, then v, each ``n = kv_heads·head_dim`` (the heads of this
    rank, any number). ``rope``: ``(cos, sin)`` ``[≥ s, m]`` or per row ``[b, s, m]``
    (:func:`apply_rope`), rotating the first ``m ≤ head_dim`` features of every q and k head
    (partial rotary where ``m < head_dim``), or None. ``attend``: the attention of q ``[b, s, heads,
    d]`` and k, v ``[b, s, kv_heads, d]`` (:func:`causal_attention`, or token rows' attention).
    Returns ``[b, s, r·kv_heads·head_dim]``, query head ``t·r + g`` (slot ``g`` of key/value head
    ``t``) at position ``t·r + g``: the order in which grouped-query attention pairs query heads with
    key/value heads.
    """
    r, d = queries_per_kv, head_dim
    if rope is None or rope[0].shape[-1] != d or rope[0].dim() != 2:
        parts = output_groups(qkv, x, (r, 1, 1))  # [b, s, P, run, kv_heads·d/P]: r query slots; k; v
    else:  # one product, whose gradient RoPE's backward writes in one pass
        (packed,) = output_groups(qkv, x, (r + 2,))  # [b, s, P, r + 2, kv_heads·d/P]
        if packed.shape[-1] % d == 0:
            return attend(*packed_rope(packed.unflatten(-1, (-1, d)), rope, r))
        parts = packed.split([r, 1, 1], -2)
    if parts[0].shape[-1] % d:  # a block cuts a head (P does not divide the key/value heads): join the blocks
        parts = [t.movedim(-3, -2).flatten(-2).unsqueeze(-3) for t in parts]
    q, k, v = (t.unflatten(-1, (-1, d)) for t in parts)  # [b, s, P, run, kv_heads/P, d]
    if rope is not None:
        q, k = apply_rope(q, rope), apply_rope(k, rope)
    # key/value head t = (block, t'); query head (t, g) of slot g → order t·r + g, the order causal_attention pairs
    return attend(*(t.flatten(2, -2) for t in (q.transpose(-3, -2), k, v)))


class DenseMLP(nn.Module):
    def __init__(self, config: GPTConfig, **factory):
        super().__init__()
        self.groups = 2 if config.style == "llama" else 1  # llama: gate and up
        self.style = config.style
        self.c_fc = nn.Linear(config.n_embd, self.groups * config.ffn_hidden, bias=config.bias, **factory)
        self.c_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=config.bias, **factory)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (gate_up,) = output_groups(self.c_fc, x, (self.groups,))  # [..., P, groups, ffn/P]
        hidden = (
            packed_swiglu(gate_up)
            if self.style == "llama"
            else mlp_activation(self.style, gate_up.squeeze(-2))
        )
        return self.dropout(self.c_proj(hidden.flatten(-2)))


class DenseBlock(nn.Module):
    def __init__(self, config: GPTConfig, **factory):
        super().__init__()
        self.ln_1 = norm(config, **factory)
        self.attn = DenseAttention(config, **factory)
        self.ln_2 = norm(config, **factory)
        self.mlp = DenseMLP(config, **factory)

    def forward(self, x: torch.Tensor, rope=None, attend: Attend = causal_attention) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, attend)
        return x + self.mlp(self.ln_2(x))


class DenseGPT(nn.Module):
    """Single-device GPT of ``config``. ``forward(idx [b, s], targets=None)`` → loss, or logits ``[b, s, V]``.

    ``device``/``dtype`` place the parameters (``device="meta"`` allocates nothing); weights are
    GPT-2's init drawn in state-dict order (equal to :class:`GPT3D`'s from the same seed).
    """

    def __init__(self, config: GPTConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        factory = {"device": "meta", "dtype": dtype}
        modules = {"wte": nn.Embedding(config.vocab_size, config.n_embd, **factory)}
        if config.style == "gpt2":
            modules["wpe"] = nn.Embedding(config.block_size, config.n_embd, **factory)
        modules["drop"] = nn.Dropout(config.dropout)
        modules["h"] = nn.ModuleList(DenseBlock(config, **factory) for _ in range(config.n_layer))
        modules["ln_f"] = norm(config, **factory)
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False, **factory)
        self.loss = nn.CrossEntropyLoss(ignore_index=-100)
        self.to_empty(device=device if device is not None else torch.get_default_device())
        if config.tie_embeddings:  # after to_empty, which gives every module a parameter of its own
            self.lm_head.weight = self.transformer.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's init (see :mod:`lightning_3d.models.init`), drawn in state-dict order (a tied weight once)."""
        for key, t in init_order(self):
            init_dense_tensor_(key, t, self.config)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = idx.shape
        check_sequence(s, self.config)
        rows = self.token_rows(b, s, idx.device)
        logits = self.head(self.blocks(self.embed(idx, rows), rows))
        return logits if targets is None else self.loss_of(logits, targets, rows)

    def embed(self, idx: torch.Tensor, rows: TokenRows | None = None) -> torch.Tensor:
        """Ids ``[b, s]`` → the blocks' input: token (and learned position) embeddings and dropout; on
        token ``rows`` (:meth:`token_rows`), rows ``[b·C, s/C]`` in their order."""
        s = idx.shape[1]
        x = self.transformer.wte(idx if rows is None else rows.arrange(idx))
        if self.config.style == "gpt2":
            x = x + self.transformer.wpe(
                torch.arange(s, device=idx.device) if rows is None else rows.positions("z")
            )
        return self.transformer.drop(x)

    def blocks(self, x: torch.Tensor, rows: TokenRows | None = None) -> torch.Tensor:
        """The Transformer blocks the model holds (a pipeline stage holds some) on :meth:`embed`'s output
        ``x``, whose rows are whole sequences, or the token ``rows``."""
        s = x.shape[1] if rows is None else rows.seq_len
        rope, attend = None, causal_attention if rows is None else rows.attend
        if self.config.style != "gpt2":
            rope = rope_tables(s, self.config.head_dim, self.config.rope_theta, x.device, x.dtype)
            rope = rope if rows is None else rows.rope(rope)
        for block in self.transformer.h:
            x = block(x, rope, attend)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks' output → logits: the final norm and the LM head."""
        return self.lm_head(self.transformer.ln_f(x))

    def loss_of(
        self, logits: torch.Tensor, targets: torch.Tensor, rows: TokenRows | None = None
    ) -> torch.Tensor:
        """The mean loss of :meth:`head`'s logits against targets ``[b, s]`` (put in the order of token ``rows``)."""
        targets = targets if rows is None else rows.arrange(targets)
        return self.loss(logits.flatten(0, -2), targets.flatten())

    def token_rows(self, batch: int, seq_len: int, device: torch.device) -> TokenRows | None:
        """How the rows of a ``[batch, seq_len]`` input split: None for whole sequences (always, on one
        device), else the :class:`~lightning_3d.token_rows.TokenRows` that the model's 3-D layers run on
        (:func:`~lightning_3d.token_rows.choose_rows` with their ``RuntimeOptions.rows``)."""
        embedding = self.transformer.wte
        grid = getattr(embedding, "grid", None)  # a 3-D layer's, once the model is parallelized
        if grid is None or choose_rows(batch, seq_len, grid, embedding.options.rows) == "sequences":
            return None
        return cached_token_rows(self, batch, seq_len, grid, device)

    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``[b, s]`` (see :func:`generate_tokens`)."""
        return generate_tokens(
            lambda i: self(i)[:, -1], idx, max_new_tokens, self.config.block_size, temperature, top_k
        )
