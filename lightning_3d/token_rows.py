"""Token rows: activation rows that hold chunks of sequences, so that any batch runs on a grid.

A layout cuts the rows (dim 0) of an activation over its row group: the ``px·py`` ranks of
``(x, y)`` in the z-layout, the ``px·pz`` of ``(x, z)`` in the y-layout (:mod:`lightning_3d.layout`).
With whole sequences as rows, a batch must be a multiple of ``lcm(px·py, px·pz)``
(:func:`sequence_multiple`). Token rows cut each of the ``b`` sequences of ``s`` tokens into
``C`` = :func:`chunks_per_sequence` chunks and make the ``b·C`` chunks the rows: ``[b, s, ...]`` →
``[b·C, s/C, ...]``. Their order gives y-layout rank ``r`` of ``R = px·pz`` (row block ``r``, the
rank's place in the ``"xz"`` group) the zig-zag chunks ``r`` and ``2R-1-r`` of ``2R`` of every
sequence (:mod:`~lightning_3d.ops.sequence_split`: equal causal work on every rank), each as
``C / (2R)`` consecutive rows. ``C = lcm(2R, px·py)`` makes the rows split in both layouts for any
``b``, batch 1 included; ``s`` must be a multiple of ``C``.

Everything but attention works token by token, so only attention and positions know: attention
in the y-layout gathers the keys and values of the rank's sequences over the ``"xz"`` group
(:func:`~lightning_3d.ops.split_attention.split_causal_attention`; with a mask, e.g. padding or
packed sequences, :meth:`TokenRows.attention_mask`, or attention dropout: one SDPA call over the
gathered keys), and :meth:`TokenRows.positions` gives each local token its true position (RoPE,
learned positions; :meth:`TokenRows.rows_of` cuts any per-token tensor, such as a caller's
position ids, the same way). Losses are means over tokens, so the order of the rows does not
change them; targets are arranged like the ids.

:func:`choose_rows` is the one rule that picks whole sequences or token rows (whole sequences
where the batch allows them: they need no communication in attention), unless
``RuntimeOptions.rows`` forces one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .arguments import choice
from .grid import Grid
from .ops.sequence_split import chunks_of
from .ops.split_attention import gather_sequence, split_causal_attention
from .options import ROWS_CHOICES

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sequence_multiple(grid: Grid) -> int:
    """Whole-sequence rows need a batch that is a multiple of this: ``lcm(px·py, px·pz)``."""
    px, py, pz = grid.shape
    return math.lcm(px * py, px * pz)


def local_rows(t: torch.Tensor, grid: Grid, layout: str) -> torch.Tensor:
    """This rank's block of the rows ``t`` ``[N, ...]`` (in order) in ``layout``: block ``rank_in("xy")`` of
    ``px·py`` (``"z"``) or ``rank_in("xz")`` of ``px·pz`` (``"y"``)."""
    axes = "xy" if layout == "z" else "xz"
    return t.chunk(grid.size(axes))[grid.rank_in(axes)]


def chunks_per_sequence(grid: Grid) -> int:
    """Token rows cut each sequence into this many rows: ``lcm(2·px·pz, px·py)``."""
    px, py, pz = grid.shape
    return math.lcm(2 * px * pz, px * py)


def choose_rows(batch: int, seq_len: int, grid: Grid, rows: str = "auto") -> str:
    """``"sequences"`` or ``"tokens"``: how the rows of a ``[batch, seq_len]`` input split on ``grid``.

    ``"auto"`` takes whole sequences where ``batch`` is a multiple of :func:`sequence_multiple`,
    else token rows; ``rows`` forces either. ``ValueError`` naming the multiples and the fixes when
    the chosen form does not split.
    """
    choice(rows, "rows", ROWS_CHOICES)
    shape = "×".join(map(str, grid.shape))
    whole, chunks = sequence_multiple(grid), chunks_per_sequence(grid)
    if rows == "sequences" or (rows == "auto" and batch % whole == 0):
        if batch % whole:
            raise ValueError(
                f"on grid {shape}, whole-sequence rows need a batch that is a multiple of lcm(px·py, px·pz) = "
                f"{whole}, got {batch}; use a batch of {whole * math.ceil(batch / whole)}, or "
                "RuntimeOptions(rows='auto') for token rows"
            )
        return "sequences"
    if seq_len % chunks:
        raise ValueError(
            f"on grid {shape}, a batch of {batch} sequences of {seq_len} tokens does not split: token rows need a "
            f"sequence length that is a multiple of lcm(2·px·pz, px·py) = {chunks} (pad each sequence to "
            f"{chunks * math.ceil(seq_len / chunks)} tokens, with ignored targets after its end), and whole-sequence "
            f"rows a batch that is a multiple of {whole}"
        )
    return "tokens"


class TokenRows:
    """The token rows of a ``[batch, seq_len]`` input on ``grid`` (see the module's docstring).

    ``C`` = :func:`chunks_per_sequence` rows of ``seq_len / C`` tokens per sequence; the ``b·C``
    rows in zig-zag order over the y-layout's ``R = px·pz`` row blocks.
    """

    def __init__(self, batch: int, seq_len: int, grid: Grid, device: torch.device | str | None = None):
        px, py, pz = grid.shape
        ranks, chunks = px * pz, chunks_per_sequence(grid)
        if seq_len % chunks:
            raise ValueError(
                f"token rows need seq_len a multiple of {chunks} on grid {grid.shape}, got {seq_len}"
            )
        self.grid, self.batch, self.seq_len, self.chunks = grid, batch, seq_len, chunks
        self.length = seq_len // chunks  # tokens a row
        per_half = chunks // (2 * ranks)  # rows a zig-zag chunk
        order = [
            seq * chunks + half * per_half + sub
            for r in range(ranks)
            for seq in range(batch)
            for half in chunks_of(r, ranks)
            for sub in range(per_half)
        ]
        self.order = torch.tensor(
            order, device=device
        )  # row k of the arranged input is row order[k] of [b·C, s/C]
        self._positions = self.arrange(torch.arange(seq_len, device=device).expand(batch, seq_len))

    def arrange(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, s, ...]`` → the rows ``[b·C, s/C, ...]`` in token-row order (ids, targets, masks)."""
        rows = t.reshape(self.batch * self.chunks, self.length, *t.shape[2:])
        return rows.index_select(0, self.order.to(t.device))

    def restore(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`arrange`: full rows ``[b·C, s/C, ...]`` → ``[b, s, ...]``."""
        out = torch.empty_like(rows).index_copy_(0, self.order.to(rows.device), rows)
        return out.reshape(self.batch, self.seq_len, *rows.shape[2:])

    def rows_of(self, t: torch.Tensor, layout: str) -> torch.Tensor:
        """``[b, s, ...]`` → this rank's rows ``[rows, s/C, ...]`` in ``layout`` (``"z"`` or ``"y"``)."""
        return self._block(self.arrange(t), layout)

    def positions(self, layout: str) -> torch.Tensor:
        """The true positions ``[rows, s/C]`` (int64) of this rank's rows in ``layout`` (``"z"`` or ``"y"``)."""
        return self._block(self._positions, layout)

    def _block(self, arranged: torch.Tensor, layout: str) -> torch.Tensor:
        """This rank's row block in ``layout`` of arranged rows ``[b·C, s/C, ...]``."""
        return local_rows(arranged, self.grid, layout)

    def rope(self, tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables ``[≥ s, n]`` → each y-layout row's own ``[rows, s/C, n]`` (attention's layout)."""
        return tuple(self.table_rows(t) for t in tables)

    def table_rows(self, table: torch.Tensor) -> torch.Tensor:
        """A table by position (RoPE's cos or sin), ``[≥ s, n]`` or ``[1 or b, ..., ≥ s, n]`` (positions on
        dim -2, the same for every sequence or each its own) → each y-layout row's own
        ``[rows, s/C, n]`` or ``[rows, ..., s/C, n]``."""
        b, s = self.batch, self.seq_len
        if table.dim() < 2 or table.shape[-2] < s or (table.dim() > 2 and table.shape[0] not in (1, b)):
            raise ValueError(
                f"a table by position {list(table.shape)}: token rows of {b} sequences of {s} tokens take "
                f"[≥ {s}, n] or [1 or {b}, ..., ≥ {s}, n] (positions on dim -2)"
            )
        table = table.narrow(-2, 0, self.seq_len)
        if all(n == 1 for n in table.shape[:-2]):  # the same positions in every sequence: look them up
            rows = table.reshape(self.seq_len, -1)[self.positions("y").to(table.device)]  # [rows, s/C, n]
            return rows.view(rows.shape[0], *table.shape[1:-2], self.length, -1)
        per_sequence = table.expand(self.batch, *table.shape[1:]).movedim(-2, 1)  # [b, s, ..., n]
        return self.rows_of(per_sequence, "y").movedim(1, -2)

    def queries_of(self, mask: torch.Tensor) -> torch.Tensor:
        """An attention mask of whole sequences in SDPA's form, ``[..., s or 1, s]`` (leading dims broadcast,
        the first 1 or b; bool, or added to the scores) → the mask of this rank's y-layout queries,
        ``[..., s/R, s]`` (:meth:`attend`'s, as :meth:`attention_mask` makes it)."""
        if (
            mask.shape[-1] != self.seq_len
            or mask.shape[-2] not in (1, self.seq_len)
            or (mask.dim() == 4 and mask.shape[0] not in (1, self.batch))
        ):
            raise ValueError(
                f"attention mask {list(mask.shape)}: token rows of {self.batch} sequences of {self.seq_len} tokens "
                f"take a mask of whole sequences, [{self.batch} or 1, heads or 1, {self.seq_len} or 1, {self.seq_len}] "
                "(queries by keys; build it from the model's whole input)"
            )
        if mask.shape[-2] == 1:
            return mask
        queries = self.positions("y").reshape(self.batch, -1)[0]  # every sequence's local queries alike
        return mask.index_select(-2, queries.to(mask.device))

    def attention_mask(
        self, keys: torch.Tensor | None = None, segments: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The causal mask ``[b, 1, s/R, s]`` (bool, True: attends) of this rank's y-layout rows, in
        SDPA's form: the ``s/R`` query tokens each sequence has here (``R = px·pz``), in their local
        order, against the sequence's ``s`` keys in token order. ``keys`` ``[b, s]`` (bool) drops the
        keys that are False (padding); ``segments`` ``[b, s]`` keeps each query to the keys of its own
        segment (sequences packed in one row)."""
        queries = self.positions("y").reshape(self.batch, -1)  # [b, s/R]: each local query's index
        allowed = torch.arange(self.seq_len, device=queries.device) <= queries[..., None]
        if keys is not None:
            allowed = allowed & keys.bool()[:, None]
        if segments is not None:
            allowed = allowed & (segments.gather(1, queries)[..., None] == segments[:, None])
        return allowed[:, None]

    @torch.compiler.disable  # collectives and the fused kernels' own autograd: run as they run eagerly
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        scale: float | None = None,
        dropout: float = 0.0,
    ) -> torch.Tensor:
        """Causal attention of this rank's y-layout rows: ``q`` ``[rows, s/C, heads, d]``, ``k, v``
        ``[rows, s/C, kv_heads, d]`` → ``[rows, s/C, heads·d]``, keys and values of each whole sequence
        gathered over the ``"xz"`` group.

        ``scale``: the scores' factor (default ``d^-0.5``). With a ``mask``
        (:meth:`attention_mask`) or ``dropout`` (the probability of dropping an attention weight), one
        SDPA call over the gathered keys and values (its mask of this rank's queries, ``s/R × s`` per
        sequence, in memory); without either, the zig-zag kernels
        (:func:`~lightning_3d.ops.split_attention.split_causal_attention`), which build no mask, or,
        where the group is one rank (``px·pz = 1``: the rank holds its sequences whole and in order),
        one causal SDPA call.
        """
        rows, length = q.shape[:2]

        def per_sequence(t):  # [b·2m, L', ...] → [b, 2m·L', ...]: chunks r and 2R-1-r of each sequence
            return t.reshape(self.batch, (rows // self.batch) * length, *t.shape[2:])

        q, k, v = per_sequence(q), per_sequence(k), per_sequence(v)
        group = self.grid.group("xz")
        if mask is None and not dropout and self.grid.size("xz") == 1:  # whole sequences here, in order
            out = F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)),
                is_causal=True,
                scale=scale,
                enable_gqa=q.shape[2] != k.shape[2],
            ).transpose(1, 2)
        elif mask is None and not dropout:
            out = split_causal_attention(q, k, v, group, scale)
        else:
            keys, values = gather_sequence(torch.stack([k, v]), group, dim=2).transpose(2, 3)  # [b, kv, s, d]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                keys,
                values,
                attn_mask=self.attention_mask() if mask is None else mask,
                dropout_p=dropout,
                scale=scale,
                enable_gqa=q.shape[2] != k.shape[2],
            ).transpose(1, 2)
        return out.reshape(rows, length, -1)

    def sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``scaled_dot_product_attention``'s call on this rank's y-layout rows: ``query`` ``[rows, heads,
        s/C, d]``, ``key``, ``value`` ``[rows, kv_heads, s/C, d]`` → ``[rows, heads, s/C, d]``, each query
        against the keys of its whole sequence (:meth:`attend`): causal (``is_causal``), or by
        ``attn_mask``, this rank's queries' mask ``[..., s/R, s]`` (:meth:`attention_mask`,
        :meth:`queries_of`). Grouped-query heads are taken as they are (``enable_gqa`` or not)."""
        if is_causal == (attn_mask is not None):
            raise ValueError(
                "attention over sequences split into token rows is causal (is_causal=True) or masked (an attn_mask "
                f"of whole sequences), one of the two; got is_causal={is_causal} and "
                f"{'no mask' if attn_mask is None else 'a mask'}"
            )
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = self.attend(q, k, v, mask=attn_mask, scale=scale, dropout=dropout_p)
        return out.unflatten(-1, (query.shape[1], -1)).transpose(1, 2)


def cached_token_rows(owner: object, batch: int, seq_len: int, grid: Grid, device: torch.device) -> TokenRows:
    """The :class:`TokenRows` of a ``[batch, seq_len]`` input on ``grid`` and ``device``, made once and kept
    on ``owner`` (a model): compiled blocks see one object per input shape."""
    made = owner.__dict__.setdefault("_token_rows", {})
    key = (batch, seq_len, str(device), id(grid))
    if key not in made:
        made[key] = TokenRows(batch, seq_len, grid, device)
    return made[key]
