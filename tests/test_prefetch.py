"""WeightPrefetch gathers each weight one product ahead and gives bit-identical results, and a
weight changed in place after its prefetch was started is gathered again (never used stale)."""

import torch
from torch import nn

import harness
from checks import local
from lightning_3d import Linear3D
from lightning_3d.ops import WeightPrefetch

N = 8


def _stack(grid):
    torch.manual_seed(0)
    return nn.Sequential(*[Linear3D(N, N, input_layout=layout, grid=grid, dtype=torch.float64) for layout in "zyzy"])


@torch.no_grad()
def _double(t):
    t.mul_(2.0)  # in place, as an optimizer step does: bumps the version the prefetch checks


def prefetch_job(shape):
    grid = harness.grid(shape)
    torch.manual_seed(1)
    x = local(torch.randn(4, 3, N, dtype=torch.float64), "z", grid)
    plain, fetched = _stack(grid), _stack(grid)
    prefetch = WeightPrefetch().attach(fetched)
    outs = []
    for step in range(3):
        if step == 2:  # change layer 2's weight in place after layer 1 started its prefetch
            layer, target = fetched[1], fetched[2].weight
            handle = layer.register_forward_hook(lambda *_: _double(target))
            with torch.no_grad():
                plain[2].weight.mul_(2.0)
        y_plain, y_fetched = plain(x), fetched(x)
        if step == 2:
            handle.remove()
        outs.append(bool(torch.equal(y_plain, y_fetched)))
    return outs, len(prefetch._order)


def test_prefetch_is_exact_and_never_stale():
    for shape in [(2, 1, 1), (2, 2, 1), (1, 2, 2)]:
        for outs, recorded in harness.run(4, prefetch_job, shape):
            assert outs == [True, True, True], (shape, outs)
            assert recorded == 4
