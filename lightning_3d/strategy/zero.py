"""ZeRO stage 1 over the data-parallel group: optimizer state sharded across the dp replicas.

Each dp rank keeps the optimizer state of, and updates, only its share of the parameters (a
greedy partition by size, the same on every rank, so all cube ranks of a replica own the same
parameters). The optimizer keeps every parameter in its param groups, so ``zero_grad``, gradient
clipping, loss scaling and LR schedulers see the whole model: a step pre-hook narrows each group
to this rank's share for the update (a closure passed to ``step``, which runs forward, backward
and clipping, still sees every parameter), and a post-hook restores the groups and lets each
owner broadcast its updated parameters to the other replicas (over dp only). A skipped step (fp16
overflow) runs neither hook, so no replica moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..grid import Grid


def _unique_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen, out = set(), []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def partition(params: list[torch.Tensor], parts: int) -> dict[int, int]:
    """``id(param)`` → owner in ``[0, parts)``: largest first, each to the least loaded owner."""
    load = [0] * parts
    owner = {}
    for p in sorted(params, key=lambda p: -p.numel()):
        d = min(range(parts), key=lambda k: load[k])
        owner[id(p)] = d
        load[d] += p.numel()
    return owner


class ShardedOptimizerState:
    """Makes ``optimizer`` a ZeRO-1 optimizer over ``grid``'s dp group (see the module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer, grid: Grid):
        self.grid = grid
        self.params = _unique_params(optimizer)
        self.owner = partition(self.params, grid.data_parallel_size)
        self._full_groups: list[list[torch.Tensor]] = []
        self._hooks = (
            optimizer.register_step_pre_hook(self._narrow),
            optimizer.register_step_post_hook(self._restore_and_broadcast),
        )

    def holds_state(self, param: torch.Tensor) -> bool:
        """Whether this dp rank keeps ``param``'s optimizer state and updates it."""
        return self.owner[id(param)] == self.grid.coord("dp")

    @staticmethod
    def _set_groups(optimizer, groups: list[list[torch.Tensor]]) -> None:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params

    def _narrow(self, optimizer, args, kwargs):
        full = self._full_groups = [group["params"] for group in optimizer.param_groups]
        owned = [[p for p in params if self.holds_state(p)] for params in full]
        self._set_groups(optimizer, owned)
        # torch passes the step's own arguments: args = (optimizer, [closure]), kwargs = {[closure]}
        positional = len(args) > 1
        closure = args[1] if positional else kwargs.get("closure")
        if closure is None:
            return None

        def closure_on_every_parameter():
            self._set_groups(optimizer, full)
            try:
                return closure()
            finally:
                self._set_groups(optimizer, owned)

        if positional:
            return (args[0], closure_on_every_parameter, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_on_every_parameter}

    def _restore_and_broadcast(self, optimizer, args, kwargs) -> None:
        self._set_groups(optimizer, self._full_groups)
        self.broadcast_parameters()

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Every owner sends its parameters to the other dp replicas (one flat buffer per owner and dtype)."""
        group = self.grid.group("dp")
        for d in range(self.grid.data_parallel_size):
            owned = [p for p in self.params if self.owner[id(p)] == d]
            for dtype in dict.fromkeys(p.dtype for p in owned):
                tensors = [p.data for p in owned if p.dtype == dtype]
                flat = torch.cat([t.reshape(-1) for t in tensors])
                dist.broadcast(flat, src=dist.get_global_rank(group, d), group=group)
                if d != self.grid.coord("dp"):
                    for t, new in zip(tensors, flat.split([t.numel() for t in tensors])):
                        t.copy_(new.view_as(t))

    def remove(self) -> None:
        """Detach the hooks (the optimizer becomes a plain one again)."""
        for hook in self._hooks:
            hook.remove()
