"""The process grid: ``world = dp · px · py · pz`` ranks with coordinates ``(d, i, j, l)``.

Ranks are laid out dp-major, then x, y, z (z fastest): ``rank = ((d·px + i)·py + j)·pz + l``.
Launchers number ranks node by node, so each cube lies inside one node whenever ``px·py·pz``
divides the ranks per node, and only dp spans nodes. A cube larger than a node spans nodes along
x first (its outermost axis), then y: x groups move weights only (gathered products ahead and
hidden behind the previous ones), while y and z groups move the activations on every product's
critical path. :attr:`Grid.axes_across_nodes` records which axes span nodes. Every group a layer needs is
built once, at construction, by every rank (process-group creation is collective): the four axes of the
:class:`DeviceMesh`, the three planes and the whole cube.
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import arguments
from .agreement import exchange, require_equal

CUBE_AXES = ("x", "y", "z")
MESH_AXES = ("dp",) + CUBE_AXES

_current: Grid | None = None


def normalize_axes(axes: str) -> str:
    """``"zx"`` → ``"xz"``; ``"cube"`` → ``"xyz"``; ``"dp"`` stays. Rejects anything else."""
    if axes == "dp":
        return axes
    if axes == "cube":
        return "xyz"
    if not axes or any(a not in CUBE_AXES for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(
            f"unknown grid axes {axes!r}; use 'x', 'y', 'z', 'dp', a plane such as 'xz', or 'cube'"
        )
    return "".join(a for a in CUBE_AXES if a in axes)


@dataclass(eq=False)
class Grid:
    """A ``dp × px × py × pz`` grid of ranks and its process groups.

    Build it with :func:`init_grid`. It holds topology only: how a model runs on it is the
    layers' :class:`~lightning_3d.options.RuntimeOptions`. ``shape`` is ``(px, py, pz)``;
    ``coords`` is ``(d, i, j, l)``; ``axes_across_nodes``: the axes (of ``"dp"``, ``"x"``,
    ``"y"``, ``"z"``) some of whose groups span more than one node; ``("dp",)`` or ``()`` when
    every cube fits in a node.
    """

    shape: tuple[int, int, int]
    data_parallel_size: int
    coords: tuple[int, int, int, int]
    mesh: DeviceMesh
    timeout: datetime.timedelta | None
    _groups: dict[str, dist.ProcessGroup] = field(repr=False)
    axes_across_nodes: tuple[str, ...] = ()

    @property
    def cube_size(self) -> int:
        """``px · py · pz``: the ranks that hold one model replica."""
        px, py, pz = self.shape
        return px * py * pz

    def size(self, axes: str) -> int:
        """Number of ranks along ``axes`` (``"x"``, ``"xz"``, ``"cube"``, ``"dp"``, ...)."""
        axes = normalize_axes(axes)
        if axes == "dp":
            return self.data_parallel_size
        n = 1
        for a in axes:
            n *= self.shape[CUBE_AXES.index(a)]
        return n

    def coord(self, axis: str) -> int:
        """This rank's coordinate along one axis: ``d``, ``i``, ``j`` or ``l``."""
        return self.coords[MESH_AXES.index(axis)]

    def rank_in(self, axes: str) -> int:
        """This rank's index inside the group of ``axes`` (row-major over x, y, z)."""
        axes = normalize_axes(axes)
        if axes == "dp":
            return self.coords[0]
        r = 0
        for a in axes:
            r = r * self.size(a) + self.coord(a)
        return r

    def group(self, axes: str) -> dist.ProcessGroup:
        """The process group of the ranks that differ from this one only along ``axes``."""
        if not self._groups:
            raise RuntimeError(
                f"{self!r}: its process groups were destroyed by destroy_grid; build another grid with init_grid"
            )
        return self._groups[normalize_axes(axes)]

    def cube_coords(self, cube_rank: int) -> tuple[int, int, int]:
        """``(i, j, l)`` of the rank with index ``cube_rank`` in the cube group."""
        px, py, pz = self.shape
        return cube_rank // (py * pz), (cube_rank // pz) % py, cube_rank % pz

    def __repr__(self) -> str:
        px, py, pz = self.shape
        nodes = f", across nodes: {'+'.join(self.axes_across_nodes)}" if self.axes_across_nodes else ""
        return f"Grid({px}×{py}×{pz}, dp={self.data_parallel_size}, coords={self.coords}{nodes})"


