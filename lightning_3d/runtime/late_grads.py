"""Weight gradients reduce-scattered beside backward and handed to autograd once, at its end.

A 3-D product whose weight B is gathered over x reduce-scatters dB back over x in its backward.
Waited for before the product's backward returns (autograd reads the gradient at once), that
reduce-scatter is exposed: the NCCL kernel cannot start while the next GEMM holds every SM, so it
runs alone while the GPU waits. A parallelized model's :class:`WeightGradsAtEnd` (one per model,
in its :class:`~lightning_3d.runtime.Runtime`; entered around every forward while
``RuntimeOptions.grads_at_end`` is on) hands each such product its weight as a view from one
autograd node made at the start of the forward; the product's backward starts
dB's reduce-scatter on a side stream (on CUDA) and gives autograd no gradient for the view; the
node's backward, which runs after every product's, makes the compute stream wait once for all of
them and hands each weight its gradient. Autograd then accumulates them as usual (so DDP's and
DeepSpeed's gradient hooks see them), as FSDP waits for its reduce-scatters once per backward.
Gradients are the same (bit-identical for a weight one product uses).

The reduce-scatters of ``together`` consecutive gradients of one group start as one collective
(:func:`~lightning_3d.comm.reduce_scatter_dim0_together`: one flat buffer, as FSDP reduce-scatters
a block's gradients) once the last of them is made; any left over start when the node runs. The
host then issues one collective a block instead of one a weight.

Gradients started and not yet handed on are held by the model's :class:`WeightGradsAtEnd` under
their weight's storage, so that a product's custom op, which sees tensors only, can leave its
gradient for the node of its weight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .. import comm

_LANDED = "_landed_view"  # on a weight inside a forward of its model: its view from the forward's node


def _key(t: torch.Tensor) -> tuple:
    """The weight a tensor views, whole: its storage, offset and size (any shape)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())


class _HandOnAtEnd(torch.autograd.Function):
    """Identity on the weights; backward gives each the gradients its products left pending,
    plus any that reached its view through autograd."""

    @staticmethod
    def forward(ctx, owner: WeightGradsAtEnd, *weights):
        ctx.owner, ctx.keys, ctx.shapes = owner, [_key(w) for w in weights], [w.shape for w in weights]
        ctx.set_materialize_grads(False)
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner.start_queued()
        started = [ctx.owner.pending.pop(key, []) for key in ctx.keys]
        for stream in {stream for entries in started for _, stream in entries if stream is not None}:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        out = []
        for grad, entries, shape in zip(grads, started, ctx.shapes):
            for shard, stream in entries:  # in the shape its product used the weight in
                if stream is not None:
                    shard.record_stream(torch.cuda.current_stream(stream.device))
                grad = shard.view(shape) if grad is None else grad + shard.view(shape)
            out.append(grad)
        return (None, *out)


class WeightGradsAtEnd:
    """One model's gathered-weight gradients: their reduce-scatters started beside backward and
    waited for once, at its end (see the module's docstring).

    Around each forward of the model, :meth:`handing_out` the weights its 3-D products gather over
    x (of a group larger than one). A weight the forward does not use as such gets its gradients
    from autograd as before.
    """

    def __init__(self, streams: comm.SideStreams):
        self.streams = streams  # the model's: the reduce-scatters run on its "weight gradients" stream
        # gradients started and not handed on yet, by weight storage: [(shard, side stream)]
        self.pending: dict[tuple, list[tuple[torch.Tensor, torch.cuda.Stream | None]]] = {}
        self.queued: list[
            tuple[torch.Tensor, object, torch.Tensor]
        ] = []  # (gathered gradient, group, weight), not started

    @contextlib.contextmanager
    def handing_out(self, weights: Iterable[nn.Parameter]) -> Iterator[None]:
        """One forward: each of ``weights`` (that requires grad) carries its view from a new node."""
        weights = [w for w in weights if w.requires_grad]
        outer = [(w, getattr(w, _LANDED, None)) for w in weights]
        keys = {_key(w) for w in weights}
        for key in keys:  # a backward that failed half-way left these: never hand them on
            self.pending.pop(key, None)
        self.queued[:] = [entry for entry in self.queued if _key(entry[2]) not in keys]
        views = (
            _HandOnAtEnd.apply(self, *weights)
            if torch.is_grad_enabled() and weights
            else (None,) * len(weights)
        )
        for w, view in zip(weights, views):
            setattr(w, _LANDED, view)
        try:
            yield
        finally:
            for w, view in outer:
                setattr(w, _LANDED, view)

    @staticmethod
    def landed(b: torch.Tensor) -> torch.Tensor | None:
        """The parameter ``b`` as its view from the node of the forward running now; None outside
        one, and for any other tensor: a view of a parameter is not followed to it, since under
        ``torch.compile`` its ``_base`` does not carry the view (eager and compiled runs agree)."""
        return getattr(b, _LANDED, None) if isinstance(b, nn.Parameter) else None

    def scatter_at_end(
        self, gathered_grad: torch.Tensor, group, weight: torch.Tensor, together: int = 1
    ) -> None:
        """Reduce-scatter ``gathered_grad`` (the gradient of ``weight`` gathered over ``group``) and
        leave this rank's rows, in ``weight``'s dtype, for the node that handed ``weight`` out. It
        starts with the ``together`` - 1 such gradients of ``group`` before it, as one collective,
        once it is the ``together``-th; on CUDA on a side stream the compute stream does not wait
        for until that node runs."""
        if self.queued and (self.queued[0][1] is not group or self.queued[0][0].dtype != gathered_grad.dtype):
            self.start_queued()
        self.queued.append((gathered_grad, group, weight))
        if len(self.queued) >= together:
            self.start_queued()

    def start_queued(self) -> None:
        """Start the queued gradients' reduce-scatters (one group's) as one collective."""
        if not self.queued:
            return
        grads, groups, weights = zip(*self.queued)
        self.queued.clear()
        one_dtype = (
            weights[0].dtype if len({w.dtype for w in weights}) == 1 else None
        )  # then cast once, as one row
        with self.streams.beside("weight gradients", *grads) as side:
            shards = comm.reduce_scatter_dim0_together(list(grads), groups[0], one_dtype)
            shards = [shard.to(weight.dtype) for shard, weight in zip(shards, weights)]
        for shard, weight in zip(shards, weights):
            self.pending.setdefault(_key(weight), []).append((shard, side))
