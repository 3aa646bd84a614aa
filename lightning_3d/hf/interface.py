"""The Hugging Face call interface of a parallelized causal LM: inputs laid out per rank, the 3-D loss.

``model(input_ids, attention_mask=..., position_ids=..., labels=...)`` keeps working on the grid,
every tensor the full batch ``[b, s]`` on every cube rank, any ``b``. The rows of the activations
are whole sequences where ``b`` is a multiple of ``lcm(px·py, px·pz)``, else token rows (chunks of
sequences, :mod:`lightning_3d.token_rows`; :func:`~lightning_3d.token_rows.choose_rows` with the
model's ``RuntimeOptions.rows``). A forward pre-hook on the model (:func:`lay_out_inputs`) lays
the call out for this rank's rows:

- Whole sequences: the embedding keeps its z-layout rows (block ``(i, j)``), the loss its
  y-layout rows (block ``(i, l)``). Attention runs on y-layout rows, so a padding mask or position
  ids become the 4-D mask of this rank's y rows, built by transformers' own
  ``create_causal_mask`` for the configured attention implementation (padding and packed
  sequences included; lightning_3d's attention, :mod:`.attention`, gets the one ``"sdpa"``
  builds); the model passes a 4-D mask through unchanged. Without either, the model builds none
  (causal SDPA). Per-sequence ``position_ids`` are cut to the rows they are used on: the y rows
  for RoPE (Llama), the z rows for a position table added to the embedding (GPT-2).
- Token rows: ``input_ids`` become the rows ``[b·C, s/C]`` (:meth:`TokenRows.arrange`), the
  position ids (``0 … s-1``, or the caller's, packed sequences included) this rank's rows of
  them in the layout they are used in, the padding mask (zeros anywhere) or the packed
  sequences that position ids mark the rows' own mask (:meth:`TokenRows.attention_mask`), and
  the labels, shifted first (position ``t`` predicts label ``t+1`` wherever that token lives),
  arranged as ``shift_labels``; the attention (:mod:`.attention`) is handed ``token_rows``.
- ``labels`` give the model's loss through :func:`causal_lm_loss_3d`: transformers' label shift,
  ``-100`` ignored, the vocabulary-parallel cross-entropy; the same scalar on every cube rank.
- ``logits`` in the output are this rank's y-layout block: ``[b/(px·pz), s, V'/py]`` on whole
  sequences, ``[b·C/(px·pz), s/C, V'/py]`` on token rows (``TokenRows(b, s, grid).restore`` of the
  gathered rows gives ``[b, s, V']``). Hidden states and attentions, when asked for, are this
  rank's blocks too.

Refused with a ``ValueError``: ``inputs_embeds``, a KV cache (``cache``/``past_key_values``,
``use_cache=True``); ``use_cache`` left unset is passed as False (the config is not changed). On
token rows, also a 4-D ``attention_mask`` and a model whose attention is not lightning_3d's (one
parallelized with ``"eager"`` attention, or set to another implementation since).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..agreement import agree_on_first_call
from ..grid import Grid
from ..ops.cross_entropy import vocab_parallel_cross_entropy
from ..ops.sequence_split import shift_labels as shift_labels_of
from ..runtime import Runtime
from ..token_rows import cached_token_rows, choose_rows, local_rows, sequence_multiple

CACHE_ARGS = ("cache", "past_key_values")


def _per_sequence(position_ids: torch.Tensor | None) -> bool:
    return position_ids is not None and position_ids.dim() == 2 and position_ids.shape[0] > 1


def _check_same_batch(name: str, t: torch.Tensor | None, input_ids: torch.Tensor, dims: int) -> None:
    if t is not None and (t.shape[0] != input_ids.shape[0] or t.dim() < dims):
        raise ValueError(
            f"{name} {list(t.shape)}: expected the full batch of input_ids {list(input_ids.shape)} "
            f"(the same tensor on every cube rank)"
        )


def attention_rows_mask(
    model: nn.Module,
    grid: Grid,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The attention mask of this rank's y-layout rows, as the model would build it for them (None: plain causal)."""
    from .causal_mask import causal_mask

    b, s = input_ids.shape
    if attention_mask is not None and attention_mask.dim() == 4:
        return local_rows(attention_mask, grid, "y")
    per_sequence = _per_sequence(position_ids)
    return causal_mask(
        model,
        torch.empty(b // grid.size("xz"), s, 0, dtype=dtype, device=input_ids.device),
        None if attention_mask is None else local_rows(attention_mask, grid, "y"),
        local_rows(position_ids, grid, "y") if per_sequence else position_ids,
        # with per-sequence positions the model must not build a mask of its own (its batch is z-layout)
        may_skip=not per_sequence,
    )


def lay_out_inputs(
    model: nn.Module, grid: Grid, args: tuple, kwargs: dict, *, positions_layout: str
) -> tuple[tuple, dict]:
    """A plan's ``before_forward``: check the call, lay it out for this rank's rows.

    ``positions_layout``: the layout whose rows the model's position ids are used on, ``"y"``
    (RoPE in attention) or ``"z"`` (a position table added to the embedding).
    """
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    call = dict(bound.arguments)
    call.update(call.pop("kwargs", {}))
    if call.get("inputs_embeds") is not None or call.get("input_ids") is None:
        raise ValueError(
            "the parallelized model takes input_ids (the full batch on every cube rank), not inputs_embeds"
        )
    if any(call.get(name) is not None for name in CACHE_ARGS) or call.get("use_cache"):
        raise ValueError(
            "the parallelized model keeps no KV cache: call it without cache/past_key_values and with "
            "use_cache=False (or unset)"
        )
    call["use_cache"] = False
    input_ids = call["input_ids"]
    agree_on_first_call(
        model, grid.group("cube"), "parallelized model input", input_ids=input_ids, labels=call.get("labels")
    )
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {list(input_ids.shape)}: the parallelized model takes the full batch [b, s] on every cube rank"
        )
    mask, positions = call.get("attention_mask"), call.get("position_ids")
    for name, t, dims in (("attention_mask", mask, 2), ("labels", call.get("labels"), 2)):
        _check_same_batch(name, t, input_ids, dims)
    if positions is not None and positions.shape[0] != 1:
        _check_same_batch("position_ids", positions, input_ids, 2)
    b, s = input_ids.shape
    if choose_rows(b, s, grid, model.get_input_embeddings().options.rows) == "tokens":
        _lay_out_token_rows(model, grid, call, positions_layout)
        return (), call
    if mask is not None or positions is not None:
        dtype = model.get_input_embeddings().weight.dtype
        call["attention_mask"] = attention_rows_mask(model, grid, input_ids, mask, positions, dtype)
    if _per_sequence(positions):
        call["position_ids"] = local_rows(positions, grid, positions_layout)
    return (), call


