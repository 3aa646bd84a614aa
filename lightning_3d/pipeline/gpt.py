"""The pipeline split of :class:`~lightning_3d.models.DenseGPT`: its own ``embed``, ``blocks``, ``head``
and ``loss_of``, on whole sequences or token rows (:mod:`lightning_3d.token_rows`), as its forward
runs them."""

from __future__ import annotations

import torch
from torch import nn

from ..grid import Grid
from ..models.grid_checks import check_tokens
from ..parallel import options_of
from ..runtime import check_token_range
from ..token_rows import TokenRows, choose_rows
from .split import MicroBatch, StageSplit, register_split


class GPTSplit(StageSplit):
    """``transformer.h`` shared out; ``wte``, ``wpe`` and ``drop`` on the first stage, ``ln_f``,
    ``lm_head`` and ``loss`` on the last. A tied head cannot be split from its embedding."""

    layers = "transformer.h"
    first = ("transformer.wte", "transformer.wpe", "transformer.drop")
    last = ("transformer.ln_f", "lm_head", "loss")

    def micro_batch(self, model: nn.Module, grid: Grid, batch: int, seq_len: int) -> MicroBatch:
        rows = options_of(model).rows
        ids = torch.empty(batch, seq_len, dtype=torch.long, device="meta")
        check_tokens(ids, model.config, grid, rows, what="micro-batch ids")
        if choose_rows(batch, seq_len, grid, rows) == "sequences":
            return MicroBatch(batch, seq_len, batch, seq_len)
        device = next(model.parameters()).device
        token_rows = TokenRows(batch, seq_len, grid, device)
        return MicroBatch(batch, seq_len, batch * token_rows.chunks, token_rows.length, token_rows)

    def embed(self, model: nn.Module, ids: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return model.embed(ids, mb.state)

    def blocks(self, model: nn.Module, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return model.blocks(x, mb.state)

    def head(self, model: nn.Module, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return model.head(x)

    def loss(
        self, model: nn.Module, logits: torch.Tensor, targets: torch.Tensor, mb: MicroBatch
    ) -> torch.Tensor:
        runtime = model.loss.runtime
        if runtime.options.check_inputs:  # the plan's input hook checks them on a whole model
            check_token_range(targets, model.config.vocab_size, "GPT3D", "target", self.ignore_index)
        return model.loss_of(logits, targets, mb.state)

    def hidden_size(self, model: nn.Module) -> int:
        return model.config.n_embd


register_split("DenseGPT", lambda model: GPTSplit())
