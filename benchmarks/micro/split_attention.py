"""Causal attention over a sequence split over P ranks, the P ranks' kernels run one after another on
one GPU (no communication), against one causal SDPA over the whole sequence; forward + backward.

Every rank holds chunks r and 2P-1-r of 2P (:mod:`lightning_3d.ops.sequence_split`) and attends to
the whole sequence's keys and values. The forms of a rank's kernels:

- ``lse_merge``: the library's form (:func:`lightning_3d.ops.split_attention.attend_local_chunks`):
  per query chunk a diagonal block (causal) and an off-diagonal block (no mask), each one fused
  call on the kernel SDPA would choose (cuDNN on Hopper), merged by their log-sum-exp;
  ``lse_merge_flash``: the same on the flash kernel;
- ``lower_right``: per query chunk one SDPA call against keys[:(c+1)·L] with a lower-right causal
  mask (``causal_lower_right``: torch runs it on the flash or memory-efficient kernel only);
- ``flex``: one compiled ``flex_attention`` call per rank with a block mask of the rank's true
  query positions (mask creation not timed).

Each form's time (CUDA events, warm-up excluded, median of repeats) is reported as a ratio to the
fastest causal SDPA over the whole sequence (the default backend and each fused backend that runs),
with its max abs difference to that SDPA's output and gradients in the input dtype and its output's
max abs error against a float32 reference (the SDPA's own error beside it, to tell a form's
rounding from the kernel's); each first call runs on memory filled with NaN. ``kernel_ms``: the
sum of the kernels' times of one call (``torch.profiler``), which shows where many small calls
leave the GPU waiting for the host. JSON on stdout and in ``--out``. ``--cpu``: tiny shapes on CPU, float32
(a smoke test).

    PYTHONPATH=. python benchmarks/micro/split_attention.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_3d.ops.sequence_split import chunks_of, split_sequence, token_positions, unsplit_sequence  # noqa: E402
from lightning_3d.ops.split_attention import attend_local_chunks  # noqa: E402

# --- the forms: a rank's query tokens [b, 2L, h, d] and the whole k, v [b, s, hk, d] → [b, 2L, h·d] --


def lse_merge(q, k, v, rank, ranks, scale, _mask):
    return attend_local_chunks(q, k, v, rank, ranks, scale)


def lse_merge_flash(q, k, v, rank, ranks, scale, _mask):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # the blocks' kernel follows SDPA's enabled backends
        return attend_local_chunks(q, k, v, rank, ranks, scale)


def lower_right(q, k, v, rank, ranks, scale, _mask):
    """Per query chunk c one SDPA call against keys[:(c+1)·L] with a lower-right causal mask."""
    length = q.shape[1] // 2
    outs = []
    for slot, chunk in enumerate(chunks_of(rank, ranks)):
        keys = (chunk + 1) * length
        y = F.scaled_dot_product_attention(
            q[:, slot * length : (slot + 1) * length].transpose(1, 2),
            k[:, :keys].transpose(1, 2),
            v[:, :keys].transpose(1, 2),
            attn_mask=causal_lower_right(length, keys),
            scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        outs.append(y.transpose(1, 2))
    return torch.cat(outs, 1).flatten(-2)


def flex(q, k, v, rank, ranks, scale, mask):
    out = FLEX(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=mask,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2).flatten(-2)


FORMS = {"lower_right": lower_right, "lse_merge": lse_merge, "lse_merge_flash": lse_merge_flash, "flex": flex}
FLEX = None


def _causal_at(positions: torch.Tensor):
    """flex_attention's mask_mod: query row ``qi`` (true position ``positions[qi]``) sees keys up to it."""

    def mask_mod(b, h, qi, ki):
        return positions[qi] >= ki

    return mask_mod


def flex_masks(seq_len: int, ranks: int, device) -> list:
    from torch.nn.attention.flex_attention import create_block_mask

    masks = []
    for r in range(ranks):
        positions = token_positions(seq_len, r, ranks, device)
        masks.append(
            create_block_mask(_causal_at(positions), None, None, len(positions), seq_len, device=device)
        )
    return masks


def poison_free_memory(device, gib: float = 16) -> None:
    """Leave ``gib`` of the caching allocator's free memory filled with NaN, from which the next
    allocations are cut: a kernel that reads memory it did not write then shows it (a NaN or a
    large difference) instead of passing on memory that happened to be zero."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.full((int(gib * 2**30) // 2,), float("nan"), dtype=torch.bfloat16, device=device)
        torch.cuda.synchronize()


# --- timing ------------------------------------------------------------------------------------


def median_ms(step, warmup: int, repeats: int, cuda: bool) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def kernel_ms(step) -> float:
    """The GPU's time in one call of ``step``: the sum of its kernels' times (``torch.profiler``),
    which launches the host cannot issue fast enough do not inflate."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0) / 1e3


