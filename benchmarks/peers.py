"""The peers of the benchmark: torchtitan's Transformer and parallelisms, rebuilt from PyTorch.

torchtitan itself is not used (it is not installed with the GPUs' torch); its recipe is rebuilt
here from PyTorch's public APIs, as torchtitan applies it (``parallelize_llama``):

- **TP + SP** (``apply_tp``): norms ``SequenceParallel``; attention and feed-forward take
  ``Shard(1)`` (sequence) activations and gather them (``PrepareModuleInput``); q, k, v, w1, w3
  ``ColwiseParallel``; wo and w2 ``RowwiseParallel(output_layouts=Shard(1))``; embeddings
  ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``; the output
  ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1))`` under ``loss_parallel()``.
- **plain TP** (the weaker 1-D peer): the same without sequence parallelism.
- **activation checkpointing** (``apply_ac``): every block recomputed in backward (torchtitan's
  ``full`` mode; its ``checkpoint_wrapper`` is ``torch.utils.checkpoint`` non-reentrant).
- **compile** (``apply_compile``): each block ``torch.compile(block, fullgraph=True)``, and the
  loss ``torch.compile``d (``compiled_cross_entropy``), as torchtitan's ``compile.components``
  (model and loss) do by default.
- **async TP**: ``torch._inductor.config._micro_pipeline_tp = True`` and symmetric memory on the
  TP group, with compile.
- **FSDP2** (``apply_fsdp``): ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
  ``fully_shard`` on the token embedding (with GPT-2's learned positions), on each block, on
  ``[norm, output]`` together, then on the root, each a unit of its own, as torchtitan's current
  ``apply_fsdp`` shards them; on a 2-D mesh after TP. With its default policy the embedding and
  the blocks free their gathered weights after forward and ``[norm, output]`` keeps them (FSDP
  would gather them again at once for backward); ``reshard=False`` is its ``"never"``: no unit
  frees them (ZeRO-2's traffic, no all-gather in backward).
- **DDP**: ``DistributedDataParallel`` over the world.

Mixed precision as torchtitan does it: FSDP's policy where FSDP shards, ``torch.autocast``
otherwise; parameters and optimizer state stay float32. The model holds
:class:`~lightning_3d.models.DenseGPT`'s function (same weights via :func:`peer_state_dict`), with
separate q/k/v (and gate/up) projections as torchtitan's Transformer has them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from lightning_3d.models import GPTConfig
from lightning_3d.models.attention import apply_rope, causal_attention, rope_tables
from lightning_3d.models.dense import norm
from lightning_3d.models.mlp import mlp_activation


class PeerAttention(nn.Module):
    def __init__(self, config: GPTConfig, **factory):
        super().__init__()
        h, kv = config.n_embd, config.n_kv_head * config.head_dim
        self.head_dim = config.head_dim
        self.wq, self.wk, self.wv, self.wo = (
            nn.Linear(h, out, bias=config.bias, **factory) for out in (h, kv, kv, h)
        )

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (self.wq(x), self.wk(x), self.wv(x)))
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        return self.wo(causal_attention(q, k, v))


class PeerFeedForward(nn.Module):
    def __init__(self, config: GPTConfig, **factory):
        super().__init__()
        self.style = config.style
        h, f = config.n_embd, config.ffn_hidden
        self.w1 = nn.Linear(h, f, bias=config.bias, **factory)
        self.w2 = nn.Linear(f, h, bias=config.bias, **factory)
        self.w3 = nn.Linear(h, f, bias=config.bias, **factory) if config.style == "llama" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(mlp_activation(self.style, self.w1(x), self.w3(x) if self.w3 is not None else None))


class PeerBlock(nn.Module):
    def __init__(self, config: GPTConfig, **factory):
        super().__init__()
        self.attention_norm = norm(config, **factory)
        self.attention = PeerAttention(config, **factory)
        self.ffn_norm = norm(config, **factory)
        self.feed_forward = PeerFeedForward(config, **factory)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class PeerGPT(nn.Module):
    """torchtitan's Transformer layout of ``config`` (untied head). ``forward(idx [b, s])`` → logits ``[b, s, V]``."""

    def __init__(self, config: GPTConfig, device=None):
        super().__init__()
        if config.tie_embeddings:
            raise ValueError(
                "PeerGPT has an untied output layer (as torchtitan's Transformer); build "
                "GPTConfig(tie_embeddings=False)"
            )
        self.config = config
        factory = {"device": "meta"}
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd, **factory)
        self.pos_embeddings = (
            nn.Embedding(config.block_size, config.n_embd, **factory) if config.style == "gpt2" else None
        )
        self.layers = nn.ModuleList(PeerBlock(config, **factory) for _ in range(config.n_layer))
        self.norm = norm(config, **factory)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False, **factory)
        self.to_empty(device=device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        x = self.tok_embeddings(idx)
        rope = None
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(s, device=idx.device).expand(b, s))
        else:
            rope = rope_tables(s, self.config.head_dim, self.config.rope_theta, idx.device)
        for layer in self.layers:
            x = layer(x, rope)
        return self.output(self.norm(x))


