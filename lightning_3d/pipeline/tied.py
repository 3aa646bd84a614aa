"""A parameter that the first and the last pipeline stage both hold: a tied embedding and LM head.

GPT-2 (and any model built with ``tie_embeddings``/``tie_word_embeddings``) computes its logits with
its token embedding's weight. Split into stages, the embedding lives on the first stage and the head
on the last, so each holds the weight: the first stage's is the parameter, the last stage's a copy of
it (its ShardSpec's ``copy_of`` names the parameter, ``"transformer.wte.weight"``), laid out
alike on the two stages' cubes, each cube rank holding the same shard as its peer. As Megatron's
embedding group does, the copies start equal (the first stage's values, :meth:`TiedParameter.make_equal`,
when the stages are made) and their gradients are summed after every schedule step
(:meth:`TiedParameter.sum_grads`), so every optimizer step keeps them equal. Norms count the
parameter once (the copy is not representative), and checkpoints keep its optimizer state once, under
its name; the model state holds each under its own name, as the whole model's state dict does.

The sum runs over the grid's ``"ends"`` group (each rank of the first stage with its peer of the last);
under V-shaped schedules both stages run on the same rank and nothing is sent.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..grid import Grid
from ..sharding import get_spec, set_spec


@dataclass(eq=False)
class TiedParameter:
    """One parameter of the whole model that this rank's first or last stage holds, or both.

    ``held``: this rank's tensors of it, the first stage's first; ``group``: the process group of the
    ranks that hold it (its rank 0 runs the first stage), or None where this rank holds both.
    """

    held: list[nn.Parameter]
    group: dist.ProcessGroup | None

    @torch.no_grad()
    def make_equal(self) -> None:
        """Give every tensor the first stage's values. Collective over :attr:`group`."""
        source = self.held[0]
        if self.group is not None:
            dist.broadcast(source.detach(), group=self.group, group_src=0)  # in place: sent or received
        for copy in self.held[1:]:
            copy.copy_(source)

    def sum_grads(self) -> None:
        """Give every tensor the sum of the gradients of all of them (the whole model's gradient of the
        parameter), summed in place where this rank holds one. Collective over :attr:`group`."""
        grads = [p.grad for p in self.held if p.grad is not None]
        total = functools.reduce(torch.add, grads) if grads else torch.zeros_like(self.held[0])
        if self.group is not None:
            total, _ = comm.all_reduce(total, self.group)
        for p in self.held:
            p.grad = total if p is self.held[-1] else total.clone()


def tie_across_stages(
    modules: dict[int, nn.Module], ties: list[dict[int, str]], last: int, grid: Grid
) -> list[TiedParameter]:
    """This rank's :class:`TiedParameter` of each of ``ties`` (``{stage: the name it holds the parameter
    under}``, stage 0 and stage ``last``), from its stages' parallelized ``modules`` (by stage index).
    Marks each copy (``copy_of``) and makes the copies equal. Collective over the grid's ``"ends"``
    group where this rank runs one of the two stages."""
    out = []
    for names in ties:
        held = [modules[s].get_parameter(names[s]) for s in (0, last) if s in modules]
        if not held:
            continue
        for p in held:
            if get_spec(p) is None:
                raise ValueError(
                    f"{names[0]} is tied to {names[last]} across pipeline stages, but is not a 3-D layer's "
                    "parameter: give both modules 3-D rules with the same layout (VocabEmbedding and LMHead)"
                )
        for p in held[1:] if 0 in modules else held:
            set_spec(p, dataclasses.replace(get_spec(p), copy_of=(names[last], names[0])))
        tied = TiedParameter(held, None if len(held) == 2 else grid.group("ends"))
        tied.make_equal()
        out.append(tied)
    return out