def _check_shape(shape: object, world: int, dp: object) -> tuple[tuple[int, int, int], int]:
    shape = arguments.grid_shape(shape)
    cube = shape[0] * shape[1] * shape[2]
    if dp is None:
        if world % cube:
            raise ValueError(
                f"world size {world} is not divisible by px·py·pz = {cube} for grid {shape}; "
                f"launch a multiple of {cube} processes or pick a grid whose product divides {world}"
            )
        dp = world // cube
    dp = arguments.positive_int(dp, "data_parallel_size")
    if dp * cube != world:
        raise ValueError(
            f"world size {world} != dp·px·py·pz = {dp}·{shape[0]}·{shape[1]}·{shape[2]} = {dp * cube}; "
            f"launch {dp * cube} processes or change the grid / data_parallel_size"
        )
    return shape, dp


def node_name() -> str:
    """This process's node: the host name, and the launcher's node rank where it sets one
    (``NODE_RANK``: Lightning; ``GROUP_RANK``: torchrun), so that several launchers on one host count
    as several nodes."""
    rank = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", ""))
    return f"{socket.gethostname()}#{rank}" if rank else socket.gethostname()


def axes_across_nodes(mesh_shape: tuple[int, int, int, int], nodes: list) -> tuple[str, ...]:
    """The mesh axes (of ``MESH_AXES``) some of whose groups hold ranks of more than one node, for
    ranks laid out as :func:`init_grid` lays them; ``nodes[r]`` names the node of global rank ``r``."""
    out = []
    for d, axis in enumerate(MESH_AXES):
        size, stride = mesh_shape[d], math.prod(mesh_shape[d + 1 :])
        firsts = (r for r in range(len(nodes)) if (r // stride) % size == 0)  # coordinate 0 on this axis
        if any(nodes[r + k * stride] != nodes[r] for r in firsts for k in range(1, size)):
            out.append(axis)
    return tuple(out)


def _default_timeout() -> datetime.timedelta | None:
    """The default process group's timeout, so subgroups fail as fast as it does."""
    pg = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def _backend_options(backend: str, timeout: datetime.timedelta | None):
    """Process-group options that carry ``timeout`` for the mesh's groups, or None."""
    if timeout is None:
        return None
    cls = {
        "gloo": getattr(dist, "ProcessGroupGloo", None),
        "nccl": getattr(dist, "ProcessGroupNCCL", None),
    }.get(backend)
    if cls is None:
        return None
    opts = cls._Options() if backend == "gloo" else cls.Options()
    opts._timeout = timeout
    return opts


def init_grid(
    shape: tuple[int, int, int] = (1, 1, 1),
    data_parallel_size: int | None = None,
    *,
    device_type: str | None = None,
    timeout: datetime.timedelta | float | None = None,
) -> Grid:
    """Build the grid on the initialised default process group and make it the current grid.

    Collective over the whole world: every rank must pass the same arguments. One small
    all-gather first compares them (and learns which node each rank runs on), so ranks that
    disagree all raise at once instead of hanging in mismatched groups.

    Args:
        shape: ``(px, py, pz)``, three positive ints (a string such as ``"2x2x1"`` is refused).
        data_parallel_size: number of model replicas, a positive int; defaults to ``world // (px·py·pz)``.
        device_type: ``"cuda"`` or ``"cpu"``; defaults to the default backend's device.
        timeout: collective timeout of every group, a positive ``timedelta`` or seconds; defaults
            to the default group's.

    Raises:
        ValueError: the ranks passed different arguments; an argument of the wrong type or
            range; the world size is not ``dp·px·py·pz``.
    """
    global _current
    if not dist.is_initialized():
        raise RuntimeError(
            "init_grid needs an initialised default process group: call torch.distributed.init_process_group first"
        )
    world = dist.get_world_size()
    given = {
        "shape": tuple(shape) if isinstance(shape, (list, tuple)) else shape,
        "data_parallel_size": data_parallel_size,
        "device_type": device_type,
        "timeout": timeout,
    }
    # Agree before checking: a check that failed on some ranks only would leave the others waiting.
    seen = exchange({**given, "node": node_name()}, dist.group.WORLD)
    require_equal(
        seen, given, list(range(world)), "init_grid", "every rank must call init_grid with the same arguments"
    )
    nodes = [s["node"] for s in seen]
    shape, dp = _check_shape(shape, world, data_parallel_size)
    timeout = arguments.timeout(timeout) if timeout is not None else _default_timeout()
    backend = dist.get_backend()
    if device_type is None:
        device_type = "cuda" if "nccl" in backend else "cpu"
    mesh_shape = (dp,) + shape
    opts = _backend_options(backend, timeout)
    override = {name: (backend, opts) for name in MESH_AXES} if opts is not None else None
    mesh = init_device_mesh(
        device_type,
        mesh_shape,
        mesh_dim_names=MESH_AXES,
        **({"backend_override": override} if override else {}),
    )
    groups = {name: mesh.get_group(name) for name in MESH_AXES}
    ranks = torch.arange(world).reshape(mesh_shape)
    for n in (2, 3):
        for axes in itertools.combinations(CUBE_AXES, n):
            dims = [1 + CUBE_AXES.index(a) for a in axes]
            rest = [d for d in range(4) if d not in dims]
            group_size = 1
            for d in dims:
                group_size *= mesh_shape[d]
            members = ranks.permute(rest + dims).reshape(-1, group_size)
            groups["".join(axes)], _ = dist.new_subgroups_by_enumeration(members.tolist(), timeout=timeout)
    coords = tuple(int(c) for c in mesh.get_coordinate())
    _current = Grid(
        shape=shape,
        data_parallel_size=dp,
        coords=coords,
        mesh=mesh,
        timeout=timeout,
        _groups=groups,
        axes_across_nodes=axes_across_nodes(mesh_shape, nodes),
    )
    return _current


def destroy_grid(grid: Grid) -> None:
    """Destroy the process groups of ``grid``; every rank of the world calls it, once no model built
    on the grid runs again.

    A group holds its backend's resources until it is destroyed: NCCL communicators and their
    buffers; on gloo, a thread that wakes every 10 ms, so a process that keeps many grids (one per
    ``Trainer``, or one per shape tried) spends CPU time on them. Afterwards the grid, and every
    layer built on it, refuses to run a collective; it is no longer the current grid.
    """
    global _current
    unique = {
        id(g): g
        for g in grid._groups.values()
        if g not in (None, dist.GroupMember.NON_GROUP_MEMBER, dist.GroupMember.WORLD)
    }
    for group in unique.values():
        dist.destroy_process_group(group)
    grid._groups.clear()
    if _current is grid:
        _current = None


def get_grid() -> Grid:
    """The grid made current by the last :func:`init_grid`."""
    if _current is None:
        raise RuntimeError(
            "no grid: call lightning_3d.init_grid(shape=(px, py, pz)) first, or pass grid= to the layer"
        )
    return _current


def set_grid(grid: Grid | None) -> None:
    """Make ``grid`` the current grid (or clear it with None)."""
    global _current
    _current = grid


def resolve_grid(grid: Grid | None) -> Grid:
    """``grid`` itself, or the current grid when None."""
    return grid if grid is not None else get_grid()
