"""The three 3-D matmul forms, saving or re-gathering operands, equal dense float64 on every grid."""

import harness
import pytest
import torch
from checks import GRIDS_8, assert_close, local, on_grids, rel, seed_for

from lightning_3d import matmul_ab, matmul_abt, matmul_atb
from lightning_3d.options import RuntimeOptions
from lightning_3d.sharding import ShardSpec, shard_tensor

B, S, N, K = 4, 3, 8, 12
F64 = torch.float64

# form -> (function, A's layout or weight spec, B's, C's, dense product)
FORMS = {
    "ab": (matmul_ab, "z", ((("z", "x"), ("y",)), (N, K)), "y", lambda a, b: a @ b),
    "abt": (matmul_abt, "z", ((("y", "x"), ("z",)), (K, N)), "y", lambda a, b: a @ b.t()),
    "atb": (
        matmul_atb,
        "y",
        "z",
        ((("y", "x"), ("z",)), (N, K)),
        lambda a, b: a.reshape(-1, N).t() @ b.reshape(-1, K),
    ),
}


def _sharder(place, grid):
    """Function taking a full operand to this rank's block: an activation layout or a weight spec."""
    if isinstance(place, str):
        return lambda t: local(t, place, grid)
    dims, _ = place
    return lambda t: shard_tensor(t, ShardSpec(tuple(t.shape), dims), grid)


def _full(place, act_shape):
    return torch.randn(*(act_shape if isinstance(place, str) else place[1]), dtype=F64)


def matmul_job(grid, form, save_gathered, async_tp=False):
    fn, pa, pb, pc, dense = FORMS[form]
    torch.manual_seed(seed_for(grid, 20))
    a_full = _full(pa, (B, S, N)).requires_grad_()
    b_full = _full(pb, (B, S, K)).requires_grad_()
    c_ref = dense(a_full, b_full)
    w = torch.randn_like(c_ref)
    (c_ref * w).sum().backward()
    shard_a, shard_b, shard_c = (_sharder(p, grid) for p in (pa, pb, pc))
    a = shard_a(a_full.detach()).clone().requires_grad_()
    b = shard_b(b_full.detach()).clone().requires_grad_()
    c = fn(a, b, grid=grid, options=RuntimeOptions(async_tp=async_tp, save_gathered=save_gathered))
    (c * shard_c(w)).sum().backward()
    return {
        "out": rel(c, shard_c(c_ref)),
        "da": rel(a.grad, shard_a(a_full.grad)),
        "db": rel(b.grad, shard_b(b_full.grad)),
    }


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("save_gathered", [True, False])
def test_matmul_forms(form, save_gathered):
    assert_close(harness.run(8, on_grids, GRIDS_8, matmul_job, form, save_gathered))


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("save_gathered", [True, False])
def test_matmul_forms_async_tp(form, save_gathered):
    """Collective matmuls: forward gather fused where A's axis > 1 (else the scatter, e.g. 1×1×2),
    backward dC gather or dA / dB scatter fused, on every grid."""
    assert_close(harness.run(8, on_grids, GRIDS_8, matmul_job, form, save_gathered, True))