def split_qkv(packed: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DenseGPT's ``c_attn`` rows (query slots, k, v) → q with its heads in order (head ``t·r + g`` of
    slot ``g``, row ``t``: torchtitan's and Llama's pairing with key/value head ``t``), k, v."""
    r, kv, d = config.queries_per_kv, config.n_kv_head, config.head_dim
    q, k, v = packed.split([r * kv * d, kv * d, kv * d])
    return q.unflatten(0, (r, kv, d)).transpose(0, 1).flatten(0, 2), k, v


def peer_state_dict(dense: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A :class:`DenseGPT` state dict (untied) under :class:`PeerGPT`'s keys, fused weights split."""
    out = {"tok_embeddings.weight": dense["transformer.wte.weight"], "output.weight": dense["lm_head.weight"]}
    if config.style == "gpt2":
        out["pos_embeddings.weight"] = dense["transformer.wpe.weight"]
    parts = ("weight", "bias") if config.bias else ("weight",)
    for part in parts:
        out[f"norm.{part}"] = dense[f"transformer.ln_f.{part}"]
    for i in range(config.n_layer):
        src, dst = f"transformer.h.{i}.", f"layers.{i}."
        for part in parts:
            out[dst + f"attention_norm.{part}"] = dense[src + f"ln_1.{part}"]
            out[dst + f"ffn_norm.{part}"] = dense[src + f"ln_2.{part}"]
            for name, t in zip(("wq", "wk", "wv"), split_qkv(dense[src + f"attn.c_attn.{part}"], config)):
                out[dst + f"attention.{name}.{part}"] = t
            out[dst + f"attention.wo.{part}"] = dense[src + f"attn.c_proj.{part}"]
            fc = dense[src + f"mlp.c_fc.{part}"]
            if config.style == "llama":
                out[dst + f"feed_forward.w1.{part}"], out[dst + f"feed_forward.w3.{part}"] = fc.chunk(2)
            else:
                out[dst + f"feed_forward.w1.{part}"] = fc
            out[dst + f"feed_forward.w2.{part}"] = dense[src + f"mlp.c_proj.{part}"]
    return out


def apply_tp(model: PeerGPT, tp_mesh, sequence_parallel: bool) -> None:
    """torchtitan's ``apply_tp`` (``sequence_parallel=True``), or plain Megatron TP without it."""
    if sequence_parallel:
        embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        top = {
            "tok_embeddings": embed,
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        }
        if model.pos_embeddings is not None:
            top["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        block = {
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        top = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        if model.pos_embeddings is not None:
            top["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate())
        block = {"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    block.update({f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")})
    block["feed_forward.w1"] = ColwiseParallel()
    if model.config.style == "llama":
        block["feed_forward.w3"] = ColwiseParallel()
    parallelize_module(model, tp_mesh, top)
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, block)


def enable_async_tp(tp_mesh) -> None:
    """torchtitan's async TP: Inductor's micro-pipeline pass and symmetric memory on the TP group."""
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


class Checkpointed(nn.Module):
    """torchtitan's full activation checkpointing of a block: its forward recomputed in backward."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        return checkpoint(self.block, x, rope, use_reentrant=False)


def apply_ac(model: PeerGPT) -> None:
    """torchtitan's ``apply_ac`` (full): every block checkpointed, after TP and before compile and FSDP."""
    for i, layer in enumerate(model.layers):
        model.layers[i] = Checkpointed(layer)


def apply_compile(model: PeerGPT) -> None:
    """torchtitan's ``apply_compile``: each block compiled whole (``fullgraph=True``)."""
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, fullgraph=True)


def apply_fsdp(
    model: PeerGPT, dp_mesh, reduce_dtype: torch.dtype = torch.float32, reshard: bool = True
) -> None:
    """torchtitan's ``apply_fsdp``: the embeddings, each block and ``[norm, output]`` units of their own,
    then the root; bf16 compute, ``reduce_dtype`` reductions (torchtitan's default float32; its
    ``mixed_precision_reduce`` setting picks bf16). ``reshard``: its default policy (the embedding
    and the blocks freed after forward, ``[norm, output]`` kept); ``False``: its ``"never"``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        if dp_mesh.device_type == "cuda"
        else None
    )
    kwargs = {"mesh": dp_mesh} | ({"mp_policy": policy} if policy is not None else {})
    embeddings = [m for m in (model.tok_embeddings, model.pos_embeddings) if m is not None]
    fully_shard(embeddings, reshard_after_forward=reshard, **kwargs)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    fully_shard([model.norm, model.output], reshard_after_forward=False, **kwargs)
    fully_shard(model, **kwargs)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in float32 (a DTensor ``Shard(-1)`` under ``loss_parallel()`` is fine)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def compiled_cross_entropy():
    """:func:`cross_entropy` through ``torch.compile``, as torchtitan compiles its loss when it compiles the model."""
    return torch.compile(cross_entropy)


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torchtitan's clipping: the total norm of every gradient (DTensor or not), then one scale."""
    params = [p for p in params if p.grad is not None]
    groups = [
        [p for p in params if isinstance(p.grad, DTensor)],
        [p for p in params if not isinstance(p.grad, DTensor)],
    ]
    squares = []
    for group in filter(None, groups):
        total = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        squares.append((total.full_tensor() if isinstance(total, DTensor) else total) ** 2)
    total = torch.stack(squares).sum().sqrt()
    for group in filter(None, groups):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
