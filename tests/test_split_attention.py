"""The zig-zag token split and causal attention over split sequences, against one dense causal SDPA
over the whole sequence in float64: the split's index math exhaustively for small sequences; the
ranks' attention simulated in one process (R = 1-4, grouped-query and multi-head, batch 1 and 3);
the gather / reduce-scatter version in real gloo worlds of 2 and 4; the GPU benchmark's CPU mode."""

import json
import os
import subprocess
import sys

import harness
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_3d.ops.sequence_split import (
    check_split,
    chunks_of,
    split_sequence,
    split_targets,
    token_positions,
    unsplit_sequence,
)
from lightning_3d.ops.split_attention import attend_local_chunks, gather_sequence, split_causal_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the split: pure index math ----------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_split_positions_roundtrip_and_balance(ranks):
    for seq_len in range(2 * ranks, 13 * ranks, 2 * ranks):
        length = seq_len // (2 * ranks)
        x = torch.randn(3, seq_len, 2)
        parts = [split_sequence(x, r, ranks) for r in range(ranks)]
        positions = [token_positions(seq_len, r, ranks) for r in range(ranks)]
        assert sorted(torch.cat(positions).tolist()) == list(
            range(seq_len)
        )  # every token on exactly one rank
        for r in range(ranks):
            first, second = chunks_of(r, ranks)
            assert positions[r].tolist() == list(range(first * length, (first + 1) * length)) + list(
                range(second * length, (second + 1) * length)
            )
            torch.testing.assert_close(parts[r], x[:, positions[r]], rtol=0, atol=0)
        # causal work: the keys the ranks' queries see, the same on every rank
        assert len({(p + 1).sum().item() for p in positions}) == 1
        torch.testing.assert_close(unsplit_sequence(parts), x, rtol=0, atol=0)
        torch.testing.assert_close(
            unsplit_sequence([split_sequence(x, r, ranks, dim=-2) for r in range(ranks)], dim=-2),
            x,
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_split_targets_follow_true_positions(ranks):
    for seq_len in range(2 * ranks, 9 * ranks, 2 * ranks):
        labels = torch.randint(0, 1000, (3, seq_len))
        for r in range(ranks):
            targets = split_targets(labels, r, ranks, ignore_index=-7)
            for i, p in enumerate(token_positions(seq_len, r, ranks).tolist()):
                expected = labels[:, p + 1] if p + 1 < seq_len else torch.full((3,), -7)
                assert torch.equal(targets[:, i], expected), (seq_len, r, i, p)
        # the loss over every rank's tokens is the dense model's shifted loss, in any order
        logits = torch.randn(3, seq_len, 11, dtype=torch.float64)
        small = labels % 11
        dense = F.cross_entropy(logits[:, :-1].flatten(0, 1), small[:, 1:].flatten(), reduction="sum")
        split = sum(
            F.cross_entropy(
                split_sequence(logits, r, ranks).flatten(0, 1),
                split_targets(small, r, ranks).flatten(),
                reduction="sum",
            )
            for r in range(ranks)
        )
        torch.testing.assert_close(split, dense, rtol=1e-14, atol=0)


def test_split_refuses_bad_lengths_with_the_fix():
    with pytest.raises(
        ValueError, match=r"30 tokens .* 2·4 = 8 equal chunks .* multiple of 8 \(e.g. 32 tokens\)"
    ):
        check_split(30, 4)
    with pytest.raises(ValueError, match="rank 2 is not in a row group of 2"):
        chunks_of(2, 2)
    with pytest.raises(ValueError, match=r"labels must be \[batch, seq_len\]"):
        split_targets(torch.zeros(4, dtype=torch.long), 0, 1)
    with pytest.raises(ValueError, match="one piece of 2L tokens per rank"):
        unsplit_sequence([torch.zeros(1, 4), torch.zeros(1, 6)])


# --- attention over split sequences --------------------------------------------------------------


def dense_reference(q, k, v, dout):
    """Dense causal SDPA over whole sequences ``[b, s, h, d]``: output ``[b, s, h·d]`` and (dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = (
        F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        .transpose(1, 2)
        .flatten(-2)
    )
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def inputs(batch, seq_len, heads, kv_heads, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(batch, seq_len, n, head_dim, dtype=torch.float64, generator=g)
        for n in (heads, kv_heads, kv_heads)
    )
    return q, k, v, torch.randn(batch, seq_len, heads * head_dim, dtype=torch.float64, generator=g)


@pytest.mark.parametrize("ranks,seq_len,batch", [(1, 8, 1), (2, 24, 3), (3, 36, 1), (4, 64, 3), (4, 8, 1)])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_ranks_simulated_equal_dense_attention(ranks, seq_len, batch, kv_heads):
    q, k, v, dout = inputs(batch, seq_len, 4, kv_heads, seed=ranks * 100 + seq_len)
    out, dq, dk, dv = dense_reference(q, k, v, dout)
    k_, v_ = (
        t.detach().requires_grad_() for t in (k, v)
    )  # the gathered whole sequence; its gradient sums the ranks'
    outs, dqs = [], []
    for r in range(ranks):
        q_r = split_sequence(q, r, ranks).requires_grad_()
        y = attend_local_chunks(q_r, k_, v_, r, ranks)
        y.backward(split_sequence(dout, r, ranks))
        outs.append(y.detach())
        dqs.append(q_r.grad)
    for got, want in [
        (unsplit_sequence(outs), out),
        (unsplit_sequence(dqs), dq),
        (k_.grad, dk),
        (v_.grad, dv),
    ]:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_attention_refuses_mismatched_shapes():
    q, k, v, _ = inputs(1, 16, 4, 2)
    with pytest.raises(ValueError, match=r"expected q \[b, 2L=8, heads, d\]"):
        attend_local_chunks(q, k, v, 0, 2)  # q must hold the rank's 8 tokens, not all 16
    with pytest.raises(ValueError, match="heads a multiple of kv_heads"):
        attend_local_chunks(split_sequence(q, 0, 2)[:, :, :3], k, v, 0, 2)


def gloo_job(seq_len: int, batch: int, kv_heads: int):
    """Every rank: its tokens of one global batch through split_causal_attention over the world;
    returns the max difference of its output and its q, k, v gradients to the dense reference's slices."""
    group = dist.group.WORLD
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout = inputs(batch, seq_len, 4, kv_heads, seed=seq_len)
    out, dq, dk, dv = dense_reference(q, k, v, dout)
    q_r, k_r, v_r = (split_sequence(t, rank, ranks).requires_grad_() for t in (q, k, v))
    y = split_causal_attention(q_r, k_r, v_r, group)
    y.backward(split_sequence(dout, rank, ranks))
    whole = gather_sequence(k_r.detach(), group)  # the gather alone: the whole sequence in true order
    pairs = [(y, out), (q_r.grad, dq), (k_r.grad, dk), (v_r.grad, dv)]
    return max((got - split_sequence(want, rank, ranks)).abs().max().item() for got, want in pairs), (
        whole - k
    ).abs().max().item()


@pytest.mark.parametrize("world,seq_len,batch,kv_heads", [(2, 24, 3, 2), (4, 32, 1, 2), (4, 16, 3, 4)])
def test_split_attention_gathers_and_scatters_over_gloo(world, seq_len, batch, kv_heads):
    for err, gathered_err in harness.run(world, gloo_job, seq_len, batch, kv_heads):
        assert err < 1e-12 and gathered_err == 0, (err, gathered_err)


def test_split_attention_benchmark_smoke_on_cpu(tmp_path):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "micro", "split_attention.py"),
        "--cpu",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "split_attention.json") as f:
        rows = json.load(f)["rows"]
    forms = {r["form"] for r in rows}
    assert {"sdpa_default", "lse_merge", "lower_right"} <= forms, forms
    for r in rows:
        assert r["ms"] > 0 and r["out_err_vs_fp32"] < 1e-5, r
        if r["form"] != "sdpa_default":
            assert r["out_diff_vs_sdpa"] < 1e-5 and r["grad_diff_vs_sdpa"] < 1e-5, r
