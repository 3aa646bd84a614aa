"""WeightPrefetch gathers each weight one or more products ahead and gives bit-identical results, and a
weight changed in place after its prefetch was started is gathered again (never used stale).
With ``save_gathered=False`` it re-gathers each weight ahead in backward too, with
bit-identical gradients."""

import harness
import pytest
import torch
import torch.distributed as dist
from checks import local
from torch import nn

from lightning_3d import Linear3D, RuntimeOptions, comm
from lightning_3d.ops import WeightPrefetch

N = 8


def _stack(grid, options=None):
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            Linear3D(N, N, input_layout=layout, grid=grid, dtype=torch.float64, options=options)
            for layout in "zyzy"
        ]
    )


@torch.no_grad()
def _double(t):
    t.mul_(2.0)  # in place, as an optimizer step does: bumps the version the prefetch checks


def prefetch_job(shape, depth, together=1):
    """Per step: whether the output equals the stack's without prefetch; and how many weights
    were in flight once the first layer had run."""
    grid = harness.grid(shape)
    torch.manual_seed(1)
    x = local(torch.randn(4, 3, N, dtype=torch.float64), "z", grid)
    plain, fetched = _stack(grid), _stack(grid)
    prefetch = WeightPrefetch(depth, together).attach(fetched)
    in_flight = []
    fetched[0].register_forward_hook(lambda *_: in_flight.append(len(prefetch._forward.ahead)))
    outs = []
    for step in range(3):
        if step == 2:  # change layer 2's weight in place after layer 1 started its prefetch
            layer, target = fetched[1], fetched[2].weight
            handle = layer.register_forward_hook(lambda *_, target=target: _double(target))
            with torch.no_grad():
                plain[2].weight.mul_(2.0)
        y_plain, y_fetched = plain(x), fetched(x)
        if step == 2:
            handle.remove()
        outs.append(bool(torch.equal(y_plain, y_fetched)))
    return outs, in_flight, len(prefetch._forward.order)


def together_job():
    """Per case: whether ``all_gather_dim0_together`` equals one ``all_gather_dim0`` per tensor, dtype
    included: tensors of different shapes, cast on the way, and of mixed dtypes (gathered one by
    one); every handle waited twice, as weights of one run each wait for theirs."""
    group = dist.group.WORLD
    torch.manual_seed(dist.get_rank())
    ts = [
        torch.randn(3, 5, dtype=torch.float64),
        torch.randn(2, dtype=torch.float64),
        torch.randn(1, 2, 4, dtype=torch.float64),
    ]
    same = []
    for items, dtype in ((ts, None), (ts, torch.float32), ([ts[0], ts[1].float()], None)):
        outs, handle = comm.all_gather_dim0_together(items, group, dtype, streams=comm.SideStreams())
        handle.wait()
        handle.wait()
        expected = [comm.all_gather_dim0(t.to(dtype or t.dtype), group)[0] for t in items]
        same.append(all(o.dtype == e.dtype and torch.equal(o, e) for o, e in zip(outs, expected)))
    return same


def test_gathered_together_equals_gathered_one_by_one():
    for same in harness.run(4, together_job):
        assert same == [True, True, True]


def test_prefetch_is_exact_and_never_stale():
    for shape, depth in [((2, 1, 1), 1), ((2, 2, 1), 1), ((1, 2, 2), 1), ((2, 1, 1), 2), ((2, 2, 1), 3)]:
        for outs, in_flight, recorded in harness.run(4, prefetch_job, shape, depth):
            assert outs == [True, True, True], (shape, depth, outs)
            assert in_flight == [0, depth, depth], (shape, depth, in_flight)  # the first forward records
            assert recorded == 4


def test_weights_gathered_together_are_exact():
    """With ``together``, the first weight of a pass is gathered alone and each later one starts
    the rest of its run of ``together`` (positions [k·together, (k+1)·together)) with it."""
    # (depth, together, in flight once layer 0 ran): runs [0, 1] [2, 3] start 1, then 2 and 3;
    # a run of 4 starts 1 … 3 together
    for shape, depth, together, ahead in [
        ((2, 1, 1), 1, 2, 1),
        ((2, 1, 1), 2, 2, 3),
        ((2, 2, 1), 1, 4, 3),
        ((1, 2, 2), 2, 2, 3),
    ]:
        for outs, in_flight, recorded in harness.run(4, prefetch_job, shape, depth, together):
            assert outs == [True, True, True], (shape, depth, together, outs)
            assert in_flight == [0, ahead, ahead], (shape, depth, together, in_flight)
            assert recorded == 4


def test_prefetch_depth_is_checked():
    for depth in (0, True, 1.5):
        with pytest.raises(ValueError, match="depth is how many weights are gathered ahead"):
            WeightPrefetch(depth)
        with pytest.raises(ValueError, match="together is how many consecutive weights"):
            WeightPrefetch(2, together=depth)


def backward_prefetch_job(shape, depth, together=1):
    """Per step: whether the gradients equal those of the same stack without prefetch, and
    whether a weight was fetched ahead when the gradients of the stack's output (layer 3's
    weight, kept from forward) and of layer 1's output (layer 1's, re-gathered ahead by layer 2's
    backward) arrived. Steps update the weights in place in between, as an optimizer does; the
    stack without prefetch runs its backward after the other's forward, and none of its weights
    may enter the recorded order."""
    grid = harness.grid(shape)
    options = RuntimeOptions(save_gathered=False)
    plain, fetched = _stack(grid, options), _stack(grid, options)
    prefetch = WeightPrefetch(depth, together).attach(fetched)
    fetched_ahead = []

    def watch(mod, args, out) -> None:
        out.register_hook(lambda g: fetched_ahead.append(bool(prefetch._backward.ahead)))

    for layer in (3, 1):
        fetched[layer].register_forward_hook(watch)
    outs = []
    for step in range(3):
        torch.manual_seed(10 + step)
        x = local(torch.randn(4, 3, N, dtype=torch.float64), "z", grid)
        g = local(torch.randn(4, 3, N, dtype=torch.float64), "z", grid)  # the stack maps z → z
        for model in (plain, fetched):
            model.zero_grad()
            model(x).backward(g)
        outs.append(
            all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), fetched.parameters()))
        )
        for model in (plain, fetched):
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.1 * p.grad)
    return outs, fetched_ahead, len(prefetch._backward.order)


def test_backward_regathers_are_prefetched_and_exact():
    for shape, depth, together in [
        ((2, 1, 1), 1, 1),
        ((2, 2, 1), 1, 1),
        ((1, 2, 2), 1, 1),
        ((2, 2, 1), 2, 1),
        ((2, 1, 1), 2, 2),
    ]:
        for outs, ahead, recorded in harness.run(4, backward_prefetch_job, shape, depth, together):
            assert outs == [True, True, True], (shape, depth, outs)
            assert recorded == 4, (shape, recorded)
            # the first backward records the order; the later ones fetch ahead (a weight gathered
            # over one rank, px = 1, is its own gather and still follows the order)
            assert ahead == [False, False, True, True, True, True], (shape, ahead)
