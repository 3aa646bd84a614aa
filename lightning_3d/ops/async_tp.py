"""Collective matmuls: a dim-0 gather or scatter pipelined with its product.

NCCL runs a collective as a kernel that needs free SMs, and a cuBLAS GEMM holds every SM until it
ends, so an NCCL all-gather or reduce-scatter next to a GEMM waits for it instead of overlapping.
Here the product is cut into one block of rows per rank of the group, and each block is
multiplied while the others travel (the decomposition of PyTorch's asynchronous tensor
parallelism):

- :func:`all_gather_matmul` ``(all_gather_dim0(a), all_gather_dim0(a) ⊗ b)``: the block of rank
  ``r`` is multiplied as soon as it has arrived.
- :func:`matmul_reduce_scatter` ``reduce_scatter_dim0(a ⊗ b)``: the rows bound for rank ``r`` are
  multiplied and sent while the next rows are multiplied; each rank sums the blocks it received.

``⊗`` is the local product of form ``"ab"`` (``a @ b``) or ``"abt"`` (``a @ bᵀ``), whose output
rows are ``a``'s rows (the ``"atb"`` form sums over them and cannot be cut this way). Results
equal the plain path up to the order of the sums. Enabled by ``RuntimeOptions(async_tp=True)``;
``RuntimeOptions.async_tp_transport`` picks how the blocks travel (:data:`~lightning_3d.options.TRANSPORTS`):

- ``"symmetric_memory"`` (CUDA): peer copies of the copy engines through NVLink, which take no
  SMs, on PyTorch's symmetric-memory pipelines; every block but the first hides behind a
  product. Every rank of the group must map its peers' memory (one NVLink domain), whatever
  NCCL's own settings (``NCCL_P2P_DISABLE`` does not reach it).
- ``"process_group"``: the group's own collectives (NCCL on CUDA, gloo on CPU), one all-gather or
  one all-to-all a product, started before the rank's own block is multiplied and waited for
  after it: the own block's product (``1/g`` of it) hides the transfer. It runs wherever the
  group's collectives run: across nodes, and through host memory where NCCL's peer-to-peer is
  off. On CPU every transport takes this path, which the CPU tests prove equal to the dense model.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .. import comm

FORMS = ("ab", "abt")  # the local products whose output rows are the rows of a
# PyTorch's private pipeline helpers used on CUDA (present in torch 2.11 and 2.13)
PIPELINES = ("_pipelined_all_gather_and_consume", "_pipelined_produce_and_all2all")


def check_available(device_type: str, cube_size: int, axes_across_nodes: tuple[str, ...] = (),
                    transport: str = "symmetric_memory") -> None:
    """Raise a ValueError naming the fix when collective matmuls cannot run: a device other than
    CUDA or CPU; for the ``"symmetric_memory"`` transport on CUDA, no symmetric memory in this
    torch or a cube whose ``axes_across_nodes`` (of x, y, z) span nodes (its ranks must map each
    other's memory)."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"async_tp=True runs on 'cuda' or 'cpu' grids, not {device_type!r}: pass async_tp=False")
    if device_type == "cuda" and transport == "symmetric_memory":
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as e:
            raise ValueError(f"async_tp=True needs torch.distributed._symmetric_memory, missing from torch {torch.__version__}: "
                             "pass async_tp_transport='process_group' or async_tp=False, or upgrade torch") from e
        missing = [name for name in PIPELINES if not hasattr(symm_mem, name)]
        if missing:
            raise ValueError(f"async_tp=True needs PyTorch's symmetric-memory pipelines {missing}, missing from torch "
                             f"{torch.__version__}: pass async_tp_transport='process_group' or async_tp=False")
        spanning = [a for a in axes_across_nodes if a in ("x", "y", "z")]
        if spanning:
            raise ValueError(f"async_tp=True over symmetric memory needs every cube of px·py·pz = {cube_size} ranks on one "
                             f"node (one NVLink domain), but the cube's {'+'.join(spanning)} groups span nodes: pass "
                             "async_tp_transport='process_group' (NCCL), use a grid whose px·py·pz divides the ranks per "
                             "node, or pass async_tp=False")


_enabled: set[str] = set()


def _group_name(group: dist.ProcessGroup) -> str:
    """The group's name, with symmetric memory enabled for it (torch < 2.12 needs the call)."""
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    if name not in _enabled:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
        _enabled.add(name)
    return name


def _gather_and_consume(shard: torch.Tensor, consume, group: dist.ProcessGroup, transport: str) -> torch.Tensor:
    """``all_gather_dim0(shard)``, calling ``consume(block_r, r)`` on the block of every rank ``r``."""
    if shard.is_cuda and transport == "symmetric_memory":
        from torch.distributed._symmetric_memory import _pipelined_all_gather_and_consume

        gathered = shard.new_empty((shard.shape[0] * group.size(),) + shard.shape[1:])
        _pipelined_all_gather_and_consume(shard, consume, gathered, _group_name(group))
        return gathered
    own = dist.get_rank(group)
    gathered, arrived = comm.all_gather_dim0(shard, group, async_op=True)
    consume(shard, own)  # while the other blocks travel
    arrived.wait()
    for rank, block in enumerate(gathered.chunk(group.size())):
        if rank != own:
            consume(block, rank)
    return gathered


def _produce_and_sum(produce, out: torch.Tensor, group: dist.ProcessGroup, transport: str) -> torch.Tensor:
    """``out``, written with the sum over the group's ranks of the block each produced for this one:
    ``produce(r, block)`` writes the block bound for rank ``r`` (``out``'s shape and dtype)."""
    g, m = group.size(), out.shape[0]
    if out.is_cuda and transport == "symmetric_memory":
        from torch.distributed._symmetric_memory import _pipelined_produce_and_all2all

        received = out.new_empty((g * m,) + out.shape[1:])  # block r: rank r's product for this one
        _pipelined_produce_and_all2all(produce, received, _group_name(group))
        return torch.sum(received.view((g,) + out.shape), 0, out=out)
    own = dist.get_rank(group)
    outgoing = out.new_empty(((g - 1) * m,) + out.shape[1:])  # the blocks bound for the other ranks, in rank order
    for slot, rank in enumerate(r for r in range(g) if r != own):
        produce(rank, outgoing[slot * m:(slot + 1) * m])
    incoming = torch.empty_like(outgoing)
    splits = [0 if rank == own else m for rank in range(g)]  # the own block stays out of the exchange
    sent = dist.all_to_all_single(incoming, outgoing, splits, splits, group=group, async_op=True)
    produce(own, out)  # while the other blocks travel
    sent.wait()
    return out.add_(incoming.view((g - 1,) + out.shape).sum(0))


def _mm_into(form: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = a ⊗ b (+ bias)`` for 2-D ``a``; ``b`` is ``[k, n]`` (``"ab"``) or ``[n, k]`` (``"abt"``)."""
    b = b if form == "ab" else b.t()
    if bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)


def _out_features(form: str, b: torch.Tensor) -> int:
    return b.shape[1] if form == "ab" else b.shape[0]


def all_gather_matmul(form: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                      group: dist.ProcessGroup, transport: str = "symmetric_memory") -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, A ⊗ b + bias)`` with ``A = all_gather_dim0(a, group)``, the blocks moved by ``transport``.

    ``a`` ``[m, ..., k]`` → ``A`` ``[m·g, ..., k]`` and the product ``[m·g, ..., n]``.
    """
    g = group.size()
    rows = a.reshape(-1, a.shape[-1]).contiguous()
    n = _out_features(form, b)
    product = rows.new_empty(rows.shape[0] * g, n)
    blocks = product.chunk(g)

    def consume(block: torch.Tensor, rank: int) -> None:
        _mm_into(form, block, b, bias, blocks[rank])

    gathered = _gather_and_consume(rows, consume, group, transport)
    lead = (a.shape[0] * g,) + tuple(a.shape[1:-1])
    return gathered.view(lead + (a.shape[-1],)), product.view(lead + (n,))


def matmul_reduce_scatter(form: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                          group: dist.ProcessGroup, transport: str = "symmetric_memory") -> torch.Tensor:
    """``reduce_scatter_dim0(a ⊗ b + bias, group)``: ``a`` ``[m·g, ..., k]`` → ``[m, ..., n]``, the blocks
    moved by ``transport``.

    Pass ``bias`` on one rank of the group only: every rank's product is summed.
    """
    g = group.size()
    if a.shape[0] % g:
        raise ValueError(f"cannot reduce-scatter dim 0 of size {a.shape[0]} over {g} ranks: {a.shape[0]} % {g} != 0")
    rows = a.reshape(-1, a.shape[-1])
    row_blocks = rows.chunk(g)
    n = _out_features(form, b)

    def produce(rank: int, out: torch.Tensor) -> None:
        _mm_into(form, row_blocks[rank], b, bias, out)

    summed = _produce_and_sum(produce, rows.new_empty(rows.shape[0] // g, n), group, transport)
    return summed.view((a.shape[0] // g,) + tuple(a.shape[1:-1]) + (n,))
