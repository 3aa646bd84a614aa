"""What a grid asks of a GPT's sizes and of its inputs, as ``ValueError`` s that name the numbers and the fix."""

from __future__ import annotations

import torch

from ..grid import Grid
from ..token_rows import choose_rows
from .config import GPTConfig
from .dense import check_sequence


def _require(value: int, parts: int, what: str, why: str, grid: Grid) -> None:
    if value % parts:
        raise ValueError(
            f"GPT3D on grid {'×'.join(map(str, grid.shape))}: {what} = {value} is not divisible by {why} = {parts} "
            f"({value} % {parts} = {value % parts}); make {what} a multiple of {parts} or pick a grid that divides it"
        )


def check_grid(config: GPTConfig, grid: Grid) -> None:
    """The sizes of ``config`` split evenly on ``grid`` (the vocabulary is padded, so it never fails)."""
    px, py, pz = grid.shape
    if config.n_kv_head == config.n_head:
        _require(config.n_head, py, "n_head", "py (each y rank attends with whole heads)", grid)
    else:
        _require(
            config.n_kv_head,
            py,
            "n_kv_head",
            "py (each y rank attends with whole key/value heads and their query heads)",
            grid,
        )
        _require(
            config.n_kv_head * config.head_dim,
            px * py,
            "n_kv_head·head_dim",
            "px·py (rows of each slot of c_attn)",
            grid,
        )
    _require(config.n_embd, px * py, "n_embd", "px·py (rows of the z→y weights c_attn, c_fc)", grid)
    _require(config.n_embd, px * pz, "n_embd", "px·pz (rows of the y→z weights c_proj)", grid)
    _require(config.ffn_hidden, px * py, "ffn_hidden", "px·py (rows of the MLP's c_fc)", grid)


def check_tokens(
    idx: torch.Tensor, config: GPTConfig, grid: Grid, rows: str = "auto", what: str = "idx"
) -> None:
    """``idx`` is ``[batch, seq]`` integer ids with ``seq <= block_size`` whose rows split on ``grid``, as
    whole sequences or as token rows (:func:`~lightning_3d.token_rows.choose_rows` with ``rows``)."""
    if idx.dim() != 2 or idx.is_floating_point() or idx.is_complex():
        raise ValueError(
            f"GPT3D: {what} must be integer token ids [batch, seq], got {idx.dtype} of shape {list(idx.shape)}"
        )
    check_sequence(idx.shape[1], config)
    try:
        choose_rows(idx.shape[0], idx.shape[1], grid, rows)
    except ValueError as e:
        raise ValueError(f"GPT3D: {e}") from None
