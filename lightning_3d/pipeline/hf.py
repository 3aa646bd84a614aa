"""The pipeline splits of Hugging Face causal LMs, registered by class name: ``LlamaForCausalLM`` and
the models that share its module names (``MistralForCausalLM``, ``Qwen2ForCausalLM``), and
``GPT2LMHeadModel``. ``transformers`` is imported only when a stage builds its attention mask.

Each stage runs what the model's own forward runs between the same layers, each layer called as
the model calls it, on the inputs the model would give it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..grid import Grid
from ..hf.plans import LLAMA_LIKE
from ..token_rows import sequence_multiple
from .split import MicroBatch, StageSplit, register_split


class HFSplit(StageSplit):
    """What the Hugging Face causal LMs share: whole sequences, as their plans take them; positions
    ``0 … s-1`` and the causal mask of this rank's y-layout rows as the model builds it (None where
    its attention runs causal on its own); the model's 3-D ``loss_function`` (transformers' label
    shift: the last position of each sequence is not counted)."""

    def micro_batch(self, model: nn.Module, grid: Grid, batch: int, seq_len: int) -> MicroBatch:
        from ..hf.causal_mask import causal_mask

        multiple = sequence_multiple(grid)
        if batch % multiple:
            raise ValueError(
                f"{type(model).__name__} on grid {grid.shape}: a micro-batch of {batch} sequences does not split "
                f"into whole sequences per rank; make it a multiple of lcm(px·py, px·pz) = {multiple} (batch = "
                "n_microbatches × that)"
            )
        weight = next(model.parameters())
        positions = torch.arange(seq_len, device=weight.device).unsqueeze(0)
        rows = torch.empty(batch // grid.size("xz"), seq_len, 0, dtype=weight.dtype, device=weight.device)
        mask = causal_mask(model, rows, None, positions, may_skip=True)
        return MicroBatch(batch, seq_len, batch, seq_len, (positions, mask))

    def loss(
        self, model: nn.Module, logits: torch.Tensor, targets: torch.Tensor, mb: MicroBatch
    ) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=targets, vocab_size=model.config.vocab_size)

    def counted(self, targets: torch.Tensor) -> torch.Tensor:
        """Label ``t+1`` is position ``t``'s target; the last position has none."""
        return F.pad(targets, (0, 1), value=self.ignore_index)[..., 1:] != self.ignore_index

    def hidden_size(self, model: nn.Module) -> int:
        return model.config.hidden_size


class LlamaSplit(HFSplit):
    """``model.layers`` shared out; ``model.embed_tokens`` on the first stage, ``model.norm`` and
    ``lm_head`` on the last; the rotary tables (``model.model.rotary_emb``) made on every stage."""

    layers = "model.layers"
    first = ("model.embed_tokens",)
    last = ("model.norm", "lm_head")

    def embed(self, model: nn.Module, ids: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return model.model.embed_tokens(ids)

    def blocks(self, model: nn.Module, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        positions, mask = mb.state
        rope = model.model.rotary_emb(x, positions)
        for layer in model.model.layers:
            x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        return x

    def head(self, model: nn.Module, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return model.lm_head(model.model.norm(x))


class GPT2Split(HFSplit):
    """``transformer.h`` shared out; ``wte``, ``wpe`` and ``drop`` on the first stage, ``ln_f`` and
    ``lm_head`` on the last."""

    layers = "transformer.h"
    first = ("transformer.wte", "transformer.wpe", "transformer.drop")
    last = ("transformer.ln_f", "lm_head")

    def embed(self, model: nn.Module, ids: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        positions, _ = mb.state
        return model.transformer.drop(model.transformer.wte(ids) + model.transformer.wpe(positions))

    def blocks(self, model: nn.Module, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        _, mask = mb.state
        for block in model.transformer.h:
            x = block(x, attention_mask=mask)
        return x

    def head(self, model: nn.Module, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return model.lm_head(model.transformer.ln_f(x))


for _name in LLAMA_LIKE:
    register_split(_name, lambda model: LlamaSplit())
register_split("GPT2LMHeadModel", lambda model: GPT2Split())
