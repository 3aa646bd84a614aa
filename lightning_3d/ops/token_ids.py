"""Token ids out of range raise, as ``nn.Embedding`` and ``F.cross_entropy`` do.

Without the check an id outside the vocabulary looks up nothing (an all-zero row) or targets no
logit, and training goes on with a finite, wrong loss. Every rank of a cube holds the same full
ids, so the local check raises identically on all of them, with no communication.

Cost: one elementwise comparison over ``[batch, seq]`` ints and one flag read on the host. Read at
once, the flag is a host synchronisation: the host waits for everything queued on the GPU before
it, and the GPU then idles while the host launches what follows. Inside
:class:`DeferredTokenChecks` (``parallelize`` enters one around every forward of a model) the flag
is copied to pinned host memory as the check runs and read at the context's exit: a check started
at the beginning of the forward (the embedding's, and GPT3D's check of its targets) has long
finished by then, so reading it waits for nothing. The error is raised at that exit, before the
forward returns, so no loss or logits of bad ids reach the caller; the layers in between handle
any id without failing (the embedding and the loss mask ids outside their vocabulary block).
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()  # .open: this thread's contexts entered and not yet left, innermost last


def _open() -> list[DeferredTokenChecks]:
    if not hasattr(_local, "open"):
        _local.open = []
    return _local.open


class _Check:
    """The range check of one ids tensor: its "any id bad" flag on the device and, deferred, on the host."""

    def __init__(self, ids: torch.Tensor, size: int, who: str, what: str, ignore_index: int | None):
        self.ids, self.size, self.who, self.what, self.ignore_index = ids, size, who, what, ignore_index
        self.bad = (ids < 0) | (ids >= size)
        if ignore_index is not None:
            self.bad &= ids != ignore_index
        self.flag = self.bad.any()
        self.done: torch.cuda.Event | None = None

    def defer(self) -> None:
        """Start copying the flag to the host (CUDA); :meth:`raise_if_bad` then waits only for this copy."""
        if self.flag.is_cuda:
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(self.flag, non_blocking=True)
            self.flag, self.done = host, torch.cuda.Event()
            self.done.record()

    def raise_if_bad(self) -> None:
        if self.done is not None:
            self.done.synchronize()
        if bool(self.flag):
            where = tuple(self.bad.nonzero()[0].tolist())
            allowed = f"[0, {self.size})" + (f" or ignore_index {self.ignore_index}" if self.ignore_index is not None else "")
            raise ValueError(
                f"{self.who}: {self.what} {int(self.ids[where])} at index {where} of {list(self.ids.shape)} is outside {allowed} "
                f"({int(self.bad.sum())} such); the vocabulary has {self.size} tokens: map the {self.what}s into [0, {self.size}) "
                "or build the model with the tokenizer's vocabulary size"
            )


def check_token_range(ids: torch.Tensor, size: int, who: str, what: str, ignore_index: int | None = None) -> None:
    """Raise ``ValueError`` naming the first id of ``ids`` outside ``[0, size)`` (other than ``ignore_index``):
    now, or at the exit of the innermost open :class:`DeferredTokenChecks`."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{who}: {what}s must be integer token ids, got {ids.dtype}")
    check = _Check(ids, size, who, what, ignore_index)
    contexts = _open()
    if contexts and not torch.compiler.is_compiling():
        contexts[-1].checks.append(check)
        check.defer()
    else:
        check.raise_if_bad()


class DeferredTokenChecks:
    """A context in which :func:`check_token_range` only starts its checks; its exit reads them in
    the order started and raises the first failure (also when the context is left by an error,
    as a forward hook with ``always_call`` is: PyTorch then reports it as a warning beside that error).
    Contexts nest, per thread; each reads its own checks."""

    def __enter__(self) -> DeferredTokenChecks:
        self.checks: list[_Check] = []
        _open().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _open().remove(self)
        for check in self.checks:
            check.raise_if_bad()
