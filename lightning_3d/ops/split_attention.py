"""Causal attention over a sequence whose tokens are split over a row group (context parallelism).

Each of the ``R`` ranks holds ``2L`` tokens of every sequence, chunks ``r`` and ``2R-1-r`` of
``2R`` (:mod:`~lightning_3d.ops.sequence_split`). Queries stay where they are; keys and values are
all-gathered over the group, as Llama 3's context parallelism does:

- :func:`gather_sequence` all-gathers the local ``[..., 2L, ...]`` keys and values into the whole
  sequence ``[..., s, ...]`` in true token order (one collective for K and V together, and only
  the key/value heads: grouped-query attention is never expanded to the query heads); its
  backward reduce-scatters dK, dV to the ranks that own the tokens.
- :func:`attend_local_chunks` splits each of the rank's query chunks ``c`` into its diagonal
  block (keys ``[c·L, (c+1)·L)``, square, causal) and its off-diagonal block (keys ``[0, c·L)``,
  no mask), runs each as one fused attention call that also returns its log-sum-exp, and merges
  the two by their log-sum-exp (in float32). Backward runs each block's fused backward once,
  given the merged output and log-sum-exp, which yields the block's share of the merged gradients
  (as ring attention does). At most four fused calls per rank and pass; no mask is built
  anywhere; grouped-query key/value heads go to the kernels as they are.

The kernel is the one SDPA would choose and that returns its log-sum-exp: cuDNN where it takes the
shapes (Hopper), else flash attention, on CUDA in float16/bfloat16; CPU's flash kernel on CPU (any
float dtype). ``torch.nn.attention.sdpa_kernel`` restricts the choice as it does SDPA's. Other
cases (CUDA float32) raise. The kernels are called through their ``torch.ops.aten`` operators
because ``scaled_dot_product_attention`` returns no log-sum-exp.

Its speed against one causal SDPA over the whole sequence, and the forms it was chosen over (one
call per chunk with a lower-right causal mask, ``flex_attention`` with a block mask), are in
``docs/benchmarks.md`` (``benchmarks/micro/split_attention.py``).

:func:`split_causal_attention` is the two together: ``q`` ``[b, 2L, heads, d]`` and local
``k, v`` ``[b, 2L, kv_heads, d]`` → ``[b, 2L, heads·d]``, this rank's rows of the dense causal
attention of the whole sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention

from ..comm import all_gather_dim0, reduce_scatter_dim0
from .sequence_split import check_split, chunks_of


class _GatherSequence(torch.autograd.Function):
    """Local tokens ``[..., 2L, ...]`` → the whole sequence ``[..., s, ...]`` on every rank of the group;
    backward sums the whole-sequence gradient over the group and keeps this rank's tokens."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ranks = dist.get_world_size(group)
        ctx.group, ctx.dim, ctx.ranks = group, dim, ranks
        gathered, _ = all_gather_dim0(local.contiguous(), group)  # [R·n0, ...]: rank r's block r-th
        length = local.shape[dim] // 2
        halves = [piece.split(length, dim) for piece in gathered.chunk(ranks, 0)]
        return torch.cat(
            [halves[r][0] for r in range(ranks)] + [halves[r][1] for r in reversed(range(ranks))], dim
        )

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ranks, dim = ctx.ranks, ctx.dim
        length = grad.shape[dim] // (2 * ranks)
        local_shape = list(grad.shape)
        local_shape[dim] = 2 * length
        pieces = grad.new_empty([ranks] + local_shape)  # rank-major, as the reduce-scatter cuts dim 0
        for r in range(ranks):
            for slot, chunk in enumerate(chunks_of(r, ranks)):
                pieces[r].narrow(dim, slot * length, length).copy_(grad.narrow(dim, chunk * length, length))
        local, _ = reduce_scatter_dim0(pieces.flatten(0, 1), ctx.group)
        return local.view(local_shape), None, None


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The whole sequence ``[..., s, ...]`` (true token order) from each rank's ``2L`` local tokens on ``dim``.

    Differentiable: the gradient of ``local`` is the group's summed gradient of this rank's tokens
    (one reduce-scatter). Every rank must pass the same shape.
    """
    ranks = dist.get_world_size(group)
    check_split(local.shape[dim] * ranks, ranks)
    if ranks == 1:
        return local
    return _GatherSequence.apply(local, group, dim % local.dim())


def _block_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> str:
    """The fused kernel the blocks of ``length`` queries run on: ``"cudnn"`` or ``"flash"`` on CUDA (the
    first that takes a diagonal block, square and causal, as SDPA would choose; flash refuses a causal
    mask on a rectangle), ``"cpu"`` (CPU's flash kernel) on CPU."""
    if q.device.type == "cpu":
        return "cpu"
    if q.is_cuda:
        diagonal = (t[:, :, :length] for t in (q, k, v))
        params = SDPAParams(*diagonal, None, 0.0, True, q.shape[1] != k.shape[1])
        if can_use_cudnn_attention(params):
            return "cudnn"
        if can_use_flash_attention(params):
            return "flash"
    raise ValueError(
        f"split attention needs a fused kernel that returns its log-sum-exp: cuDNN or flash attention on CUDA in "
        f"float16/bfloat16, or the CPU kernel; got {q.dtype} on {q.device} with head dim {q.shape[-1]}"
    )


def _block_forward(kernel: str, q, k, v, causal: bool, scale: float | None):
    """One block ``q [b, h, n, d]`` × ``k, v [b, hk, m, d]`` (causal: square, upper-left) →
    ``(out [b, h, n, d], lse [b, h, n], state)``; ``state`` is what its backward needs."""
    if kernel == "cudnn":
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.reshape(q.shape[:3]), (lse.shape, seed, offset, cq, ck, mq, mk)
    if kernel == "flash":
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, (cq, ck, mq, mk, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _block_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float | None, state):
    """``(dq, dk, dv)`` of one block, given the rows' merged output ``out`` and log-sum-exp ``lse``
    (all blocks' softmax: each block's backward then yields its share of the merged gradients)."""
    if kernel == "cudnn":
        lse_shape, seed, offset, cq, ck, mq, mk = state
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse.reshape(lse_shape),
            seed,
            offset,
            None,
            cq,
            ck,
            mq,
            mk,
            0.0,
            causal,
            scale=scale,
        )
    if kernel == "flash":
        cq, ck, mq, mk, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _blocks(rank: int, ranks: int, length: int) -> list[tuple[int, int, int, bool]]:
    """The blocks of ``rank``'s attention: ``(slot, key start, key end, causal)``, per local query
    chunk its diagonal block (causal) and, unless it is the first chunk, the keys before it (no mask)."""
    blocks = []
    for slot, chunk in enumerate(chunks_of(rank, ranks)):
        blocks.append((slot, chunk * length, (chunk + 1) * length, True))
        if chunk:
            blocks.append((slot, 0, chunk * length, False))
    return blocks


