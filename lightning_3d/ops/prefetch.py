"""WeightPrefetch: each weight's all-gather started one 3-D product ahead, in forward and in backward."""

from __future__ import annotations

import torch

from .. import comm


class _GatherOrder:
    """The order one pass gathers weights in, recorded the first time, and the gather started
    for the weight that comes next."""

    def __init__(self):
        self.order: list[tuple[torch.Tensor, object]] = []
        self.position: dict[tuple, int] = {}
        self.ahead: tuple | None = None  # (key, version, dtype, gathered, handle)

    def drop(self) -> None:
        if self.ahead is not None:  # unused: let the stream finish with its buffer first
            self.ahead[4].wait()
            self.ahead = None

    def gather(self, w: torch.Tensor, group, dtype: torch.dtype | None):
        key = _storage_key(w)
        ahead = self.ahead
        if ahead is not None and ahead[:3] == (key, w._version, dtype):
            self.ahead = None
            gathered = ahead[3:]
        else:
            self.drop()
            gathered = _start_gather(w, group, dtype)
        if key not in self.position:
            self.position[key] = len(self.order)
            self.order.append((w, group))
        following = self.position[key] + 1
        if following < len(self.order):
            w_next, group_next = self.order[following]
            self.ahead = _fetched_ahead(w_next, dtype, _start_gather(w_next, group_next, dtype))
        return gathered

    def hold_if_first(self, w: torch.Tensor, dtype: torch.dtype | None, gathered: tuple) -> None:
        """Keep ``gathered`` (``w`` gathered in ``dtype``, with its handle) as fetched ahead when
        ``w`` is the first weight of this pass's order and nothing else is."""
        if self.ahead is None and self.order and _storage_key(w) == _storage_key(self.order[0][0]):
            self.ahead = _fetched_ahead(w, dtype, gathered)


class WeightPrefetch:
    """While active, starts the all-gather of the next weight as soon as the current one is gathered.

    Use it as a context manager around forward passes (``with prefetch: loss = model(x)``), or
    :meth:`attach` it to a model to enter it around every forward. The first forward records the
    order in which the 3-D products gather their operand B when it is a parameter (or a view of
    one); from then on, gathering weight k also starts the gather of weight k+1, so that its
    communication hides behind product k instead of delaying product k+1. Products that re-gather
    their weight in backward (``save_gathered=False``) do the same there, in backward's own order,
    as FSDP prefetches its backward all-gathers: the backward after a forward is served by the
    prefetch that was active last (for the weights its forwards gathered), until another forward
    enters one.

    A prefetched weight is used only while it is the same version of the same storage in the same
    dtype (an in-place change in between, as an optimizer step makes, discards it; a change
    through ``.data`` bumps no version and would go unseen), so results are bit-identical. One is
    held at a time in each pass, costing one gathered weight of memory; between forward and
    backward, the one backward needs first.
    """

    def __init__(self):
        self._forward, self._backward = _GatherOrder(), _GatherOrder()
        self._outer: list[WeightPrefetch | None] = []

    def __enter__(self) -> WeightPrefetch:
        global _active_prefetch, _backward_prefetch
        self._outer.append(_active_prefetch)
        _active_prefetch = self
        if _backward_prefetch is not None:  # a backward left unfinished: free what it fetched ahead
            _backward_prefetch._backward.drop()
        _backward_prefetch = None
        return self

    def __exit__(self, *exc) -> None:
        global _active_prefetch, _backward_prefetch
        _active_prefetch = self._outer.pop()
        self._forward.drop()
        _backward_prefetch = self

    def attach(self, module: torch.nn.Module) -> WeightPrefetch:
        """Be active during every forward of ``module`` (forward hooks); returns ``self``."""
        def enter(mod, args) -> None:
            self.__enter__()

        def leave(mod, args, out) -> None:
            self.__exit__()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return self

    def gather(self, w: torch.Tensor, group, dtype: torch.dtype | None):
        """``all_gather_dim0(w.to(dtype), group, async_op=True)`` in forward, served from the prefetch
        when it matches. The weight backward re-gathers first (the last product's, the LM head's)
        is kept from forward instead, as FSDP keeps its root's parameters gathered."""
        gathered = self._forward.gather(w, group, dtype)
        self._backward.hold_if_first(w, dtype, gathered)
        return gathered

    def regather(self, w: torch.Tensor, group, dtype: torch.dtype | None):
        """The same in backward, for a product that did not keep its gathered weight. A weight
        this prefetch's forward did not gather (another model's) is gathered plainly."""
        if _storage_key(w) not in self._forward.position:
            return _start_gather(w, group, dtype)
        return self._backward.gather(w, group, dtype)


_active_prefetch: WeightPrefetch | None = None
_backward_prefetch: WeightPrefetch | None = None


def _start_gather(w: torch.Tensor, group, dtype: torch.dtype | None) -> tuple:
    """``(gathered, handle)``: ``w`` in ``dtype`` all-gathered over ``group``, asynchronously."""
    return comm.all_gather_dim0(w.to(dtype or w.dtype), group, async_op=True)


def _fetched_ahead(w: torch.Tensor, dtype: torch.dtype | None, gathered: tuple) -> tuple:
    """What a pass holds of a weight fetched ahead: ``(key, version, dtype, gathered, handle)``."""
    return (_storage_key(w), w._version, dtype) + tuple(gathered)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def active_prefetch() -> WeightPrefetch | None:
    """The innermost active :class:`WeightPrefetch`, or None."""
    return _active_prefetch


def backward_prefetch() -> WeightPrefetch | None:
    """The :class:`WeightPrefetch` that serves backward's re-gathers: the one whose forward ended
    last, unless a forward is running."""
    return _backward_prefetch
