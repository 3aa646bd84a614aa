"""The pipeline split of Hugging Face ``LlamaForCausalLM`` and the models that share its module names
(``MistralForCausalLM``, ``Qwen2ForCausalLM``), registered by class name: ``transformers`` is imported
only when a stage builds its attention mask.

Each stage runs what ``LlamaModel.forward`` runs between the same layers: the rotary tables of
positions ``0 … s-1`` (``model.model.rotary_emb``, on every stage), the causal mask of this rank's
y-layout rows as the model builds it (None where its attention runs causal on its own), each layer
called as the model calls it. The loss is the model's 3-D ``loss_function`` (transformers' label
shift: the last position of each sequence is not counted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..grid import Grid
from ..hf.plans import LLAMA_LIKE
from ..token_rows import sequence_multiple
from .split import MicroBatch, StageSplit, register_split


class LlamaSplit(StageSplit):
    """``model.layers`` shared out; ``model.embed_tokens`` on the first stage, ``model.norm`` and
    ``lm_head`` on the last; whole sequences only, as the Hugging Face plans take them."""

    layers = "model.layers"
    first = ("model.embed_tokens",)
    last = ("model.norm", "lm_head")

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

    def loss(
        self, model: nn.Module, logits: torch.Tensor, targets: torch.Tensor, mb: MicroBatch
    ) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=targets, vocab_size=model.config.vocab_size)

    def counted(self, targets: torch.Tensor) -> torch.Tensor:
        """Label ``t+1`` is position ``t``'s target; the last position has none."""
        return F.pad(targets, (0, 1), value=self.ignore_index)[..., 1:] != self.ignore_index

    def hidden_size(self, model: nn.Module) -> int:
        return model.config.hidden_size


for _name in LLAMA_LIKE:
    register_split(_name, lambda model: LlamaSplit())