def run_case(seq_len: int, kv_heads: int, ranks_list, forms, args, device, dtype) -> list[dict]:
    cuda = device.type == "cuda"
    b, h, d = args.batch, args.heads, args.head_dim
    scale = 1 / math.sqrt(d)
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (
        torch.randn(b, seq_len, n, d, device=device, dtype=dtype, generator=gen)
        for n in (h, kv_heads, kv_heads)
    )
    dout = torch.randn(b, seq_len, h * d, device=device, dtype=dtype, generator=gen)
    gqa = kv_heads != h
    warmup, repeats = args.warmup, max(1, args.repeats if seq_len < 65536 else args.repeats_long)
    # float32 reference output (keys expanded: the memory-efficient kernel takes no grouped heads)
    kk, vv = (t.float().repeat_interleave(h // kv_heads, 2).transpose(1, 2) for t in (k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION] if cuda else [SDPBackend.MATH]):
        reference = F.scaled_dot_product_attention(
            q.float().transpose(1, 2), kk, vv, is_causal=True, scale=scale
        )
    reference = reference.transpose(1, 2).flatten(-2)
    del kk, vv
    rows = []

    def leaves(*ts):
        return [t.detach().requires_grad_() for t in ts]

    # the whole sequence: one causal SDPA, per backend
    base = None
    for backend in args.backends:
        lq, lk, lv = leaves(q, k, v)

        def dense(lq=lq, lk=lk, lv=lv, backend=backend):
            lq.grad = lk.grad = lv.grad = None
            chosen = (
                sdpa_kernel([getattr(SDPBackend, backend.upper() + "_ATTENTION")])
                if backend != "default"
                else nullcontext()
            )
            with chosen:
                y = F.scaled_dot_product_attention(
                    lq.transpose(1, 2),
                    lk.transpose(1, 2),
                    lv.transpose(1, 2),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=gqa,
                )
            y = y.transpose(1, 2).flatten(-2)
            y.backward(dout)
            return y

        try:
            poison_free_memory(device)
            y = dense()
        except RuntimeError as e:
            rows.append(
                {
                    "seq_len": seq_len,
                    "kv_heads": kv_heads,
                    "form": f"sdpa_{backend}",
                    "error": str(e).splitlines()[0],
                }
            )
            continue
        row = {
            "seq_len": seq_len,
            "kv_heads": kv_heads,
            "ranks": 1,
            "form": f"sdpa_{backend}",
            "out_err_vs_fp32": (y.float() - reference).abs().max().item(),
        }
        if base is None:
            base = {"out": y.detach(), "grads": [t.grad for t in (lq, lk, lv)], "name": backend}
        row["ms"] = median_ms(dense, warmup, repeats, cuda)
        if cuda:
            row["kernel_ms"] = kernel_ms(dense)
        rows.append(row)
        del lq, lk, lv, y
    base_ms = min(r["ms"] for r in rows if "ms" in r)
    for r in rows:
        if "ms" in r:
            r["ratio"] = r["ms"] / base_ms

    for ranks in ranks_list:
        if seq_len % (2 * ranks):
            continue
        q_parts = [split_sequence(q, r, ranks) for r in range(ranks)]
        dout_parts = [split_sequence(dout, r, ranks) for r in range(ranks)]
        for form in forms:
            masks = flex_masks(seq_len, ranks, device) if form == "flex" else [None] * ranks
            qs = leaves(*q_parts)
            lk, lv = leaves(k, v)

            def step(qs=qs, lk=lk, lv=lv, form=FORMS[form], masks=masks, ranks=ranks, dout_parts=dout_parts):
                outs = []
                for r in range(ranks):
                    y = form(qs[r], lk, lv, r, ranks, scale, masks[r])
                    y.backward(dout_parts[r])
                    outs.append(y)
                return outs

            row = {"seq_len": seq_len, "kv_heads": kv_heads, "ranks": ranks, "form": form}
            try:
                poison_free_memory(device)
                t0 = time.perf_counter()
                outs = step()
                if cuda:
                    torch.cuda.synchronize()
                row["first_call_s"] = time.perf_counter() - t0
            except Exception as e:  # a form a backend refuses is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                continue
            out = unsplit_sequence([o.detach() for o in outs])
            grads = [unsplit_sequence([t.grad for t in qs]), lk.grad, lv.grad]
            row["out_diff_vs_sdpa"] = (out - base["out"]).abs().max().item()
            row["grad_diff_vs_sdpa"] = max((g - gb).abs().max().item() for g, gb in zip(grads, base["grads"]))
            row["out_err_vs_fp32"] = (out.float() - reference).abs().max().item()
            del outs, out, grads

            def timed(step=step, qs=qs, lk=lk, lv=lv):
                for t in (*qs, lk, lv):
                    t.grad = None
                step()

            row["ms"] = median_ms(timed, warmup, repeats, cuda)
            row["ratio"] = row["ms"] / base_ms
            if cuda:
                row["kernel_ms"] = kernel_ms(timed)
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            del qs, lk, lv, masks
    return rows


def main() -> None:
    global FLEX
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (smoke test)")
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument(
        "--kv-heads", type=int, nargs="+", default=[8, 32], help="8: grouped-query (Llama-2/3 style), 32: MHA"
    )
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    p.add_argument(
        "--backends",
        nargs="+",
        default=["default", "flash", "cudnn", "efficient"],
        help="backends of the whole-sequence SDPA (the fastest is the baseline)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--repeats-long", type=int, default=3, help="repeats at s >= 64k")
    p.add_argument("--out", default=None, help="directory for split_attention.json")
    args = p.parse_args()
    if args.cpu:
        args.seq, args.ranks, args.kv_heads = [48], [1, 3], [2, 4]
        args.heads, args.head_dim, args.warmup, args.repeats = 4, 16, 0, 1
        args.backends = ["default"]
        args.forms = [f for f in args.forms if f in ("lse_merge", "lower_right")]
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    if "flex" in args.forms:
        from torch.nn.attention.flex_attention import flex_attention

        FLEX = flex_attention if args.cpu else torch.compile(flex_attention, dynamic=False)
        torch._dynamo.config.cache_size_limit = 64  # one graph per (query length, key length, heads)
    result = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "heads": args.heads,
        "head_dim": args.head_dim,
        "batch": args.batch,
        "rows": [],
    }
    for seq_len in args.seq:
        for kv_heads in args.kv_heads:
            result["rows"] += run_case(seq_len, kv_heads, args.ranks, args.forms, args, device, dtype)
            if args.out:  # written after each case: a later case that fails keeps the earlier ones
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "split_attention.json"), "w") as f:
                    json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
