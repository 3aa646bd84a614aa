"""How a tensor lies on the grid: the one place that says which axes shard and replicate it.

A :class:`ShardSpec` names, for every dim of the global tensor, the grid axes that cut it, outer
to inner. ``dims=(("y", "x"), ("z",))`` on a ``[K, N]`` weight means: K is cut into py blocks by
``j``, each cut again into px blocks by ``i``; N is cut into pz blocks by ``l``. Axes of the cube
that cut no dim replicate the tensor (as does ``dp``, always). Checkpoint resharding, dense
export, gradient-norm counting and DeepSpeed's tags are all derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import comm
from .grid import CUBE_AXES, Grid

SPEC_ATTR = "shard_spec"


@dataclass(frozen=True)
class ShardSpec:
    """Global shape and, per dim, the grid axes that cut it (outer to inner).

    Derived on construction (every forward reads them, compiled code included): ``sharded_axes``,
    the cube axes that cut the tensor in x, y, z order (``"xyz"``, ``"y"``), and
    ``replicated_axes``, those that hold copies of the same shard (``""`` when none).

    ``copy_of``: on a pipeline stage's copy of a parameter that an earlier stage holds too (a tied
    LM head on the last stage, :mod:`lightning_3d.pipeline.tied`), the copy's name and that
    parameter's in the whole model (``("lm_head.weight", "transformer.wte.weight")``): its values and
    gradients are that parameter's, so norms do not count it and checkpoints name its optimizer state
    by that parameter's name (:meth:`held_as`). Not part of the layout (equal specs compare equal).
    """

    global_shape: tuple[int, ...]
    dims: tuple[tuple[str, ...], ...]
    copy_of: tuple[str, str] | None = field(default=None, compare=False)
    sharded_axes: str = field(init=False, repr=False, compare=False)
    replicated_axes: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if len(self.dims) != len(self.global_shape):
            raise ValueError(
                f"ShardSpec needs one axes tuple per dim: shape {self.global_shape}, dims {self.dims}"
            )
        used = [a for axes in self.dims for a in axes]
        if len(used) != len(set(used)) or any(a not in CUBE_AXES for a in used):
            raise ValueError(f"each of {CUBE_AXES} may cut at most one dim, got {self.dims}")
        object.__setattr__(self, "sharded_axes", "".join(a for a in CUBE_AXES if a in used))
        object.__setattr__(self, "replicated_axes", "".join(a for a in CUBE_AXES if a not in used))

    def check(self, grid: Grid, what: str = "tensor") -> None:
        """Raise ``ValueError`` naming the numbers when a dim does not split evenly on ``grid``."""
        for d, (n, axes) in enumerate(zip(self.global_shape, self.dims)):
            parts = _parts(grid, axes)
            if n % parts:
                cut = "·".join(f"p{a}={grid.size(a)}" for a in axes)
                raise ValueError(
                    f"{what}: dim {d} of size {n} is split over {cut} = {parts} ranks, but {n} % {parts} = "
                    f"{n % parts}; "
                    f"make it a multiple of {parts} or pick a grid that divides it"
                )

    def local_shape(self, grid: Grid) -> tuple[int, ...]:
        """Shape of one rank's shard."""
        self.check(grid)
        return tuple(n // _parts(grid, axes) for n, axes in zip(self.global_shape, self.dims))

    def block_index(self, grid: Grid, coords: tuple[int, int, int], d: int) -> int:
        """Which block of dim ``d`` the rank at cube coords ``(i, j, l)`` holds."""
        index = 0
        for a in self.dims[d]:
            index = index * grid.size(a) + coords[CUBE_AXES.index(a)]
        return index

    def local_slices(self, grid: Grid, coords: tuple[int, int, int] | None = None) -> tuple[slice, ...]:
        """The slice of the global tensor held at ``coords`` (default: this rank)."""
        coords = coords if coords is not None else grid.coords[1:]
        shape = self.local_shape(grid)
        return tuple(
            slice(self.block_index(grid, coords, d) * n, (self.block_index(grid, coords, d) + 1) * n)
            for d, n in enumerate(shape)
        )

    def is_representative(self, grid: Grid, coords: tuple[int, int, int] | None = None) -> bool:
        """True on exactly one rank of each set of replicas inside a cube (coordinate 0 on every replicating
        axis), and never on a stage's copy of another stage's parameter (``copy_of``)."""
        coords = coords if coords is not None else grid.coords[1:]
        return self.copy_of is None and all(coords[CUBE_AXES.index(a)] == 0 for a in self.replicated_axes)

    def held_as(self, name: str) -> str:
        """The name of the parameter named ``name`` (its name in some module) as its optimizer state is
        kept: its own, or for a stage's copy (``copy_of``) the parameter's, under the same prefix."""
        if self.copy_of is None:
            return name
        own, parameter = self.copy_of
        return name[: len(name) - len(own)] + parameter

    def describe(self, grid: Grid) -> str:
        """``[K, N] sharded (y·x, z), replicated over -`` for ``extra_repr``."""
        cuts = ", ".join("·".join(axes) if axes else "-" for axes in self.dims)
        return f"global={list(self.global_shape)}, split=({cuts}), replicated={self.replicated_axes or '-'}"


def _parts(grid: Grid, axes: tuple[str, ...]) -> int:
    n = 1
    for a in axes:
        n *= grid.size(a)
    return n


def shard_tensor(full: torch.Tensor, spec: ShardSpec, grid: Grid) -> torch.Tensor:
    """This rank's shard of ``full`` (a view; no communication)."""
    if tuple(full.shape) != spec.global_shape:
        raise ValueError(
            f"expected a global tensor of shape {list(spec.global_shape)}, got {list(full.shape)}"
        )
    return full[spec.local_slices(grid)]


def assemble_tensor(shards, spec: ShardSpec, grid: Grid) -> torch.Tensor:
    """The global tensor from the shards of every cube rank (indexed by cube rank); no communication."""
    full = shards[0].new_empty(spec.global_shape)
    for r in range(grid.cube_size):
        full[spec.local_slices(grid, grid.cube_coords(r))] = shards[r]
    return full


def unshard_tensor(local: torch.Tensor, spec: ShardSpec, grid: Grid) -> torch.Tensor:
    """The global tensor, assembled on every rank of the cube from their shards (all-gather)."""
    gathered, _ = comm.all_gather_dim0(local.contiguous().unsqueeze(0), grid.group("cube"))
    return assemble_tensor(gathered, spec, grid)


def set_spec(param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Attach ``spec`` to ``param`` (returns ``param``)."""
    setattr(param, SPEC_ATTR, spec)
    return param


def get_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """The :class:`ShardSpec` of a 3-D parameter, or None for a plain tensor."""
    return getattr(tensor, SPEC_ATTR, None)


def replicated_grad_axes(spec: ShardSpec, grid: Grid, already_summed: str = "") -> str:
    """Axes over which a parameter's gradient is summed inside the cube, leaving out the axes in
    ``already_summed`` (``""`` when nothing is left to sum)."""
    axes = "".join(a for a in spec.replicated_axes if a not in already_summed)
    return axes if axes and grid.size(axes) > 1 else ""
