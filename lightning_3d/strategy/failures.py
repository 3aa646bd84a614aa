"""How a failed run reports itself: the cause once, not one traceback per rank (no Lightning import).

- A :class:`ConfigurationError` is raised alike by every rank (the grid does not fit the world; a
  ``ValueError`` from ``configure_model``, such as a layer that does not split on the grid,
  found from the same arguments everywhere): rank 0 raises it with its traceback, every other rank
  exits with one line that still names the error.
- A collective that fails because a peer died or stalled: every surviving rank says so in one
  line, naming the grid, the timeout and how to resume, and exits; the rank that failed first
  shows its own error. The failed collective may be the cause of another error (a pipeline
  schedule raises its own naming the stage whose forward or backward failed): it is found among
  the exception's causes.
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


def failed_collective(exception: BaseException) -> BaseException | None:
    """The failed collective (:func:`is_collective_failure`) that is ``exception`` or one of its causes, or None."""
    seen: set[int] = set()
    while exception is not None and id(exception) not in seen:
        if is_collective_failure(exception):
            return exception
        seen.add(id(exception))
        exception = exception.__cause__ or exception.__context__
    return None


def _first_line(exception: BaseException) -> str:
    return next(
        (line.strip() for line in str(exception).splitlines() if line.strip()), type(exception).__name__
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
        collective = failed_collective(exception) if self.world_size > 1 else None
        if collective is not None:
            grid = getattr(self, "_grid", None)
            px, py, pz = grid.shape if grid is not None else ("?", "?", "?")
            stage = (
                f", pipeline stage {grid.stage} of {grid.pipeline_size}"
                if grid and grid.pipeline_size > 1
                else ""
            )
            print(
                f"tensor3d: a collective failed on rank {self.global_rank} of {self.world_size} "
                f"(grid {px}×{py}×{pz}{stage}, "
                f"timeout {self._timeout.total_seconds():.0f} s): another rank died or stalled. The run cannot go on; "
                "restart it with Trainer.fit(..., ckpt_path=<last checkpoint>). Cause: "
                f"{_first_line(collective)}",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1)
        super().on_exception(exception)
