"""MatmulSchedule: how one 3-D product runs, fixed when the product is called."""

from __future__ import annotations

from typing import NamedTuple

import torch


class MatmulSchedule(NamedTuple):
    """What one 3-D matmul does.

    Fields: its ``form`` (``"ab"``, ``"abt"``, ``"atb"``); the ``groups`` it gathers A over, gathers
    B over and reduce-scatters C over, and their ``sizes``; whether it keeps the gathered operands
    for backward (``save_gathered``); the dtype autocast multiplies in (``cast``, None: autocast is
    off); whether B is a parameter (``b_is_parameter``: gathered through the model's
    :class:`~lightning_3d.runtime.WeightPrefetch`, and cast again in backward rather than kept as a
    cast copy); whether dB's reduce-scatter is left for the end of backward (``grads_at_end``: B
    handed out by the model's :class:`~lightning_3d.runtime.WeightGradsAtEnd`) and how many such
    reduce-scatters of consecutive products start as one collective (``grads_together``); whether
    the gathers and scatters next to a product run as collective matmuls (``async_tp``).
    """

    form: str
    groups: tuple
    sizes: tuple[int, int, int]
    save_gathered: bool
    cast: torch.dtype | None
    b_is_parameter: bool
    grads_at_end: bool
    grads_together: int
    async_tp: bool

    @property
    def recasts_b(self) -> bool:
        """Backward casts B again from the parameter instead of keeping a cast copy. B gathered over
        a group of one is that copy; a parameter is kept alive anyway, and the cast costs a fraction
        of a millisecond."""
        return self.b_is_parameter and (not self.save_gathered or self.sizes[1] == 1)
