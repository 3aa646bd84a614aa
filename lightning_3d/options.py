"""RuntimeOptions: the run-time choices of the 3-D layers.

They change how a model runs, never what it computes, and are not part of the grid. ``parallelize``
fixes them into the model's :class:`~lightning_3d.runtime.Runtime`, which every 3-D layer of the
model holds: from then on they refuse changes, and ``lightning_3d.parallel.set_options(model, ...)``
applies a change to every layer (e.g. a strategy's, after ``configure_model``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .arguments import choice, flag, positive_int

ROWS_CHOICES = ("auto", "sequences", "tokens")  # RuntimeOptions.rows


@dataclass
class RuntimeOptions:
    """How the 3-D layers run.

    Args:
        async_tp: run each 3-D product's activation gather or scatter as a collective matmul,
            pipelined block by block with the product (:mod:`lightning_3d.ops.async_tp`; on CUDA,
            every rank of a cube must reach its peers' memory: one NVLink domain).
        save_gathered: keep the gathered activation and weight of every 3-D product for backward
            (default) or re-gather them there (less memory, more communication).
        prefetch: in a parallelized model whose grid has px > 1, gather each weight
            ``prefetch_depth`` products ahead during forward, and re-gather it as far ahead in
            backward where ``save_gathered=False`` (:class:`~lightning_3d.runtime.WeightPrefetch`;
            as many gathered weights of memory). Default on.
        prefetch_depth: how many weights ``prefetch`` gathers ahead (default 4).
        gathered_together: how many consecutive weights start their gathers as one collective
            (default 4), so that the ranks meet once a run instead of once a weight. As many as a
            block gathers (four in GPT-2 and Llama blocks), with ``prefetch_depth`` as large,
            gathers the next block's weights at once while the current block runs, as FSDP does;
            ``prefetch_depth=2, gathered_together=1`` gathers weight by weight, two products ahead,
            holding fewer gathered weights. With ``grads_at_end``, the reduce-scatters of as many
            consecutive weight gradients start as one collective too (a block's, in backward).
        grads_at_end: in a parallelized model, reduce-scatter each gathered weight's gradient
            beside the rest of backward and wait for all of them once, at its end, instead of in
            each product's backward (:mod:`~lightning_3d.runtime.late_grads`; on CUDA, one side stream).
            Default on; autograd still accumulates every gradient, so DDP's and DeepSpeed's
            gradient hooks see them all, at the end of backward.
        activation_checkpointing: recompute the modules the plan names as checkpoint units in
            backward (non-reentrant ``torch.utils.checkpoint``; dropout masks are replayed).
        compile: run each checkpoint unit (a Transformer block) through ``torch.compile``, one
            graph on every grid: the norms, activations, residual adds and attention between its
            3-D products are fused by Inductor; the products and all-reduces are custom ops in
            the graph that run as they do eagerly (:mod:`lightning_3d.parallel.units`).
        check_inputs: raise on token ids and targets outside the vocabulary, as ``nn.Embedding``
            and ``F.cross_entropy`` do (one comparison and one host sync per embedding and loss
            call). Off, an id out of range looks up a row of zeros and a target out of range
            adds a wrong, finite loss, silently: turn it off only where the data is known to
            be in range, or where no host sync is allowed (CUDA graphs).
        rows: what the rows of the activations hold (:mod:`lightning_3d.token_rows`): ``"auto"``
            (default) whole sequences where the batch is a multiple of ``lcm(px·py, px·pz)``,
            else token rows (chunks of sequences, attention gathering keys and values over the
            row group); ``"sequences"`` or ``"tokens"`` forces one.
    """

    async_tp: bool = False
    save_gathered: bool = True
    prefetch: bool = True
    prefetch_depth: int = 4
    gathered_together: int = 4
    grads_at_end: bool = True
    activation_checkpointing: bool = False
    compile: bool = False
    check_inputs: bool = True
    rows: str = "auto"

    def __post_init__(self):
        for f in fields(self):  # checked, not coerced: async_tp="no" would read as True
            if f.type == "str":
                choice(getattr(self, f.name), f.name, ROWS_CHOICES)
            else:
                (positive_int if f.type == "int" else flag)(getattr(self, f.name), f.name)

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_fixed"):
            raise AttributeError(
                f"a model's RuntimeOptions are fixed: lightning_3d.parallel.set_options(model, {name}={value!r}) "
                "applies a change to every 3-D layer of the model"
            )
        super().__setattr__(name, value)

    def fix(self) -> RuntimeOptions:
        """Refuse changes from now on (a model runs with them); returns ``self``. ``dataclasses.replace``
        makes a changeable copy."""
        self.__dict__["_fixed"] = True
        return self
