"""CrossEntropyLoss3D: the module form of :func:`vocab_parallel_cross_entropy`."""

from __future__ import annotations

import torch

from ..agreement import agree_on_first_call
from ..grid import Grid
from ..ops.cross_entropy import vocab_parallel_cross_entropy
from ..options import RuntimeOptions
from .base import Module3D


class CrossEntropyLoss3D(Module3D):
    """Mean cross-entropy of y-layout logits ``[b/(px·pz), ..., V/py]`` against full targets ``[b, ...]``.

    Targets outside ``[0, vocab_size)`` other than ``ignore_index`` raise ``ValueError`` on every
    cube rank (``vocab_size`` defaults to the logits' full ``V``; pass the true size when ``V`` is
    padded), unless ``RuntimeOptions.check_inputs`` is off or ``check_targets`` is False (the model
    checks them before its forward). The first call also checks that every cube rank was given the
    same targets.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        grid: Grid | None = None,
        vocab_size: int | None = None,
        options: RuntimeOptions | None = None,
        check_targets: bool = True,
    ):
        super().__init__(grid, options)
        self.ignore_index = ignore_index
        self.vocab_size = vocab_size
        self.check_targets = check_targets

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        agree_on_first_call(
            self, self.grid.group("cube"), "CrossEntropyLoss3D targets", targets=targets, logits=logits
        )
        return vocab_parallel_cross_entropy(
            logits,
            targets,
            self.ignore_index,
            self.grid,
            self.vocab_size,
            self.check_targets and self.options.check_inputs,
            self.options.compile,
            deferred=self.runtime.token_checks,
        )
