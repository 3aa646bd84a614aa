"""A plan's attention entries: a model parallelized by a plan runs on token rows, its own code unchanged.

``Plan(rules, attention={"blocks.*.attn": Attention(rope=("cos", "sin"), masks=("mask",))})`` names
the modules that compute causal self-attention over the model's sequences and says how their core
attention is called. A batch that whole-sequence rows do not split (not a multiple of
``lcm(px·py, px·pz)``, batch 1 included; or ``RuntimeOptions(rows="tokens")``) then runs on token
rows (:mod:`lightning_3d.token_rows`): each sequence cut into ``C`` chunk rows of ``s/C`` tokens.
:func:`lay_out_token_rows` gives the model hooks that lay each forward out, where the model's code
stays the dense model's (ids, positions, RoPE tables and masks of whole sequences ``[b, s]``):

- the token embedding (each ``VocabEmbedding`` layer) picks the rows of its ids ``[b, s]``
  (:func:`~lightning_3d.token_rows.choose_rows`), records them as the runtime's ``token_rows`` for
  the rest of the forward and, on token rows, embeds the arranged ids ``[b·C, s/C]``;
- a ``PositionEmbedding`` layer takes positions ``[s]``, ``[1, s]`` or ``[b, s]`` and embeds those
  of this rank's z rows, on token rows each token's true position;
- a named attention module gets each RoPE table and mask it takes (:attr:`Attention.rope`,
  :attr:`Attention.masks`) as its rows' own, and on token rows its core attention runs over whole
  sequences
  (:meth:`TokenRows.sdpa <lightning_3d.token_rows.TokenRows.sdpa>`: this rank's queries against the
  keys and values of each sequence, gathered over the ``"xz"`` group);
- a ``Loss`` layer takes one target per token ``[b, s]`` (the next token: labels shifted before
  the model, never logits sliced) and, on token rows, arranges them as the ids.

A table, mask or position ids with a leading dim above 1 is taken as the whole batch's: on
whole-sequence rows it is cut to this rank's rows too, so the model's code passes the same
tensors on either kind of rows.

A plan that names no attention runs on whole sequences only: its token embedding refuses a batch
that needs token rows, and ``RuntimeOptions(rows="tokens")``, naming the multiple and the fix (the
built-in plans of ``DenseGPT`` and the Hugging Face models lay out token rows in their own code and
hand the embedding arranged rows: ``Plan.rows_in_model``, which gets none of these hooks).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..grid import Grid
from ..layers import CrossEntropyLoss3D, PositionEmbedding3D, VocabParallelEmbedding3D
from ..runtime import Runtime
from ..token_rows import TokenRows, cached_token_rows, choose_rows, local_rows, sequence_multiple


@dataclass(frozen=True)
class Attention:
    """A plan's word that a module computes causal self-attention over the model's sequences
    (``Plan.attention``, by module-name pattern), as the dense model's code computes it.

    Args:
        core: how its core attention is called. None (default): the module's forward calls
            ``torch.nn.functional.scaled_dot_product_attention`` with ``q`` ``[b, heads, T, d]``,
            ``k, v`` ``[b, kv_heads, T, d]``, either ``is_causal=True`` or an ``attn_mask`` from
            ``masks``; on token rows those calls run over the split sequences (the module's forward
            then runs eagerly in a compiled block: a graph break). A name: the module's
            child (a module, as torchtitan's ``sdpa``, or a function attribute) that is its core
            attention, called with SDPA's arguments ``(q, k, v, attn_mask=None, dropout_p=0.0,
            is_causal=..., scale=None)`` and causal unless given a mask; on token rows the call runs
            over the split sequences instead, whatever the child computes (a hand-written softmax).
        rope: the names of the module's forward arguments that hold tables by position (RoPE's
            ``cos`` and ``sin``) of whole sequences, ``[≥ s, n]`` or ``[1 or b, ..., ≥ s, n]``
            (positions on dim -2): each comes as this rank's rows' own, ``[b/(px·pz), ..., s, n]``
            where it is per sequence, on token rows ``[rows, ..., s/C, n]`` (a table per row, which
            the module's RoPE broadcasts as Hugging Face's and LitGPT's ``apply_rope`` do).
        masks: the names of the module's forward arguments that hold attention masks of whole
            sequences in SDPA's form, ``[b or 1, heads or 1, s or 1, s]`` (bool, or added to the
            scores: padding, packed sequences), as the dense model builds them from its whole
            batch: each comes as this rank's y rows' (``[b/(px·pz), ...]``), on token rows its
            queries' ``[b or 1, heads or 1, s/R, s]``, the form SDPA's ``attn_mask`` takes there.
    """

    core: str | None = None
    rope: tuple[str, ...] = ()
    masks: tuple[str, ...] = ()


class _SplitSDPA(TorchFunctionMode):
    """``scaled_dot_product_attention`` calls run as attention over the sequences of token ``rows``."""

    def __init__(self, rows: TokenRows):
        super().__init__()
        self.rows = rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return split_sdpa(self.rows, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@torch.compiler.disable  # a mode entered inside a compiled block would break its graph at every op
def _with_split_sdpa(rows: TokenRows, forward, args: list, kwargs: dict):
    """``forward(*args, **kwargs)`` with its ``scaled_dot_product_attention`` calls run over the split sequences."""
    with _SplitSDPA(rows):
        return forward(*args, **kwargs)


@torch.compiler.disable  # collectives: run as they run eagerly
def split_sdpa(
    rows: TokenRows,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool | None = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """A ``scaled_dot_product_attention`` call of the dense model's code on this rank's token ``rows``
    (:meth:`TokenRows.sdpa <lightning_3d.token_rows.TokenRows.sdpa>`); ``is_causal=None``: causal unless masked."""
    if is_causal is None:
        is_causal = attn_mask is None
    return rows.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def check_attention(model: nn.Module, entries: dict[str, Attention]) -> None:
    """``ValueError`` naming the module and the fix for an entry its module cannot take (a RoPE argument
    its forward lacks, a core it does not have); ``entries``: each matched module's name and entry."""
    for name, entry in entries.items():
        module = model.get_submodule(name)
        takes = inspect.signature(module.forward).parameters
        missing = [arg for arg in entry.rope + entry.masks if arg not in takes]
        if missing:
            raise ValueError(
                f"{name} ({type(module).__name__}): Attention(rope={entry.rope}, masks={entry.masks}) names "
                f"{missing}, which its forward does not take (it takes {list(takes)}): name the arguments that "
                "hold its RoPE tables and attention masks"
            )
        if entry.core is not None and not callable(getattr(module, entry.core, None)):
            raise ValueError(
                f"{name} ({type(module).__name__}): Attention(core={entry.core!r}) names no callable attribute of "
                "it: name the child module (or function) that computes its core attention, or core=None where "
                "its forward calls torch.nn.functional.scaled_dot_product_attention"
            )


