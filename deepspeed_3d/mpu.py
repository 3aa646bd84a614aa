"""GridMPU: the grid seen through DeepSpeed's model-parallel-unit (``mpu``) interface.

It answers as DeepSpeed's own ``PipelineParallelGrid`` on a ``PipeModelDataParallelTopology(pp,
px·py·pz, dp)`` would: that topology numbers ranks pipe-major, then data, then model, as the grid
numbers them stage-major, then dp, then the cube. So the groups are:

================================== ================================================ ==============
queries                            group                                            size
================================== ================================================ ==============
``get_model_parallel_*``           ``"replica"``: every stage's cube of one replica ``pp·px·py·pz``
``get_slice_parallel_*``,          ``"cube"``: this stage's cube                    ``px·py·pz``
``get_tensor_model_parallel_*``
``get_pipe_parallel_*``,           ``"pipe"``: this rank's peer in every stage      ``pp``
``get_pipeline_model_parallel_*``
``get_data_parallel_*``            ``"dp"``: this stage's replicas of this shard    ``dp``
================================== ================================================ ==============

DeepSpeed sums gradient norms and overflow flags over the model-parallel group, so they cover
every stage; ZeRO partitions and gradient averaging run over dp inside a stage. With one stage the
model-parallel group is the cube and the pipe group holds this rank alone. The object
deliberately has no ``initialize_sequence_parallel``: DeepSpeed takes an ``mpu`` with that method
for a sequence-parallel unit and then ignores its model and data-parallel groups.
"""

from __future__ import annotations

import torch.distributed as dist

from lightning_3d.grid import Grid


class GridMPU:
    """The ``mpu`` to pass to ``deepspeed.initialize``: model parallel = every stage's cube, tensor
    parallel = the cube, pipeline = the stages, data parallel = dp.

    Ranks inside the cube are numbered row-major over ``(i, j, l)``; cube rank 0 is ``(0, 0, 0)``.
    Model-parallel rank = ``stage · px·py·pz + cube rank``.
    """

    def __init__(self, grid: Grid):
        self.grid = grid

    # Megatron's original names, as PipelineParallelGrid answers them: every stage's cube.
    def get_model_parallel_rank(self) -> int:
        return self.grid.rank_in("replica")

    def get_model_parallel_world_size(self) -> int:
        return self.grid.size("replica")

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.grid.group("replica")

    def get_model_parallel_src_rank(self) -> int:
        """Global rank of model-parallel rank 0: cube rank 0 of this replica's first stage."""
        return dist.get_global_rank(self.get_model_parallel_group(), 0)

    # Tensor slicing (PipelineParallelGrid's "slice"; the newer names DeepSpeed prefers,
    # ``deepspeed.utils.bwc``): the cube.
    def get_slice_parallel_rank(self) -> int:
        return self.grid.rank_in("cube")

    def get_slice_parallel_world_size(self) -> int:
        return self.grid.cube_size

    def get_slice_parallel_group(self) -> dist.ProcessGroup:
        return self.grid.group("cube")

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of cube rank 0 in this rank's cube."""
        return dist.get_global_rank(self.get_slice_parallel_group(), 0)

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group

    # Pipeline: this rank's stage; its group holds the rank with the same (d, i, j, l) in every stage.
    def get_pipe_parallel_rank(self) -> int:
        return self.grid.stage

    def get_pipe_parallel_world_size(self) -> int:
        return self.grid.pipeline_size

    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        return self.grid.group("pipe")

    get_stage_id = get_pipe_parallel_rank
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    # Data parallelism: the replicas of this rank's shard, inside its stage.
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
