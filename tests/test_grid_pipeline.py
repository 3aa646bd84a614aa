"""The grid's pipeline axis: stage-major rank order, stage groups, hand-over between stage peers, and
GridMPU's answers against DeepSpeed's own PipelineParallelGrid of the same topology.

One job per world size builds each grid in turn (world 4: pp 2 × 2×1×1, pp 2 × 1×1×1 × dp 2,
pp 4; world 8: pp 2 × 2×2×1) and checks all of it on that grid, because spawning and importing
DeepSpeed cost more than the checks.
"""

from __future__ import annotations

import math

import harness
import pytest
import torch
import torch.distributed as dist

from lightning_3d import destroy_grid, init_grid
from lightning_3d.grid import _check_shape, axes_across_nodes

GROUPS = ("x", "y", "z", "xy", "xz", "yz", "cube", "dp", "pipe", "replica")
VARYING = {  # the dims of (stage, d, i, j, l) along which a group's members differ
    "x": {2}, "y": {3}, "z": {4}, "xy": {2, 3}, "xz": {2, 4}, "yz": {3, 4},
    "cube": {2, 3, 4}, "dp": {1}, "pipe": {0}, "replica": {0, 2, 3, 4},
}  # fmt: skip


def _mpu_answers(mpu) -> dict:
    """What an mpu says, with groups as their global ranks."""
    ranks = dist.get_process_group_ranks
    return {
        "pipe": (
            mpu.get_pipe_parallel_rank(),
            mpu.get_pipe_parallel_world_size(),
            ranks(mpu.get_pipe_parallel_group()),
        ),
        "pipeline": (mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()),
        "stage": mpu.get_stage_id(),
        "model": (
            mpu.get_model_parallel_rank(),
            mpu.get_model_parallel_world_size(),
            ranks(mpu.get_model_parallel_group()),
        ),
        "slice": (
            mpu.get_slice_parallel_rank(),
            mpu.get_slice_parallel_world_size(),
            ranks(mpu.get_slice_parallel_group()),
        ),
        "tensor": (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()),
        "dp": (
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
            ranks(mpu.get_data_parallel_group()),
        ),
        "dp_ranks": list(mpu.get_data_parallel_group_ranks()),
    }


def pipeline_job(configs):
    """Per ``(pp, shape, dp)``: the grid's answers, its groups' members, what arrived from the stage
    peers, and GridMPU's and DeepSpeed's answers."""
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    from deepspeed_3d import GridMPU

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the harness's default group
    out = {}
    for pp, shape, dp in configs:
        grid = init_grid(shape, dp, pipeline_size=pp)
        members = {}
        for axes in GROUPS:
            group = grid.group(axes)
            members[axes] = dist.get_process_group_ranks(group)
            assert grid.size(axes) == len(members[axes]) and grid.rank_in(axes) == dist.get_rank(group), axes
        gathered = [torch.zeros((), dtype=torch.long) for _ in range(grid.size("replica"))]
        dist.all_gather(gathered, torch.tensor(dist.get_rank()), group=grid.group("replica"))
        # Activations forward and gradients back: each stage tells its peers its stage and coordinates.
        me = torch.tensor([dist.get_rank(), grid.stage, *grid.coords])
        peers = {"prev": grid.prev_stage_peer, "next": grid.next_stage_peer}
        got = {side: torch.zeros_like(me) for side, peer in peers.items() if peer is not None}
        works = [dist.isend(me, peer) for peer in peers.values() if peer is not None]
        works += [dist.irecv(got[side], peers[side]) for side in got]
        for work in works:
            work.wait(harness.COLLECTIVE_TIMEOUT)
        dp_size, cube = grid.data_parallel_size, grid.cube_size
        ours = _mpu_answers(GridMPU(grid))
        ours["src"] = (
            GridMPU(grid).get_model_parallel_src_rank(),
            GridMPU(grid).get_tensor_model_parallel_src_rank(),
        )
        theirs = _mpu_answers(PipelineParallelGrid(PipeModelDataParallelTopology(pp, cube, dp_size)))
        out[pp, shape, dp] = {
            "stage": grid.stage,
            "coords": grid.coords,
            "ends": (grid.is_first_stage, grid.is_last_stage),
            "peers": peers,
            "stage_peers": [grid.stage_peer(s) for s in range(pp)],
            "members": members,
            "gathered": sorted(int(r) for r in gathered),
            "got": {side: t.tolist() for side, t in got.items()},
            "mesh": (tuple(grid.mesh.shape), grid.mesh.mesh_dim_names, grid.mesh.mesh.flatten().tolist()),
            "repr": repr(grid),
            "mpu": ours,
            "deepspeed": theirs,
        }
        destroy_grid(grid)
    return out


def refusal_job():
    """Ranks that disagree on pipeline_size, and a pipeline_size the world does not divide, raise on every rank."""
    with pytest.raises(ValueError, match="pipeline_size"):
        init_grid((1, 1, 1), pipeline_size=2 if dist.get_rank() < 2 else 4)
    with pytest.raises(ValueError, match="world size 4 is not divisible by pipeline_size·px·py·pz = 3·1 = 3"):
        init_grid((1, 1, 1), pipeline_size=3)
    return True


