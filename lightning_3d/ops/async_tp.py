"""Collective matmuls over symmetric memory: a dim-0 gather or scatter pipelined with its product.

NCCL runs a collective as a kernel that needs free SMs, and a cuBLAS GEMM holds every SM until it
ends, so an NCCL all-gather or reduce-scatter next to a GEMM waits for it instead of overlapping.
Here the product is cut into one block of rows per rank of the group and the blocks travel
through NVLink by peer copies of the copy engines, which take no SMs, while the GEMM of the
previous block runs (the decomposition of PyTorch's asynchronous tensor parallelism, on its
symmetric-memory pipelines):

- :func:`all_gather_matmul` ``(all_gather_dim0(a), all_gather_dim0(a) ⊗ b)``: the block of rank
  ``r`` is multiplied as soon as it has arrived.
- :func:`matmul_reduce_scatter` ``reduce_scatter_dim0(a ⊗ b)``: the rows bound for rank ``r`` are
  multiplied and sent while the next rows are multiplied; each rank sums the blocks it received.

``⊗`` is the local product of form ``"ab"`` (``a @ b``) or ``"abt"`` (``a @ bᵀ``), whose output
rows are ``a``'s rows (the ``"atb"`` form sums over them and cannot be cut this way). Results
equal the plain path up to the order of the sums. Enabled by ``RuntimeOptions(async_tp=True)``.

On CUDA every rank of the group must be able to map its peers' memory (one NVLink domain). On
CPU the blocks travel by gloo (one all-gather, one all-to-all) with the same decomposition and
no overlap: the path the CPU tests prove equal to the dense model.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .. import comm

FORMS = ("ab", "abt")  # the local products whose output rows are the rows of a
# PyTorch's private pipeline helpers used on CUDA (present in torch 2.11 and 2.13)
PIPELINES = ("_pipelined_all_gather_and_consume", "_pipelined_produce_and_all2all")


def check_available(device_type: str, cube_size: int, axes_across_nodes: tuple[str, ...] = ()) -> None:
    """Raise a ValueError naming the fix when collective matmuls cannot run: a device other than
    CUDA or CPU, no symmetric memory in this torch, or a CUDA cube whose ``axes_across_nodes``
    (of x, y, z) span nodes (its ranks must map each other's memory)."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(
            f"async_tp=True runs on 'cuda' or 'cpu' grids, not {device_type!r}: pass async_tp=False"
        )
    if device_type == "cuda":
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as e:
            raise ValueError(
                f"async_tp=True needs torch.distributed._symmetric_memory, missing from torch {torch.__version__}: "
                "pass async_tp=False or upgrade torch"
            ) from e
        missing = [name for name in PIPELINES if not hasattr(symm_mem, name)]
        if missing:
            raise ValueError(
                f"async_tp=True needs PyTorch's symmetric-memory pipelines {missing}, missing from torch "
                f"{torch.__version__}: pass async_tp=False"
            )
        spanning = [a for a in axes_across_nodes if a in ("x", "y", "z")]
        if spanning:
            raise ValueError(
                f"async_tp=True needs every cube of px·py·pz = {cube_size} ranks on one node (one NVLink domain), "
                f"but the cube's {'+'.join(spanning)} groups span nodes: use a grid whose px·py·pz divides the "
                "ranks per node, or pass async_tp=False"
            )


def _group_name(group: dist.ProcessGroup) -> str:
    """The group's name, with symmetric memory enabled for it (torch < 2.12 needs the call)."""
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    if not symm_mem.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
    return name


def _gather_and_consume(shard: torch.Tensor, consume, group: dist.ProcessGroup) -> torch.Tensor:
    """``all_gather_dim0(shard)``, calling ``consume(block_r, r)`` on the block of every rank ``r``."""
    if shard.is_cuda:
        from torch.distributed._symmetric_memory import _pipelined_all_gather_and_consume

        gathered = shard.new_empty((shard.shape[0] * group.size(),) + shard.shape[1:])
        _pipelined_all_gather_and_consume(shard, consume, gathered, _group_name(group))
        return gathered
    gathered, _ = comm.all_gather_dim0(shard, group)
    for rank, block in enumerate(gathered.chunk(group.size())):
        consume(block, rank)
    return gathered


def _produce_and_exchange(produce, received: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``produce(r, out)`` writes the block bound for rank ``r``; block ``r`` of ``received`` is
    what rank ``r`` produced for this one."""
    if received.is_cuda:
        from torch.distributed._symmetric_memory import _pipelined_produce_and_all2all

        _pipelined_produce_and_all2all(produce, received, _group_name(group))
        return
    produced = torch.empty_like(received)
    for rank, block in enumerate(produced.chunk(group.size())):
        produce(rank, block)
    dist.all_to_all_single(received, produced, group=group)


def _mm_into(
    form: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    """``out = a ⊗ b (+ bias)`` for 2-D ``a``; ``b`` is ``[k, n]`` (``"ab"``) or ``[n, k]`` (``"abt"``)."""
    b = b if form == "ab" else b.t()
    if bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)


def _out_features(form: str, b: torch.Tensor) -> int:
    return b.shape[1] if form == "ab" else b.shape[0]


def all_gather_matmul(
    form: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, A ⊗ b + bias)`` with ``A = all_gather_dim0(a, group)``.

    ``a`` ``[m, ..., k]`` → ``A`` ``[m·g, ..., k]`` and the product ``[m·g, ..., n]``.
    """
    g = group.size()
    rows = a.reshape(-1, a.shape[-1]).contiguous()
    n = _out_features(form, b)
    product = rows.new_empty(rows.shape[0] * g, n)
    blocks = product.chunk(g)

    def consume(block: torch.Tensor, rank: int) -> None:
        _mm_into(form, block, b, bias, blocks[rank])

    gathered = _gather_and_consume(rows, consume, group)
    lead = (a.shape[0] * g,) + tuple(a.shape[1:-1])
    return gathered.view(lead + (a.shape[-1],)), product.view(lead + (n,))


def matmul_reduce_scatter(
    form: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup
) -> torch.Tensor:
    """``reduce_scatter_dim0(a ⊗ b + bias, group)``: ``a`` ``[m·g, ..., k]`` → ``[m, ..., n]``.

    Pass ``bias`` on one rank of the group only: every rank's product is summed.
    """
    g = group.size()
    if a.shape[0] % g:
        raise ValueError(
            f"cannot reduce-scatter dim 0 of size {a.shape[0]} over {g} ranks: {a.shape[0]} % {g} != 0"
        )
    rows = a.reshape(-1, a.shape[-1])
    row_blocks = rows.chunk(g)
    n = _out_features(form, b)
    received = rows.new_empty(rows.shape[0], n)  # block r: rank r's product of my rows

    def produce(rank: int, out: torch.Tensor) -> None:
        _mm_into(form, row_blocks[rank], b, bias, out)

    _produce_and_exchange(produce, received, group)
    summed = received.view(g, rows.shape[0] // g, n).sum(0)
    return summed.view((a.shape[0] // g,) + tuple(a.shape[1:-1]) + (n,))