def lay_out_token_rows(model: nn.Module, entries: dict[str, Attention], grid: Grid, runtime: Runtime) -> None:
    """Give ``model`` the hooks that run it on token rows (see the module's docstring); ``entries``: its
    attention modules by name, each with its plan entry. Without any, its token embedding refuses a
    batch that needs token rows, and ``rows="tokens"``. Run before the checkpoint units wrap their
    forwards (a unit recomputed in backward runs the attention's wrapped forward on the rows its
    forward ran on)."""
    embeddings = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding3D)]
    model_name = type(model).__name__
    if not entries:
        for embedding in embeddings:
            embedding.register_forward_pre_hook(
                functools.partial(_whole_sequences_only, model_name, grid, runtime)
            )
        return
    model.register_forward_pre_hook(lambda module, args: setattr(runtime, "token_rows", None))
    for embedding in embeddings:
        embedding.register_forward_pre_hook(functools.partial(_ids_on_rows, model, grid, runtime))
    for module in model.modules():
        if isinstance(module, PositionEmbedding3D):
            module.register_forward_pre_hook(functools.partial(_positions_on_rows, grid, runtime))
        if isinstance(module, CrossEntropyLoss3D):
            module.register_forward_pre_hook(functools.partial(_targets_on_rows, runtime), with_kwargs=True)
    for name, entry in entries.items():
        _attend_on_rows(model.get_submodule(name), entry, grid, runtime)


def _whole_sequences_only(
    model_name: str, grid: Grid, runtime: Runtime, embedding: nn.Module, args: tuple
) -> None:
    """The token embedding's pre-hook where the plan names no attention: a batch must split as whole sequences."""
    b, multiple = args[0].shape[0], sequence_multiple(grid)
    if runtime.options.rows == "tokens":
        raise ValueError(
            f"{model_name} runs with RuntimeOptions(rows='tokens'), but its plan names no attention modules, "
            "whose core attention token rows split: name them in its plan (Plan(attention={'<pattern>': "
            "Attention()}), lightning_3d.parallel.Attention), or run rows='auto' (whole sequences where the "
            f"batch is a multiple of {multiple})"
        )
    if b % multiple:
        raise ValueError(
            f"{model_name}: a batch of {b} sequences does not split into whole-sequence rows on grid "
            f"{'×'.join(map(str, grid.shape))}, which need a multiple of lcm(px·py, px·pz) = {multiple}; "
            f"use a batch of {multiple * math.ceil(b / multiple)}, or name the model's attention modules in "
            "its plan (Plan(attention={'<pattern>': Attention()}), lightning_3d.parallel.Attention) to run any "
            "batch on token rows"
        )