def _position(rank: int, pp: int, dp: int, shape: tuple[int, int, int]) -> tuple[int, ...]:
    """``(stage, d, i, j, l)`` of a global rank, from the rank order alone."""
    return tuple(int(c) for c in torch.unravel_index(torch.tensor(rank), (pp, dp, *shape)))


def _check(results: list[dict]) -> None:
    world = len(results)
    for (pp, shape, dp_arg), _ in results[0].items():
        cube = math.prod(shape)
        dp = world // (pp * cube)
        assert dp_arg in (None, dp)
        positions = [_position(r, pp, dp, shape) for r in range(world)]
        for rank, res in enumerate(results):
            r = res[pp, shape, dp_arg]
            where = f"pp {pp} × {shape} × dp {dp}, rank {rank}"
            stage, *coords = positions[rank]
            assert (r["stage"], list(r["coords"])) == (stage, coords), where
            assert r["ends"] == (stage == 0, stage == pp - 1), where
            peers = [q for q in range(world) if positions[q][1:] == positions[rank][1:]]
            assert r["stage_peers"] == peers and r["members"]["pipe"] == peers, where
            assert r["peers"] == {
                "prev": peers[stage - 1] if stage > 0 else None,
                "next": peers[stage + 1] if stage < pp - 1 else None,
            }, where
            for side, step in (
                ("prev", -1),
                ("next", 1),
            ):  # what the stage peer sent: its rank, stage, coords
                if r["peers"][side] is not None:
                    assert r["got"][side] == [r["peers"][side], stage + step, *coords], (
                        where,
                        side,
                        r["got"],
                    )
            for axes, members in r["members"].items():
                fixed = [k for k in range(5) if k not in VARYING[axes]]
                expected = [
                    q for q in range(world) if all(positions[q][k] == positions[rank][k] for k in fixed)
                ]
                assert members == expected, (where, axes, members, expected)
            assert r["gathered"] == r["members"]["replica"], where
            stage_ranks = list(range(stage * dp * cube, (stage + 1) * dp * cube))
            assert r["mesh"] == ((dp, *shape), ("dp", "x", "y", "z"), stage_ranks), (where, r["mesh"])
            assert r["repr"].startswith(
                f"Grid({'×'.join(map(str, shape))}, dp={dp}, stage {stage} of {pp}, "
            ), r["repr"]
            mpu = dict(r["mpu"])
            assert mpu.pop("src") == (r["members"]["replica"][0], r["members"]["cube"][0]), where
            assert mpu == r["deepspeed"], (where, mpu, r["deepspeed"])
            assert mpu["model"] == (
                r["members"]["replica"].index(rank),
                pp * cube,
                r["members"]["replica"],
            ), where
            assert mpu["dp"] == (coords[0], dp, r["members"]["dp"]), where


def test_pipeline_grid_world_4():
    configs = [(2, (2, 1, 1), 1), (2, (1, 1, 1), None), (4, (1, 1, 1), None)]
    _check(harness.run(4, pipeline_job, configs))
    assert all(harness.run(4, refusal_job))


def test_pipeline_grid_world_8():
    _check(harness.run(8, pipeline_job, [(2, (2, 2, 1), None)]))


@pytest.mark.parametrize(
    "shape, world, dp, pp, message",
    [
        (
            (2, 1, 1), 6, None, 2,
            "world size 6 is not divisible by pipeline_size·px·py·pz = 2·2 = 4 for grid (2, 1, 1); launch a "
            "multiple of 4 processes or pick a pipeline_size and grid whose product divides 6",
        ),
        (
            (2, 1, 1), 8, 3, 2,
            "world size 8 != pp·dp·px·py·pz = 2·3·2·1·1 = 12; launch 12 processes or change the grid / "
            "data_parallel_size / pipeline_size",
        ),
        ((1, 1, 1), 4, None, 0, "pipeline_size must be a positive int, got 0 (a int)"),
        ((1, 1, 1), 4, None, 2.0, "pipeline_size must be a positive int, got 2.0 (a float)"),
        ((1, 1, 1), 4, None, "2", "pipeline_size must be a positive int, got '2' (a str)"),
    ],
)  # fmt: skip
def test_bad_pipeline_raises(shape, world, dp, pp, message):
    with pytest.raises(ValueError) as e:
        _check_shape(shape, world, dp, pp)
    assert str(e.value) == message


def test_pipeline_checks_pass_the_sizes_that_divide():
    assert _check_shape((2, 1, 1), 8, None, 2) == ((2, 1, 1), 2, 2)
    assert _check_shape((2, 2, 1), 8, 1, 2) == ((2, 2, 1), 1, 2)


@pytest.mark.parametrize(
    "mesh, nodes, axes",
    [
        ((1, 2, 2, 1, 1), "aabb", ("dp",)),  # one stage: as without the pipeline axis
        ((2, 1, 2, 1, 1), "aabb", ("pipe",)),  # a stage per node
        ((2, 2, 2, 1, 1), "aabbccdd", ("pipe", "dp")),
        ((2, 2, 2, 1, 1), "aaaabbbb", ("pipe",)),  # dp inside a node, stages across
        ((2, 1, 2, 2, 2), "aaaabbbbccccdddd", ("pipe", "x")),  # cubes of 8 on nodes of 4
    ],
)
def test_axes_across_nodes_with_stages(mesh, nodes, axes):
    assert axes_across_nodes(mesh, list(nodes)) == axes
