"""GridMPU: the 3-D grid seen through DeepSpeed's model-parallel-unit (``mpu``) interface.

DeepSpeed reads three groups from an ``mpu``: the model-parallel group (here the cube, the
``px·py·pz`` ranks that hold one model replica), the data-parallel group (here ``dp``: the ranks
that hold the same shard in different replicas; ZeRO partitions and gradient averaging run over
it) and, through the newer Megatron names, the tensor-model-parallel group (the cube again) and a
pipeline group of size 1. The object deliberately has no ``initialize_sequence_parallel``: DeepSpeed
takes an ``mpu`` with that method for a sequence-parallel unit and then ignores its model and
data-parallel groups.
"""

from __future__ import annotations

import torch.distributed as dist

from lightning_3d.grid import Grid


class GridMPU:
    """The ``mpu`` to pass to ``deepspeed.initialize``: model parallel = the cube, data parallel = dp.

    Ranks inside the cube are numbered row-major over ``(i, j, l)``; cube rank 0 is ``(0, 0, 0)``.
    """

    def __init__(self, grid: Grid):
        self.grid = grid
        self._pipeline_group: dist.ProcessGroup | None = None

    # Megatron's original names: the model-parallel group is the whole cube.
    def get_model_parallel_rank(self) -> int:
        return self.grid.rank_in("cube")

    def get_model_parallel_world_size(self) -> int:
        return self.grid.cube_size

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.grid.group("cube")

    def get_model_parallel_src_rank(self) -> int:
        """Global rank of cube rank 0 in this rank's cube."""
        return dist.get_global_rank(self.get_model_parallel_group(), 0)

    # The newer names DeepSpeed prefers (``deepspeed.utils.bwc``): tensor parallelism is the cube.
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_src_rank = get_model_parallel_src_rank

    # No pipeline parallelism: every rank is its own one-stage pipeline.
    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        """A group holding this rank alone (created on first use, by this rank only)."""
        if self._pipeline_group is None:
            self._pipeline_group = dist.new_group(
                [dist.get_rank()], timeout=self.grid.timeout, use_local_synchronization=True
            )
        return self._pipeline_group

    # Data parallelism: the replicas of this rank's shard.
    def get_data_parallel_rank(self) -> int:
        return self.grid.rank_in("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.grid.data_parallel_size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.grid.group("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        """Global ranks of this rank's dp group, in dp order."""
        return dist.get_process_group_ranks(self.get_data_parallel_group())

    def __repr__(self) -> str:
        return f"GridMPU({self.grid!r})"
