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

Under a zero-bubble pipeline schedule (one with weight actions, W) these weights' gradients are
deferred further (:meth:`WeightGradsAtEnd.deferring`, entered around a step for each stage's
model): a product's backward queues its weight-gradient product (its operands, B's group, the
weight) instead of computing it, and the stage's weight pass for that backward
(:meth:`WeightGradsAtEnd.deferred_pass`, the schedule's ``dw_builder``) later computes each,
reduce-scatters them (one collective per run of one group) and accumulates them into the
parameters' ``.grad``. Every other gradient (norms, biases, embeddings, weights of a group of one
or with ``grads_at_end`` off, compiled products, whose operands the compiler may reuse once their
op returns) is still made in the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

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
        out = []
        for grad, shards, shape in zip(grads, ctx.owner.take(ctx.keys), ctx.shapes):
            for shard in shards:  # in the shape its product used the weight in
                grad = shard.view(shape) if grad is None else grad + shard.view(shape)
            out.append(grad)
        return (None, *out)


class DeferredWeightPass:
    """The weight gradients one backward deferred, run later at once (a schedule's W action).

    ``products``: ``(product, group, weight, parameter)`` in the order the backward queued them:
    ``product()`` makes the gradient of ``weight`` (a view of ``parameter``) gathered over ``group``.
    Calling it computes each, reduce-scatters them over their groups (one collective per run of one
    group), casts to the parameter's dtype and adds them to ``parameter.grad``; it empties ``products``.
    """

    def __init__(self, owner: WeightGradsAtEnd, products: list[tuple]):
        self.owner, self.products = owner, products

    @torch.no_grad()
    def __call__(self) -> None:
        products, self.products = self.products, []
        for product, group, weight, _ in products:
            self.owner.scatter_at_end(product(), group, weight, together=len(products))
        shards = self.owner.take([_key(weight) for _, _, weight, _ in products])
        for (_, _, _, param), parts in zip(products, shards):
            for shard in parts:
                shard = shard.view(param.shape)
                if param.grad is None:
                    param.grad = shard
                else:
                    param.grad.add_(shard)


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
        # while deferring: the products the running backward queued (see DeferredWeightPass)
        self.deferred: list[tuple] | None = None
        self.parameters: dict[tuple, nn.Parameter] = {}  # the weights handed out, by storage

    @contextlib.contextmanager
    def handing_out(self, weights: Iterable[nn.Parameter]) -> Iterator[None]:
        """One forward: each of ``weights`` (that requires grad) carries its view from a new node."""
        weights = [w for w in weights if w.requires_grad]
        self.parameters.update((_key(w), w) for w in weights)
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

    def weight_gradient(
        self, product: Callable[[], torch.Tensor], group, weight: torch.Tensor, together: int = 1
    ) -> None:
        """The gradient of ``weight`` gathered over ``group``, ``product()``: made now and left for
        :meth:`scatter_at_end`, or, while :meth:`deferring`, queued for the backward's
        :meth:`deferred_pass`."""
        if self.deferred is None:
            self.scatter_at_end(product(), group, weight, together)
        else:
            self.deferred.append((product, group, weight, self.parameters[_key(weight)]))

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Inside, products queue their weights' gradients for :meth:`deferred_pass` (a zero-bubble
        schedule's step); products queued and never run (a step that failed) are dropped on leaving."""
        self.deferred = []
        try:
            yield
        finally:
            self.deferred = None

    def deferred_pass(self) -> DeferredWeightPass:
        """The weight pass of the backward that ran last: the products it queued, taken (see
        :class:`DeferredWeightPass`); an empty pass outside :meth:`deferring`."""
        if self.deferred is None:
            return DeferredWeightPass(self, [])
        taken, self.deferred = self.deferred, []
        return DeferredWeightPass(self, taken)

    def take(self, keys: list[tuple]) -> list[list[torch.Tensor]]:
        """The shards left for the weights of ``keys`` (one list each), every queued reduce-scatter
        started first; on CUDA the compute stream waits for their side streams."""
        self.start_queued()
        started = [self.pending.pop(key, []) for key in keys]
        for stream in {stream for entries in started for _, stream in entries if stream is not None}:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        for entries in started:
            for shard, stream in entries:
                if stream is not None:
                    shard.record_stream(torch.cuda.current_stream(stream.device))
        return [[shard for shard, _ in entries] for entries in started]

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