def _lay_out_token_rows(model: nn.Module, grid: Grid, call: dict, positions_layout: str) -> None:
    """The call on token rows (see the module's docstring), in place."""
    from .attention import NAME
    from .causal_mask import packed_segments

    input_ids, mask, positions = call["input_ids"], call.get("attention_mask"), call.get("position_ids")
    b, s = input_ids.shape
    implementation = model.config._attn_implementation
    if implementation != NAME:
        raise ValueError(
            f"{type(model).__name__} runs attention {implementation!r}: token rows (a batch of {b} on grid "
            f"{grid.shape}) need lightning_3d's, which parallelize installs in a model that runs 'sdpa' "
            f"(model.set_attn_implementation('sdpa') before parallelize), or whole-sequence rows: a batch that "
            f"is a multiple of {sequence_multiple(grid)}"
        )
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"attention_mask {list(mask.shape)}: token rows (a batch of {b} on grid {grid.shape}) take a padding "
            f"mask [b, s]; a 4-D mask needs whole-sequence rows: a batch that is a multiple of "
            f"{sequence_multiple(grid)}"
        )
    rows = cached_token_rows(model, b, s, grid, input_ids.device)
    full_positions = torch.arange(s, device=input_ids.device) if positions is None else positions
    full_positions = full_positions.expand(b, s)
    keys = None if mask is None or mask.all() else mask
    segments = packed_segments(full_positions) if mask is None and positions is not None else None
    call.update(
        input_ids=rows.arrange(input_ids),
        position_ids=rows.rows_of(full_positions, positions_layout),
        attention_mask=None if keys is None and segments is None else rows.attention_mask(keys, segments),
        token_rows=rows,
    )
    labels, shift_labels = call.get("labels"), call.get("shift_labels")
    if shift_labels is None and labels is not None:
        shift_labels = shift_labels_of(labels)
    if shift_labels is not None:
        call["shift_labels"] = rows.arrange(shift_labels)


def attention_input_as_y_batch(
    attention: nn.Module, args: tuple, kwargs: dict, *, grid: Grid
) -> tuple[tuple, dict]:
    """Forward pre-hook of an attention that views its projections with its input's batch (Llama's).

    The input is z-layout ``[b/(px·py), s, h/pz]``, the projections' outputs are y-layout
    ``[b/(px·pz), s, ·]``. The input is passed on as a view of the same elements shaped
    ``[b/(px·pz), s, h/py]``, so that the attention's reshapes see the y-layout batch; the
    projections view it back (:func:`projection_input_as_z`). A no-op when ``py = pz``. ``h/py`` is
    whole: transformers requires the heads to divide ``h``, and the plan requires py to divide the heads.
    """
    bound = inspect.signature(attention.forward).bind(*args, **kwargs)
    call = dict(bound.arguments)
    call.update(call.pop("kwargs", {}))
    x = call["hidden_states"]
    py, pz = grid.size("y"), grid.size("z")
    call["hidden_states"] = x.reshape(x.shape[0] * py // pz, x.shape[1], x.shape[2] * pz // py)
    return (), call


def projection_input_as_z(projection: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of a projection after :func:`attention_input_as_y_batch`: its z-layout input back."""
    (x,) = args
    return (x.reshape(-1, x.shape[1], projection.in_features // projection.grid.size("z")),)


def causal_lm_loss_3d(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    *,
    grid: Grid,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    runtime: Runtime | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' causal-LM loss on y-layout logits ``[b/(px·pz), s, V'/py]`` and full labels ``[b, s]``.

    Labels are shifted as transformers shifts them (position ``t`` predicts label ``t+1``; the last
    position is ignored) unless ``shift_labels`` is given. The mean over non-ignored tokens, or
    their sum over ``num_items_in_batch`` when given; the same scalar on every cube rank. Labels
    outside the vocabulary raise, as the open token checks of the model's ``runtime`` close (at once
    without); its options' ``compile`` runs the local passes over the logits through ``torch.compile``.
    """
    if shift_labels is None:
        shift_labels = shift_labels_of(labels, ignore_index)
    loss = vocab_parallel_cross_entropy(
        logits,
        shift_labels.to(logits.device),
        ignore_index,
        grid,
        vocab_size,
        compiled=runtime is not None and runtime.options.compile,
        deferred=None if runtime is None else runtime.token_checks,
    )
    if num_items_in_batch is not None:
        loss = loss * (shift_labels != ignore_index).sum() / num_items_in_batch
    return loss