class _ZigZagAttention(torch.autograd.Function):
    """``q [b, h, 2L, d]`` (chunks ``rank``, ``2R-1-rank``) × whole-sequence ``k, v [b, hk, s, d]`` →
    ``[b, h, 2L, d]``: per query chunk a diagonal and an off-diagonal fused call merged by log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, rank: int, ranks: int, scale: float | None):
        length = q.shape[2] // 2
        kernel = _block_kernel(q, k, v, length)
        blocks, states = _blocks(rank, ranks, length), []
        outs, lses = [None, None], [None, None]
        for slot, start, end, causal in blocks:
            rows = q.narrow(2, slot * length, length)
            out, lse, state = _block_forward(
                kernel, rows, k[:, :, start:end], v[:, :, start:end], causal, scale
            )
            states.append(state)
            if outs[slot] is None:
                outs[slot], lses[slot] = out, lse
            else:  # merge by log-sum-exp, in float32 (or the inputs' float64)
                wide = torch.promote_types(lse.dtype, torch.float32)
                total = torch.logaddexp(lses[slot].to(wide), lse.to(wide))
                outs[slot] = (
                    outs[slot] * torch.exp(lses[slot] - total)[..., None]
                    + out * torch.exp(lse - total)[..., None]
                ).to(q.dtype)
                lses[slot] = total
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.states, ctx.kernel, ctx.scale = blocks, states, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        length = q.shape[2] // 2
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (slot, start, end, causal), state in zip(ctx.blocks, ctx.states):
            rows = slice(slot * length, (slot + 1) * length)
            # the kernels take the rows' output, its gradient and log-sum-exp as dense tensors of the
            # block's own (cuDNN reads rows cut from a longer sequence wrongly, and may write to them)
            grads = _block_backward(
                ctx.kernel,
                dout[:, :, rows].clone(memory_format=torch.contiguous_format),
                q[:, :, rows],
                k[:, :, start:end],
                v[:, :, start:end],
                out[:, :, rows].clone(memory_format=torch.contiguous_format),
                lse[:, :, rows].clone(memory_format=torch.contiguous_format),
                causal,
                ctx.scale,
                state,
            )
            for total, grad, span in zip((dq, dk, dv), grads, (rows, slice(start, end), slice(start, end))):
                total[:, :, span] += grad
        return dq, dk, dv, None, None, None


def attend_local_chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, ranks: int, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of ``rank``'s query tokens ``q`` ``[b, 2L, heads, d]`` (chunks ``rank`` and
    ``2·ranks-1-rank``) to the whole sequence's ``k, v`` ``[b, s, kv_heads, d]`` → ``[b, 2L, heads·d]``.

    ``heads`` must be a multiple of ``kv_heads``; query head ``i`` attends with key/value head
    ``i // (heads / kv_heads)``, which the kernels take as they are.
    """
    seq_len, heads, kv_heads = k.shape[1], q.shape[2], k.shape[2]
    length = check_split(seq_len, ranks)
    if q.shape[1] != 2 * length or v.shape != k.shape or heads % kv_heads or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"expected q [b, 2L={2 * length}, heads, d] and k, v [b, s={seq_len}, kv_heads, d] with heads "
            f"a multiple of kv_heads, got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
        )
    out = _ZigZagAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), rank, ranks, scale)
    return out.transpose(1, 2).flatten(-2)


def split_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, scale: float | None = None
) -> torch.Tensor:
    """This rank's rows ``[b, 2L, heads·d]`` of the causal attention of whole sequences split over ``group``.

    ``q`` ``[b, 2L, heads, d]`` and ``k, v`` ``[b, 2L, kv_heads, d]`` hold this rank's tokens (chunks
    ``r`` and ``2R-1-r`` of each sequence, :func:`~lightning_3d.ops.sequence_split.split_sequence`),
    already rotated by their true positions. Keys and values are gathered over ``group`` in one
    collective; their gradients are reduce-scattered back.
    """
    if k.shape != v.shape or k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"expected q [b, 2L, heads, d] and k, v [b, 2L, kv_heads, d], "
            f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    kv = gather_sequence(torch.stack([k, v]), group, dim=2)
    return attend_local_chunks(q, kv[0], kv[1], rank, ranks, scale)
