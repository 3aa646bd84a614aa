"""The grid: coordinates, group membership, errors, destruction, and activation split/gather."""

import os

import harness
import pytest
import torch
import torch.distributed as dist
from checks import GRIDS_8, gloo_threads, local, on_grids, rel, seed_for

from lightning_3d import Grid, gather_activation, init_grid, split_activation
from lightning_3d.grid import _check_shape, axes_across_nodes


def grid_job(grid: Grid):
    d, x, y, z = grid.coords
    px, py, pz = grid.shape
    rank = dist.get_rank()
    assert rank == ((d * px + x) * py + y) * pz + z, (rank, grid.coords)
    members = {}
    for axes in ("x", "y", "z", "xy", "xz", "yz", "cube", "dp"):
        group = grid.group(axes)
        ranks = [torch.zeros((), dtype=torch.long) for _ in range(dist.get_world_size(group))]
        dist.all_gather(ranks, torch.tensor(rank), group=group)
        members[axes] = sorted(int(r) for r in ranks)
        assert len(ranks) == grid.size(axes), (axes, len(ranks))
        assert grid.rank_in(axes) == dist.get_rank(group), (axes, grid.rank_in(axes), dist.get_rank(group))
    assert tuple(grid.mesh.shape) == (grid.data_parallel_size, px, py, pz)
    assert grid.mesh.mesh_dim_names == ("dp", "x", "y", "z")
    return members


def test_coords_and_groups():
    results = harness.run(8, on_grids, GRIDS_8, grid_job)
    for shape in GRIDS_8:
        px, py, pz = shape
        for rank, r in enumerate(results):
            m = r[shape]
            d, rest = divmod(rank, px * py * pz)
            # ranks sharing a group differ only along its axes
            assert m["cube"] == list(range(d * px * py * pz, (d + 1) * px * py * pz))
            assert m["z"] == [rank - rank % pz + k for k in range(pz)]
            assert m["dp"] == [rest + k * px * py * pz for k in range(8 // (px * py * pz))]
            assert set(m["x"]) | set(m["y"]) | set(m["z"]) <= set(m["cube"])
            assert set(m["xz"]) == {a for a in m["cube"] if (a // pz) % py == (rank // pz) % py}


def destroy_job():
    """Grids built and destroyed in turn leave no process group (nor its thread) behind; a destroyed grid
    refuses to run."""
    from lightning_3d import destroy_grid, get_grid

    before = gloo_threads()
    for shape in [(2, 2, 1), (1, 2, 2), (2, 1, 1)]:
        grid = init_grid(shape)
        dist.all_reduce(torch.ones(1), group=grid.group("cube"))
        destroy_grid(grid)
    try:
        grid.group("x")
    except RuntimeError as e:
        refused = str(e)
    try:
        get_grid()
    except RuntimeError:
        refused += " | no current grid"
    del grid
    return before, gloo_threads(), refused


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_destroyed_grids_leave_no_groups():
    for before, after, refused in harness.run(4, destroy_job):
        assert after == before, f"{after - before} gloo threads left by three destroyed grids"
        assert (
            "Grid(2×1×1, dp=2" in refused
            and "destroyed by destroy_grid" in refused
            and refused.endswith("| no current grid")
        ), refused


@pytest.mark.parametrize(
    "shape, world, dp, message",
    [
        ((2, 2, 2), 6, None, "world size 6 is not divisible by px·py·pz = 8"),
        ((2, 2, 1), 8, 3, "world size 8 != dp·px·py·pz = 3·2·2·1 = 12"),
        ((2, 0, 2), 8, None, "every grid axis must be >= 1"),
        ((2, 2), 4, None, "grid shape must be (px, py, pz)"),
    ],
)
def test_bad_grid_raises(shape, world, dp, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _check_shape(shape, world, dp)


def init_mismatch_job():
    with pytest.raises(ValueError, match="launch 12 processes"):
        init_grid((2, 2, 1), 3)
    return True


def test_async_tp_refuses_a_cube_across_nodes_and_other_devices():
    from lightning_3d.ops.async_tp import check_available

    check_available("cuda", 4, ("dp",))
    with pytest.raises(
        ValueError,
        match=r"every cube of px·py·pz = 8 ranks on one node .* the cube's x groups span nodes: "
        r"use a grid whose px·py·pz divides the ranks per node",
    ):
        check_available("cuda", 8, ("x",))
    with pytest.raises(
        ValueError, match="async_tp=True runs on 'cuda' or 'cpu' grids, not 'meta': pass async_tp=False"
    ):
        check_available("meta", 8)


@pytest.mark.parametrize(
    "mesh, nodes, axes",
    [
        ((2, 2, 1, 1), "aabb", ("dp",)),  # cubes of 2 inside nodes of 2: dp across
        ((4, 2, 2, 1), "aaaabbbbccccdddd", ("dp",)),
        (
            (1, 2, 2, 2),
            "aaaabbbb",
            ("x",),
        ),  # a cube of 8 on nodes of 4: x (weights only) across, y and z inside
        ((1, 1, 4, 2), "aaaabbbb", ("y",)),
        ((2, 2, 2, 2), "aaaaaaaabbbbbbbb", ("dp",)),
        ((1, 2, 2, 1), "aaaa", ()),
    ],
)
def test_axes_across_nodes_follow_the_rank_order(mesh, nodes, axes):
    assert axes_across_nodes(mesh, list(nodes)) == axes


def test_init_grid_rejects_wrong_world_on_real_group():
    assert all(harness.run(8, init_mismatch_job))


def split_gather_job(grid, layout):
    torch.manual_seed(seed_for(grid, 30))
    full = torch.randn(4, 3, 8, dtype=torch.float64, requires_grad=True)
    part = split_activation(full, layout, grid)
    assert rel(part, local(full.detach(), layout, grid)) == 0
    back = gather_activation(part * 2, layout, grid)
    w = torch.randn_like(full)
    (back * w).sum().backward()
    # gather's backward keeps this rank's slice of w; split's backward assembles the slices: 2w everywhere.
    return {"roundtrip": rel(back, 2 * full.detach()), "grad": rel(full.grad, 2 * w)}


@pytest.mark.parametrize("layout", ["z", "y"])
def test_split_gather_activation(layout):
    for r in harness.run(8, on_grids, GRIDS_8, split_gather_job, layout):
        for errs in r.values():
            assert errs["roundtrip"] == 0 and errs["grad"] < 1e-12, errs


def indivisible_job(grid):
    with pytest.raises(
        ValueError,
        match=r"dim 0 of size 5 is split over px=2·py=2 = 4 ranks, but 5 % 4 = 1; make it a multiple of 4",
    ):
        split_activation(torch.randn(5, 3, 8), "z", grid)
    return True


def test_indivisible_activation_raises():
    assert all(harness.run(8, on_grids, [(2, 2, 2)], indivisible_job)[0].values())
