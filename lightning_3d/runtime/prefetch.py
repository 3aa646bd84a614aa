"""WeightPrefetch: each weight's all-gather started ``depth`` (default four) 3-D products ahead, in forward
and in backward.

One belongs to a model (its :class:`~lightning_3d.runtime.Runtime`); the products of the model's
layers reach it through the runtime they are handed.
"""

from __future__ import annotations

import itertools

import torch

from .. import comm
from ..arguments import positive_int
from ..options import RuntimeOptions


class _GatherOrder:
    """The order one pass gathers weights in, recorded the first time, and the gathers started
    for the ``depth`` weights that come next, ``together`` at a time."""

    def __init__(self, depth: int, together: int, streams: comm.SideStreams):
        self.depth, self.together, self.streams = depth, together, streams
        self.order: list[tuple[torch.Tensor, object]] = []
        self.position: dict[tuple, int] = {}
        self.ahead: list[tuple] = []  # (position, key, version, dtype, gathered, handle), in order

    def drop(self) -> None:
        for entry in self.ahead:  # unused: let the stream finish with its buffer first
            entry[5].wait()
        self.ahead = []

    def gather(self, w: torch.Tensor, group, dtype: torch.dtype | None):
        key = _storage_key(w)
        if key not in self.position:
            self.position[key] = len(self.order)
            self.order.append((w, group))
        here = self.position[key]
        if self.ahead and self.ahead[0][1:4] == (key, w._version, dtype):
            gathered = self.ahead.pop(0)[4:]
        else:  # nothing usable in flight (a pass's first weight): this one alone, not its whole run
            self.drop()
            (gathered,) = _start_gathers([(w, group)], dtype, self.streams)
        started = {entry[0] for entry in self.ahead}
        for following in range(here + 1, min(here + 1 + self.depth, len(self.order))):
            if following not in started:
                started |= self._start(following, dtype)
        return gathered

    def _start(self, position: int, dtype: torch.dtype | None) -> set[int]:
        """Start the gathers of ``position`` and of the positions after it to the end of its run of
        ``together``; returns the positions started."""
        end = min((position // self.together + 1) * self.together, len(self.order))
        items = self.order[position:end]
        for offset, ((w, _), gathered) in enumerate(zip(items, _start_gathers(items, dtype, self.streams))):
            self.ahead.append(_fetched_ahead(position + offset, w, dtype, gathered))
        return set(range(position, position + len(items)))

    def hold_if_first(self, w: torch.Tensor, dtype: torch.dtype | None, gathered: tuple) -> None:
        """Keep ``gathered`` (``w`` gathered in ``dtype``, with its handle) as fetched ahead when
        ``w`` is the first weight of this pass's order and nothing else is."""
        if not self.ahead and self.order and _storage_key(w) == _storage_key(self.order[0][0]):
            self.ahead.append(_fetched_ahead(0, w, dtype, gathered))


class WeightPrefetch:
    """Starts the all-gathers of the next ``depth`` weights as soon as the current one is gathered.

    :meth:`attach` it to a model: it serves the 3-D products of the model's layers, and its hooks
    mark each forward of the model. The first forward records the order in which the products
    gather their operand B when it is a parameter (or a view of one); from then on, gathering
    weight k also starts the gathers of weights k+1 … k+``depth`` not yet started, so that their
    communication hides behind product k (and, for ``depth`` > 1, the ones after it) instead of
    delaying the products that need them. Two ahead hides a large weight's gather (an MLP's)
    behind the products before it, not only the one before it, which is small (attention's output
    projection); the defaults, four ahead started four at a time, gather a GPT or Llama block's
    four weights at once while the block before runs. Products that re-gather their weight in
    backward (``save_gathered=False``) do the same there, in backward's own order, as FSDP
    prefetches its backward all-gathers: the backward after a forward of the model is served by
    its prefetch, for the weights its forwards gathered.

    A prefetched weight is used only while it is the same version of the same storage in the same
    dtype (an in-place change in between, as an optimizer step makes, discards it; a change
    through ``.data`` bumps no version and would go unseen), so results are bit-identical. Up to
    ``depth`` are held at a time in each pass, costing as many gathered weights of memory; between
    forward and backward, the one backward needs first.

    ``together`` > 1 starts the gathers of the recorded order's positions ``[k·together,
    (k+1)·together)`` as one collective, one all-gather of their concatenation
    (:func:`~lightning_3d.comm.all_gather_dim0_together`), as FSDP gathers a block's weights at
    once: the ranks meet once for each run instead of once for each weight. With as many weights
    a block as ``together``, and ``depth`` = ``together``, the next block's weights are gathered
    while the current block runs, FSDP's scheme; runs start at the order's first weight, so they
    follow the blocks where no other weight comes first.

    A parallelized model makes its own from ``RuntimeOptions.prefetch``, ``prefetch_depth`` and
    ``gathered_together`` (:class:`~lightning_3d.runtime.Runtime`), handing it the runtime's
    ``streams`` (:class:`~lightning_3d.comm.SideStreams`, on which its gathers cast and copy out
    on CUDA); without them it keeps streams of its own.
    """

    def __init__(
        self,
        depth: int = RuntimeOptions.prefetch_depth,
        together: int = RuntimeOptions.gathered_together,
        streams: comm.SideStreams | None = None,
    ):
        depth = _check_count(
            "depth", depth, "how many weights are gathered ahead", RuntimeOptions.prefetch_depth
        )
        together = _check_count(
            "together",
            together,
            "how many consecutive weights start their gathers as one collective",
            RuntimeOptions.gathered_together,
        )
        self.depth, self.together = depth, together
        self.streams = streams if streams is not None else comm.SideStreams()
        self._forward = _GatherOrder(depth, together, self.streams)
        self._backward = _GatherOrder(depth, together, self.streams)
        self._forwards = 0  # forwards of the model entered and not yet left
        self._served_forward = False  # a forward ended: backward's re-gathers are served

    def __enter__(self) -> WeightPrefetch:
        """A forward of the model starts (nested forwards count once)."""
        if not self._forwards:
            self._backward.drop()  # a backward left unfinished: free what it fetched ahead
            self._served_forward = False
        self._forwards += 1
        return self

    def __exit__(self, *exc) -> None:
        self._forwards -= 1
        if not self._forwards:
            self._forward.drop()
            self._served_forward = True

    def attach(self, module: torch.nn.Module) -> WeightPrefetch:
        """Serve the 3-D products of every 3-D layer of ``module`` and mark each of its forwards
        (forward hooks); returns ``self``."""
        for runtime in {id(m.runtime): m.runtime for m in module.modules() if hasattr(m, "runtime")}.values():
            runtime.prefetch = self

        def enter(mod, args) -> None:
            self.__enter__()

        def leave(mod, args, out) -> None:
            self.__exit__()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return self

    def gather_in(self, forward: bool):
        """The gather a product of B as a parameter calls now: :meth:`gather` inside a forward of
        the model, :meth:`regather` in the backward after one, None otherwise (a block recomputed
        in backward, a product before the first forward ends)."""
        if self._forwards:
            return self.gather if forward else None
        return self.regather if self._served_forward and not forward else None

    def gather(self, w: torch.Tensor, group, dtype: torch.dtype | None):
        """``all_gather_dim0(w.to(dtype), group, async_op=True)`` in forward, served from the prefetch
        when it matches. The weight backward re-gathers first (the last product's, the LM head's)
        is kept from forward instead, as FSDP keeps its root's parameters gathered."""
        gathered = self._forward.gather(w, group, dtype)
        self._backward.hold_if_first(w, dtype, gathered)
        return gathered

    def regather(self, w: torch.Tensor, group, dtype: torch.dtype | None):
        """The same in backward, for a product that did not keep its gathered weight. A weight
        this prefetch's forward did not gather is gathered plainly."""
        if _storage_key(w) not in self._forward.position:
            return _start_gathers([(w, group)], dtype, self.streams)[0]
        return self._backward.gather(w, group, dtype)


def _start_gathers(
    items: list[tuple[torch.Tensor, object]], dtype: torch.dtype | None, streams: comm.SideStreams
) -> list[tuple]:
    """``(gathered, handle)`` of each ``(w, group)``: ``w`` in ``dtype`` all-gathered over
    ``group``, asynchronously (on CUDA, beside the caller's stream on ``streams``); consecutive
    weights of one group as one collective."""
    out = []
    for group, run in itertools.groupby(items, key=lambda item: item[1]):
        gathered, handle = comm.all_gather_dim0_together([w for w, _ in run], group, dtype, streams=streams)
        out += [(g, handle) for g in gathered]
    return out


def _check_count(name: str, value: object, meaning: str, default: int) -> int:
    try:
        return positive_int(value, name)
    except ValueError:
        raise ValueError(
            f"WeightPrefetch({name}={value!r}): {name} is {meaning}, an int >= 1 (default {default})"
        ) from None


def _fetched_ahead(position: int, w: torch.Tensor, dtype: torch.dtype | None, gathered: tuple) -> tuple:
    """What a pass holds of a weight fetched ahead: ``(position, key, version, dtype, gathered, handle)``."""
    return (position, _storage_key(w), w._version, dtype) + tuple(gathered)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
