"""How a failed run reports itself: the cause once, not one traceback per rank (no Lightning import).

- A :class:`ConfigurationError` is raised alike by every rank (the grid does not fit the world; a
  ``ValueError`` from ``configure_model``, such as a layer that does not split on the grid,
  found from the same arguments everywhere): rank 0 raises it with its traceback, every other rank
  exits with one line that still names the error.
- A collective that fails because a peer died or stalled: every surviving rank says so in one
  line, naming the grid, the timeout and how to resume, and exits; the rank that failed first
  shows its own error.
"""

from __future__ import annotations

import contextlib
import sys

import torch.distributed as dist

_COLLECTIVE_FAILURE = (
    "gloo",
    "nccl",
    "connection closed",
    "connection reset",
    "timed out",
    "timeout",
    "broken pipe",
    "watchdog",
)


class ConfigurationError(ValueError):
    """A configuration error that every rank raises alike; rank 0 reports it, the others exit quietly."""


@contextlib.contextmanager
def same_on_every_rank():
    """Raise a ``ValueError`` from the block as a :class:`ConfigurationError` (the block runs alike on every rank)."""
    try:
        yield
    except ConfigurationError:
        raise
    except ValueError as e:
        raise ConfigurationError(str(e)).with_traceback(
            e.__traceback__
        ) from None  # one traceback, down to the cause


def is_collective_failure(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that failed, as a dead or stalled peer makes it fail."""
    text = str(exception).lower()
    return isinstance(exception, (RuntimeError, dist.DistBackendError)) and any(
        w in text for w in _COLLECTIVE_FAILURE
    )


def is_same_on_every_rank(exception: BaseException) -> bool:
    """A :class:`ConfigurationError`, or Lightning's ``MisconfigurationException`` (its checks of the module and
    the Trainer's settings, made alike on every rank; matched by name, as each Lightning namespace has its own)."""
    return (
        isinstance(exception, ConfigurationError) or type(exception).__name__ == "MisconfigurationException"
    )


class ReportFailuresOnce:
    """Strategy mixin: ``on_exception`` reports an error made alike on every rank, or a failed collective, once."""

    def on_exception(self, exception: BaseException) -> None:
        if self.world_size > 1 and is_same_on_every_rank(exception) and self.global_rank != 0:
            first = str(exception).splitlines()[0] if str(exception) else ""
            print(
                f"tensor3d: rank {self.global_rank}: {type(exception).__name__}: {first} (rank 0 reports it in full)",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1)
        if self.world_size > 1 and is_collective_failure(exception):
            grid = getattr(self, "_grid", None)
            px, py, pz = grid.shape if grid is not None else ("?", "?", "?")
            print(
                f"tensor3d: a collective failed on rank {self.global_rank} of {self.world_size} (grid {px}×{py}×{pz}, "
                f"timeout {self._timeout.total_seconds():.0f} s): another rank died or stalled. The run cannot go on; "
                "restart it with Trainer.fit(..., ckpt_path=<last checkpoint>). Cause: "
                f"{str(exception).splitlines()[0]}",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1)
        super().on_exception(exception)
