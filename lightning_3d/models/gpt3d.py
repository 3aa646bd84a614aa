"""GPT3D: :class:`DenseGPT` parallelized by its plan, equal to DenseGPT on every grid.

Data flow on rank ``(i, j, l)`` (``b`` sequences of ``s`` tokens, the same ids on every cube rank):
ids ``[b, s]`` → embedding → z-layout ``[b/(px·py), s, h/pz]`` → blocks (z in, z out: ``c_attn``
and ``c_fc`` z→y, attention on the heads of y block ``j``, ``c_proj`` y→z) → final norm → LM head
(z→y) → y-layout logits ``[b/(px·pz), s, V'/py]`` → vocabulary-parallel cross-entropy.

The vocabulary is padded to ``V' = config.padded_vocab_size(px·py)`` rows (zeros, never looked
up); padded logits are set to the dtype's lowest value, so they drop out of the loss (their
gradient is zero) and of generation. Dense state dicts drop the padding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import agree_on_first_call
from ..grid import Grid
from ..layout import gather_activation
from ..options import RuntimeOptions
from ..parallel import (
    Dropout,
    Linear,
    LMHead,
    Loss,
    Norm,
    Plan,
    PositionEmbedding,
    Rule,
    VocabEmbedding,
    dense_state_dict,
    grid_of,
    load_dense_state_dict,
    options_of,
    parallelize,
    register_plan,
)
from ..runtime import check_token_range
from ..token_rows import sequence_multiple
from .config import GPTConfig
from .dense import DenseGPT
from .grid_checks import check_grid, check_tokens
from .init import init_dense_tensor_
from .sampling import generate_tokens

BLOCKS = "transformer.h.*"


def block_rules(config: GPTConfig, blocks: str = BLOCKS) -> dict[str, Rule]:
    """The rules of the :class:`~lightning_3d.models.dense.DenseBlock` s named by ``blocks``: z in,
    z out; the packed query slots, k and v (and llama's gate/up) z→y, each slot split alike over
    y, the projections back y→z."""
    return {
        f"{blocks}.ln_?": Norm("z"),
        f"{blocks}.attn.c_attn": Linear("z", groups=config.queries_per_kv + 2),
        f"{blocks}.attn.c_proj": Linear("y"),
        f"{blocks}.attn.resid_dropout": Dropout(),
        f"{blocks}.mlp.c_fc": Linear("z", groups=2 if config.style == "llama" else 1),
        f"{blocks}.mlp.c_proj": Linear("y"),
        f"{blocks}.mlp.dropout": Dropout(),
    }


def gpt_plan(config: GPTConfig, options: RuntimeOptions | None = None) -> Plan:
    """The plan of :class:`DenseGPT`: its blocks by :func:`block_rules`, the vocabulary padded to
    ``config.vocab_multiple``, the blocks as checkpoint units, GPT-2's init by key for ``meta`` builds."""
    rules = {
        "transformer.wte": VocabEmbedding(pad_to_multiple=config.vocab_multiple),
        "transformer.wpe": PositionEmbedding(),
        "transformer.drop": Dropout(),
        **block_rules(config),
        "transformer.ln_f": Norm("z"),
        "lm_head": LMHead(pad_to_multiple=config.vocab_multiple),
        "loss": Loss(vocab_size=config.vocab_size, check_targets=False),  # check_batch checks them first
    }
    if config.style != "gpt2":
        del rules["transformer.wpe"]

    def check_batch(model: nn.Module, grid: Grid, args: tuple, kwargs: dict) -> None:
        idx = args[0] if args else kwargs["idx"]
        targets = args[1] if len(args) > 1 else kwargs.get("targets")
        agree_on_first_call(model, grid.group("cube"), "GPT3D input", idx=idx, targets=targets)
        check_tokens(idx, config, grid, model.loss.options.rows)
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(
                f"GPT3D: targets {list(targets.shape)} must have the shape of idx {list(idx.shape)}"
            )
        runtime = model.loss.runtime  # the model's, which every 3-D layer holds
        if targets is not None and runtime.options.check_inputs:  # at the forward's start: read at its end
            check_token_range(
                targets, config.vocab_size, "GPT3D", "target", model.loss.ignore_index, runtime.token_checks
            )

    return Plan(
        rules,
        options=options if options is not None else RuntimeOptions(),
        checkpoint=(BLOCKS,),
        before_forward=check_batch,
        init=lambda name, t: init_dense_tensor_(name, t, config),
        validate=lambda model, grid: check_grid(config, grid),
        rows_in_model=True,  # DenseGPT.embed takes the rows DenseGPT.token_rows arranges
    )


register_plan("DenseGPT", lambda model: gpt_plan(model.config))


class GPT3D(DenseGPT):
    """:class:`DenseGPT` on the 3-D grid: the same modules, keys and forward, built by :func:`gpt_plan`.

    ``forward(idx, targets)`` returns the mean loss (the same scalar on every cube rank), or,
    without targets, the y-layout logits ``[b/(px·pz), s, V'/py]``.

    Args:
        config: the model.
        grid: defaults to the current grid.
        device, dtype: where and in what dtype the shards live. Nothing full-size is allocated:
            the model is built on ``meta`` and each rank draws its shards of DenseGPT's init.
        options: the run-time choices (``activation_checkpointing`` recomputes each block), fixed
            into the model's runtime (:attr:`options`; ``set_options(model, ...)`` changes them).

    Raises:
        ValueError: a size of ``config`` does not split on the grid (see :func:`check_grid`).
    """

    def __init__(
        self,
        config: GPTConfig,
        grid: Grid | None = None,
        *,
        device=None,
        dtype=None,
        options: RuntimeOptions | None = None,
    ):
        super().__init__(config, device="meta", dtype=dtype)
        parallelize(self, gpt_plan(config), grid=grid, options=options, device=device)

    @property
    def grid(self) -> Grid:
        return grid_of(self)

    @property
    def options(self) -> RuntimeOptions:
        return options_of(self)

    @property
    def padded_vocab_size(self) -> int:
        return self.transformer.wte.num_embeddings

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under exactly ``DenseGPT(config).state_dict()``'s keys, on every cube rank (collective)."""
        return dense_state_dict(self)

    def load_dense_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a ``DenseGPT`` state dict (from any grid's :meth:`dense_state_dict`, or a DenseGPT)."""
        load_dense_state_dict(self, state_dict, strict)

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``[b, s]``; every cube rank returns the same tokens.

        Any batch works (it is padded with copies to a multiple the grid needs). Each step gathers
        the last position's logits on every cube rank, drops the padded vocabulary, samples, and
        takes cube rank 0's draw (a broadcast), so ranks agree even if their RNGs do not.
        """
        grid = self.grid
        b = idx.shape[0]
        pad = -b % sequence_multiple(grid)

        def next_logits(ids: torch.Tensor) -> torch.Tensor:
            ids = torch.cat([ids, ids[-1:].expand(pad, -1)]) if pad else ids
            last = self(ids)[:, -1]  # y-layout [b/(px·pz), V'/py]
            return gather_activation(last, "y", grid)[:b, : self.config.vocab_size]

        return generate_tokens(
            next_logits, idx, max_new_tokens, self.config.block_size, temperature, top_k, self._agree
        )

    def _agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cube rank 0's ``tokens`` on every cube rank."""
        grid = self.grid
        if grid.cube_size > 1:
            group = grid.group("cube")
            dist.broadcast(tokens, src=dist.get_global_rank(group, 0), group=group)
        return tokens