def _ids_on_rows(model: nn.Module, grid: Grid, runtime: Runtime, embedding: nn.Module, args: tuple):
    """The token embedding's pre-hook: the rows of this forward from its ids ``[b, s]``; arranged on token rows."""
    (ids,) = args
    if ids.dim() != 2:
        raise ValueError(
            f"the token embedding of {type(model).__name__} takes ids [b, s] (the full batch on every cube rank), "
            f"got {list(ids.shape)}"
        )
    b, s = ids.shape
    if choose_rows(b, s, grid, runtime.options.rows) == "sequences":
        runtime.token_rows = None
        return None
    runtime.token_rows = cached_token_rows(model, b, s, grid, ids.device)
    return (runtime.token_rows.arrange(ids),)


def _positions_on_rows(grid: Grid, runtime: Runtime, layer: nn.Module, args: tuple):
    """A position embedding's pre-hook: positions of whole sequences, ``[s]``, ``[1, s]`` or ``[b, s]`` → this
    rank's z rows' (``[b/(px·py), s]`` of per-sequence ones; on token rows ``[rows, s/C]``)."""
    (positions,) = args
    rows = runtime.token_rows
    if rows is None:
        per_sequence = positions.dim() == 2 and positions.shape[0] > 1  # the whole batch's
        return (local_rows(positions, grid, "z"),) if per_sequence else None
    b, s = rows.batch, rows.seq_len
    if (
        positions.dim() > 2
        or positions.shape[-1] != s
        or positions.dim() == 2
        and positions.shape[0] not in (1, b)
    ):
        raise ValueError(
            f"positions {list(positions.shape)}: on token rows (a batch of {b} sequences of {s} tokens) a "
            f"PositionEmbedding takes the positions of whole sequences, [{s}], [1, {s}] or [{b}, {s}]"
        )
    return (rows.rows_of(positions.expand(b, s), "z"),)


def _targets_on_rows(runtime: Runtime, loss: nn.Module, args: tuple, kwargs: dict):
    """A loss's pre-hook: on token rows, one target per token ``[b, s]`` (or flattened) arranged as the ids."""
    rows = runtime.token_rows
    if rows is None:
        return None
    call = {**dict(zip(("logits", "targets"), args)), **kwargs}
    logits, targets = call["logits"], call["targets"]
    b, s = rows.batch, rows.seq_len
    if targets.numel() != b * s:
        raise ValueError(
            f"targets {list(targets.shape)}: on token rows (a batch of {b} sequences of {s} tokens, logits in rows "
            f"of {rows.length} tokens) the loss takes one target per token, [{b}, {s}] or flattened: shift the "
            "labels before the model (position t's target is token t+1, the last -100: "
            "lightning_3d.ops.sequence_split.shift_labels), not the logits"
        )
    arranged = rows.arrange(targets.reshape(b, s)).reshape(-1, *logits.shape[1:-1])
    return (logits, arranged), {}


def _attend_on_rows(module: nn.Module, entry: Attention, grid: Grid, runtime: Runtime) -> None:
    """Wrap ``module``'s forward (and its core): its RoPE tables and masks laid out for this rank's rows,
    and on token rows its core attention run over the split sequences."""
    forward = module.forward
    takes = list(inspect.signature(forward).parameters)
    places = {arg: (takes.index(arg), arg in entry.masks) for arg in entry.rope + entry.masks}

    def laid_out(t: torch.Tensor, mask: bool) -> torch.Tensor:
        rows = runtime.token_rows
        if rows is not None:
            return rows.queries_of(t) if mask else rows.table_rows(t)
        per_sequence = t.dim() > 2 and t.shape[0] > 1  # the whole batch's: this rank's y rows
        return local_rows(t, grid, "y") if per_sequence else t

    @functools.wraps(forward)
    def attention_forward(*args, **kwargs):
        args = list(args)
        for arg, (place, mask) in places.items():
            if place < len(args):
                args[place] = None if args[place] is None else laid_out(args[place], mask)
            elif kwargs.get(arg) is not None:
                kwargs[arg] = laid_out(kwargs[arg], mask)
        if runtime.token_rows is None or entry.core is not None:
            return forward(*args, **kwargs)
        return _with_split_sdpa(runtime.token_rows, forward, args, kwargs)

    module.forward = attention_forward
    if entry.core is not None:
        _core_on_rows(module, entry.core, runtime)


def _core_on_rows(module: nn.Module, core: str, runtime: Runtime) -> None:
    """Wrap ``module``'s core attention ``core`` (a child module's forward, or a function attribute)."""
    target = getattr(module, core)
    call = target.forward if isinstance(target, nn.Module) else target

    @functools.wraps(call)
    def core_on_rows(*args, **kwargs):
        rows = runtime.token_rows
        if rows is None:
            return call(*args, **kwargs)
        if len(args) < 6:  # is_causal not given by position: causal unless masked
            kwargs.setdefault("is_causal", None)
        return split_sdpa(rows, *args, **kwargs)

    if isinstance(target, nn.Module):
        target.forward = core_on_rows
    else:
        setattr(module, core, core_on_rows)
