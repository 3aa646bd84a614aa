"""The process grid: ``world = pp · dp · px · py · pz`` ranks: pipeline stage ``s`` and coordinates ``(d, i, j, l)``.

Ranks are laid out stage-major, then dp, then x, y, z (z fastest):
``rank = (((s·dp + d)·px + i)·py + j)·pz + l``; with one stage (``pp = 1``), ``((d·px + i)·py + j)·pz + l``.
Launchers number ranks node by node, so each cube lies inside one node whenever ``px·py·pz``
divides the ranks per node, and only dp and the stages span nodes. A cube larger than a node spans
nodes along x first (its outermost axis), then y: x groups move weights only (gathered products
ahead and hidden behind the previous ones), while y and z groups move the activations on every
product's critical path. :attr:`Grid.axes_across_nodes` records which axes span nodes. Every group
a layer or a pipeline needs is built once, at construction, by every rank (process-group creation
is collective): the five axes of the :class:`DeviceMesh` (the pipeline's and this stage's four),
the three planes, the whole cube and the replica (every stage's cube).
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
MESH_AXES = ("dp",) + CUBE_AXES  # the dims of one stage's mesh, ``Grid.mesh``
ROOT_AXES = ("pipe",) + MESH_AXES  # the dims of the whole grid's mesh

_current: Grid | None = None


def normalize_axes(axes: str) -> str:
    """``"zx"`` → ``"xz"``; ``"cube"`` → ``"xyz"``; ``"dp"``, ``"pipe"``, ``"ends"`` and ``"replica"``
    stay. Rejects anything else."""
    if axes in ("dp", "pipe", "ends", "replica"):
        return axes
    if axes == "cube":
        return "xyz"
    if not axes or any(a not in CUBE_AXES for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(
            f"unknown grid axes {axes!r}; use 'x', 'y', 'z', 'dp', a plane such as 'xz', 'cube', "
            "'pipe', 'ends' or 'replica'"
        )
    return "".join(a for a in CUBE_AXES if a in axes)


@dataclass(eq=False)
class Grid:
    """A ``pp × dp × px × py × pz`` grid of ranks and its process groups: ``pp`` pipeline stages,
    each a ``dp × px × py × pz`` grid of its own.

    Build it with :func:`init_grid`. It holds topology only: how a model runs on it is the
    layers' :class:`~lightning_3d.options.RuntimeOptions`. ``shape`` is ``(px, py, pz)``;
    ``coords`` is ``(d, i, j, l)`` inside this rank's stage ``stage`` (of ``pipeline_size``).
    ``mesh`` is this stage's :class:`DeviceMesh`, of shape ``(dp, px, py, pz)`` named ``MESH_AXES``:
    a stage holds its own layers, so their DTensors and checkpoints live on its ranks alone (it is
    this stage's slice of a ``(pp, dp, px, py, pz)`` mesh, whose groups it shares).
    ``axes_across_nodes``: the axes (of ``"pipe"``, ``"dp"``, ``"x"``, ``"y"``, ``"z"``) some of
    whose groups span more than one node; none of ``"x"``, ``"y"``, ``"z"`` when every cube fits in a node.
    """

    shape: tuple[int, int, int]
    data_parallel_size: int
    coords: tuple[int, int, int, int]
    mesh: DeviceMesh
    timeout: datetime.timedelta | None
    _groups: dict[str, dist.ProcessGroup] = field(repr=False)
    axes_across_nodes: tuple[str, ...] = ()
    pipeline_size: int = 1
    stage: int = 0

    @property
    def cube_size(self) -> int:
        """``px · py · pz``: the ranks that hold one stage of a model replica (all of it when ``pp = 1``)."""
        px, py, pz = self.shape
        return px * py * pz

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline_size - 1

    def stage_peer(self, stage: int) -> int:
        """Global rank of the rank in ``stage`` with this rank's ``(d, i, j, l)``: where activations go."""
        if not 0 <= stage < self.pipeline_size:
            raise ValueError(
                f"stage {stage} is out of range: the grid has {self.pipeline_size} stages, 0..{self.pipeline_size - 1}"
            )
        return (stage * self.data_parallel_size + self.coords[0]) * self.cube_size + self.rank_in("cube")

    @property
    def prev_stage_peer(self) -> int | None:
        """:meth:`stage_peer` of the previous stage, which sends this rank its inputs; None on the first stage."""
        return None if self.is_first_stage else self.stage_peer(self.stage - 1)

    @property
    def next_stage_peer(self) -> int | None:
        """:meth:`stage_peer` of the next stage, to which this rank sends its outputs; None on the last stage."""
        return None if self.is_last_stage else self.stage_peer(self.stage + 1)

    def size(self, axes: str) -> int:
        """Number of ranks along ``axes`` (``"x"``, ``"xz"``, ``"cube"``, ``"dp"``, ``"pipe"``,
        ``"replica"`` = pp·px·py·pz, ...)."""
        axes = normalize_axes(axes)
        if axes == "dp":
            return self.data_parallel_size
        if axes == "pipe":
            return self.pipeline_size
        if axes == "replica":
            return self.pipeline_size * self.cube_size
        n = 1
        for a in axes:
            n *= self.shape[CUBE_AXES.index(a)]
        return n

    def coord(self, axis: str) -> int:
        """This rank's coordinate along one axis: ``d``, ``i``, ``j`` or ``l`` (the stage is :attr:`stage`)."""
        return self.coords[MESH_AXES.index(axis)]

    def rank_in(self, axes: str) -> int:
        """This rank's index inside the group of ``axes`` (row-major over x, y, z; ``"replica"``:
        ``stage · px·py·pz + cube rank``)."""
        axes = normalize_axes(axes)
        if axes == "dp":
            return self.coords[0]
        if axes == "pipe":
            return self.stage
        if axes == "replica":
            return self.stage * self.cube_size + self.rank_in("cube")
        r = 0
        for a in axes:
            r = r * self.size(a) + self.coord(a)
        return r

    def group(self, axes: str) -> dist.ProcessGroup:
        """The process group of the ranks that differ from this one only along ``axes``: inside this
        stage for the cube's axes and ``"dp"``; across the stages for ``"pipe"`` (this rank's
        :meth:`stage_peer` of every stage, in stage order), ``"ends"`` (this rank's peers of the first
        and the last stage, which share a tied embedding and head; the ``"pipe"`` group when
        ``pp ≤ 2``; None on the stages between) and ``"replica"`` (every stage's cube of this rank's
        replica, the cube itself when ``pp = 1``)."""
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
        stage = f", stage {self.stage} of {self.pipeline_size}" if self.pipeline_size > 1 else ""
        nodes = f", across nodes: {'+'.join(self.axes_across_nodes)}" if self.axes_across_nodes else ""
        return f"Grid({px}×{py}×{pz}, dp={self.data_parallel_size}{stage}, coords={self.coords}{nodes})"


def _check_shape(
    shape: object, world: int, dp: object, pipeline_size: object = 1
) -> tuple[tuple[int, int, int], int, int]:
    """``(shape, dp, pp)`` checked, ``world = pp·dp·px·py·pz``; a grid of one stage words its errors as before."""
    shape = arguments.grid_shape(shape)
    pp = arguments.positive_int(pipeline_size, "pipeline_size")
    cube = shape[0] * shape[1] * shape[2]
    if dp is None:
        if world % (pp * cube):
            per = f"pipeline_size·px·py·pz = {pp}·{cube} = {pp * cube}" if pp > 1 else f"px·py·pz = {cube}"
            what = "pipeline_size and grid" if pp > 1 else "grid"
            raise ValueError(
                f"world size {world} is not divisible by {per} for grid {shape}; "
                f"launch a multiple of {pp * cube} processes or pick a {what} whose product divides {world}"
            )
        dp = world // (pp * cube)
    dp = arguments.positive_int(dp, "data_parallel_size")
    if pp * dp * cube != world:
        names, sizes, fix = ("pp·", f"{pp}·", " / pipeline_size") if pp > 1 else ("", "", "")
        raise ValueError(
            f"world size {world} != {names}dp·px·py·pz = {sizes}{dp}·{shape[0]}·{shape[1]}·{shape[2]} = "
            f"{pp * dp * cube}; launch {pp * dp * cube} processes or change the grid / data_parallel_size{fix}"
        )
    return shape, dp, pp


def node_name() -> str:
    """This process's node: the host name, and the launcher's node rank where it sets one
    (``NODE_RANK``: Lightning; ``GROUP_RANK``: torchrun), so that several launchers on one host count
    as several nodes."""
    rank = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", ""))
    return f"{socket.gethostname()}#{rank}" if rank else socket.gethostname()


def axes_across_nodes(mesh_shape: tuple[int, ...], nodes: list) -> tuple[str, ...]:
    """The axes (of ``ROOT_AXES``) some of whose groups hold ranks of more than one node, for
    ranks laid out as :func:`init_grid` lays them; ``mesh_shape`` is ``(pp, dp, px, py, pz)``, or
    ``(dp, px, py, pz)`` for one stage; ``nodes[r]`` names the node of global rank ``r``."""
    names = ROOT_AXES[-len(mesh_shape) :]
    out = []
    for d, axis in enumerate(names):
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


def _subgroup(ranks: torch.Tensor, dims: list[int], timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    """This rank's group of the ranks that differ only along ``dims`` of ``ranks`` (global ranks laid out
    as the grid's mesh; None when ``ranks`` leaves this rank out); every rank creates every such group,
    in the same order."""
    rest = [d for d in range(ranks.dim()) if d not in dims]
    members = ranks.permute(rest + dims).reshape(-1, math.prod(ranks.shape[d] for d in dims))
    group, _ = dist.new_subgroups_by_enumeration(members.tolist(), timeout=timeout)
    return group


def init_grid(
    shape: tuple[int, int, int] = (1, 1, 1),
    data_parallel_size: int | None = None,
    *,
    pipeline_size: int = 1,
    device_type: str | None = None,
    timeout: datetime.timedelta | float | None = None,
) -> Grid:
    """Build the grid on the initialised default process group and make it the current grid.

    Collective over the whole world: every rank must pass the same arguments. One small
    all-gather first compares them (and learns which node each rank runs on), so ranks that
    disagree all raise at once instead of hanging in mismatched groups.

    Args:
        shape: ``(px, py, pz)``, three positive ints (a string such as ``"2x2x1"`` is refused).
        data_parallel_size: number of model replicas, a positive int; defaults to ``world // (pp·px·py·pz)``.
        pipeline_size: number of pipeline stages ``pp``, a positive int; the outermost axis of the
            rank order, so stages span nodes first, then dp, and a cube that fits a node stays inside one.
        device_type: ``"cuda"`` or ``"cpu"``; defaults to the default backend's device.
        timeout: collective timeout of every group, a positive ``timedelta`` or seconds; defaults
            to the default group's.

    Raises:
        ValueError: the ranks passed different arguments; an argument of the wrong type or
            range; the world size is not ``pp·dp·px·py·pz``.
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
        "pipeline_size": pipeline_size,
        "device_type": device_type,
        "timeout": timeout,
    }
    # Agree before checking: a check that failed on some ranks only would leave the others waiting.
    seen = exchange({**given, "node": node_name()}, dist.group.WORLD)
    require_equal(
        seen, given, list(range(world)), "init_grid", "every rank must call init_grid with the same arguments"
    )
    nodes = [s["node"] for s in seen]
    shape, dp, pp = _check_shape(shape, world, data_parallel_size, pipeline_size)
    timeout = arguments.timeout(timeout) if timeout is not None else _default_timeout()
    backend = dist.get_backend()
    if device_type is None:
        device_type = "cuda" if "nccl" in backend else "cpu"
    mesh_shape = (pp, dp) + shape
    opts = _backend_options(backend, timeout)
    override = {name: (backend, opts) for name in ROOT_AXES} if opts is not None else None
    root = init_device_mesh(
        device_type,
        mesh_shape,
        mesh_dim_names=ROOT_AXES,
        **({"backend_override": override} if override else {}),
    )
    groups = {name: root.get_group(name) for name in ROOT_AXES}
    ranks = torch.arange(world).reshape(mesh_shape)
    for n in (2, 3):
        for plane in itertools.combinations(CUBE_AXES, n):
            groups["".join(plane)] = _subgroup(ranks, [2 + CUBE_AXES.index(a) for a in plane], timeout)
    groups["replica"] = _subgroup(ranks, [0, 2, 3, 4], timeout) if pp > 1 else groups["xyz"]
    groups["ends"] = _subgroup(ranks[[0, -1]], [0], timeout) if pp > 2 else groups["pipe"]
    stage, *coords = (int(c) for c in root.get_coordinate())
    _current = Grid(
        shape=shape,
        data_parallel_size=dp,
        coords=tuple(coords),
        mesh=root[MESH_AXES],
        timeout=timeout,
        _groups=groups,
        axes_across_nodes=axes_across_nodes(mesh_shape, nodes),
        pipeline_size=pp,
        stage=stage,
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
