"""Token ids out of range raise, as ``nn.Embedding`` and ``F.cross_entropy`` do.

Without the check an id outside the vocabulary looks up nothing (an all-zero row) or targets no
logit, and training goes on with a finite, wrong loss. Every rank of a cube holds the same full
ids, so the local check raises identically on all of them, with no communication.

Cost: one elementwise comparison over ``[batch, seq]`` ints and one flag read on the host. Read at
once, the flag is a host synchronisation: the host waits for everything queued on the GPU before
it, and the GPU then idles while the host launches what follows. Given a model's open
:class:`DeferredTokenChecks` (its :class:`~lightning_3d.runtime.Runtime`'s, open during each of its
forwards) the flag is copied to pinned host memory as the check runs and read as the forward ends:
a check started at the beginning of the forward (the embedding's, and GPT3D's check of its targets) has long
finished by then, so reading it waits for nothing. The error is raised there, before the
forward returns, so no loss or logits of bad ids reach the caller; the layers in between handle
any id without failing (the embedding and the loss mask ids outside their vocabulary block).
"""

from __future__ import annotations

import torch


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
            allowed = f"[0, {self.size})" + (
                f" or ignore_index {self.ignore_index}" if self.ignore_index is not None else ""
            )
            raise ValueError(
                f"{self.who}: {self.what} {int(self.ids[where])} at index {where} of {list(self.ids.shape)} "
                f"is outside {allowed} ({int(self.bad.sum())} such); the vocabulary has {self.size} tokens: "
                f"map the {self.what}s into [0, {self.size}) or build the model with the tokenizer's vocabulary size"
            )


def check_token_range(
    ids: torch.Tensor,
    size: int,
    who: str,
    what: str,
    ignore_index: int | None = None,
    deferred: DeferredTokenChecks | None = None,
) -> None:
    """Raise ``ValueError`` naming the first id of ``ids`` outside ``[0, size)`` (other than ``ignore_index``):
    now, or as ``deferred`` closes when it is open (and the caller is not being compiled)."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{who}: {what}s must be integer token ids, got {ids.dtype}")
    check = _Check(ids, size, who, what, ignore_index)
    if deferred is not None and deferred.is_open and not torch.compiler.is_compiling():
        deferred.add(check)
    else:
        check.raise_if_bad()


class DeferredTokenChecks:
    """Token-range checks only started while open, and read as it closes: in the order started, the
    first failure raised (also when it is closed by an error, as a forward hook with ``always_call``
    is: PyTorch then reports it as a warning beside that error). Opened and closed around each
    forward of a model (nested forwards nest: each close reads the checks started since its open)."""

    def __init__(self):
        self._open: list[list[_Check]] = []

    @property
    def is_open(self) -> bool:
        return bool(self._open)

    def add(self, check: _Check) -> None:
        self._open[-1].append(check)
        check.defer()

    def __enter__(self) -> DeferredTokenChecks:
        self._open.append([])
        return self

    def __exit__(self, *exc) -> None:
        for check in self._open.pop():
            check.raise_if_bad()
