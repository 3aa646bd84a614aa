"""Runtime: what one model's 3-D layers run with, handed to each of them."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator

from ..comm import SideStreams
from ..options import RuntimeOptions
from .late_grads import WeightGradsAtEnd
from .prefetch import WeightPrefetch
from .token_checks import DeferredTokenChecks

_NUMBERS = itertools.count()
# every live Runtime by name, filled as each is made: a compiled product's custom ops take their
# model's runtime by name, as they take process groups
_NAMED: weakref.WeakValueDictionary[str, Runtime] = weakref.WeakValueDictionary()


class Runtime:
    """The run-time state of one model, shared by its 3-D layers: each holds it (``Module3D.runtime``)
    and passes it to the products it calls. ``parallelize`` makes one per model; a layer built
    alone makes its own.

    Attributes:
        options: the :class:`~lightning_3d.options.RuntimeOptions` it runs with, fixed
            (:meth:`apply` replaces them: ``lightning_3d.parallel.set_options(model, ...)``).
        prefetch: the :class:`WeightPrefetch` serving the products' weight gathers, or None. A
            model whose grid gathers weights (px > 1) makes its own from ``options.prefetch``,
            ``prefetch_depth`` and ``gathered_together``; :meth:`WeightPrefetch.attach` sets one.
        late_grads: the :class:`WeightGradsAtEnd` holding the weight gradients left for the end of
            backward (``options.grads_at_end``).
        streams: the :class:`~lightning_3d.comm.SideStreams` (CUDA, made on first use) on which
            its prefetch and late gradients work beside the compute stream.
        token_checks: the :class:`DeferredTokenChecks` open during each forward of the model.
        token_rows: the :class:`~lightning_3d.token_rows.TokenRows` the forward running now runs on,
            where the model's plan names its attention and lays out token rows by hooks
            (:mod:`lightning_3d.parallel.attention`); None: whole sequences, or rows the model's
            own code lays out. Set by the token embedding at each forward, restored for a unit
            recomputed in backward (:meth:`on_rows`).
        name: how a compiled product's custom ops find it (:func:`runtime_named`).
    """

    def __init__(self, options: RuntimeOptions | None = None, gathers_weights: bool = False):
        self.gathers_weights = gathers_weights
        self.streams = SideStreams()
        self.prefetch: WeightPrefetch | None = None
        self.late_grads = WeightGradsAtEnd(self.streams)
        self.token_checks = DeferredTokenChecks()
        self.token_rows = None
        self.name = f"runtime{next(_NUMBERS)}"
        _NAMED[self.name] = self
        self.apply(options if options is not None else RuntimeOptions())

    def apply(self, options: RuntimeOptions) -> None:
        """Run with ``options`` from the next call on (they refuse changes from now on). Where the
        model gathers weights, its prefetch follows them: made, replaced (another depth or run
        length) or dropped."""
        self.options = options.fix()
        if self.gathers_weights:
            wanted = (options.prefetch_depth, options.gathered_together)
            if not options.prefetch:
                self.prefetch = None
            elif self.prefetch is None or (self.prefetch.depth, self.prefetch.together) != wanted:
                self.prefetch = WeightPrefetch(*wanted, streams=self.streams)

    @contextlib.contextmanager
    def on_rows(self, rows: object) -> Iterator[None]:
        """:attr:`token_rows` set to ``rows`` inside (a unit recomputed in backward runs on its forward's rows)."""
        before, self.token_rows = self.token_rows, rows
        try:
            yield
        finally:
            self.token_rows = before

    def __deepcopy__(self, memo) -> Runtime:
        """A copy of a model runs with a runtime of its own, with the same options."""
        return Runtime(self.options, self.gathers_weights)

    def __repr__(self) -> str:
        return f"Runtime({self.name}, {self.options})"


def runtime_named(name: str) -> Runtime:
    """The live :class:`Runtime` called ``name``."""
    return _NAMED[name]
