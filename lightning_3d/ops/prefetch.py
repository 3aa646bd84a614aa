"""WeightPrefetch: each weight's all-gather started one 3-D product ahead."""

from __future__ import annotations

import torch

from .. import comm


class WeightPrefetch:
    """While active, starts the all-gather of the next weight as soon as the current one is gathered.

    Use it as a context manager around forward passes (``with prefetch: loss = model(x)``), or
    :meth:`attach` it to a model to enter it around every forward. The first forward
    records the order in which the 3-D products gather their operand B when it is a parameter
    (or a view of one); from then on, gathering weight k also starts the gather of weight k+1,
    so that its communication hides behind product k instead of delaying product k+1. A
    prefetched weight is used only while it is the same version of the same storage in the same
    dtype (an in-place change in between, as an optimizer step makes, discards it; a change
    through ``.data`` bumps no version and would go unseen). One is held at a time, costing one
    gathered weight of memory; results are bit-identical.
    """

    def __init__(self):
        self._order: list[tuple[torch.Tensor, object]] = []
        self._position: dict[tuple, int] = {}
        self._ahead: tuple | None = None  # (key, version, dtype, gathered, handle)
        self._outer: list[WeightPrefetch | None] = []

    def __enter__(self) -> WeightPrefetch:
        global _active_prefetch
        self._outer.append(_active_prefetch)
        _active_prefetch = self
        return self

    def __exit__(self, *exc) -> None:
        global _active_prefetch
        _active_prefetch = self._outer.pop()
        self._drop()

    def attach(self, module: torch.nn.Module) -> WeightPrefetch:
        """Be active during every forward of ``module`` (forward hooks); returns ``self``."""
        def enter(mod, args) -> None:
            self.__enter__()

        def leave(mod, args, out) -> None:
            self.__exit__()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return self

    def _drop(self) -> None:
        if self._ahead is not None:  # unused: let the stream finish with its buffer first
            self._ahead[4].wait()
            self._ahead = None

    def gather(self, w: torch.Tensor, group, dtype: torch.dtype | None):
        """``all_gather_dim0(w.to(dtype), group, async_op=True)``, served from the prefetch when it matches."""
        key = _storage_key(w)
        ahead = self._ahead
        if ahead is not None and ahead[:3] == (key, w._version, dtype):
            self._ahead = None
            gathered = ahead[3:]
        else:
            self._drop()
            gathered = comm.all_gather_dim0(w.to(dtype or w.dtype), group, async_op=True)
        if key not in self._position:
            self._position[key] = len(self._order)
            self._order.append((w, group))
        following = self._position[key] + 1
        if following < len(self._order):
            w_next, group_next = self._order[following]
            gathered_next = comm.all_gather_dim0(w_next.to(dtype or w_next.dtype), group_next, async_op=True)
            self._ahead = (_storage_key(w_next), w_next._version, dtype) + gathered_next
        return gathered


_active_prefetch: WeightPrefetch | None = None


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def active_prefetch() -> WeightPrefetch | None:
    """The innermost active :class:`WeightPrefetch`, or None."""
    return _active_prefetch
