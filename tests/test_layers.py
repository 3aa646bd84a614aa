"""Every 3-D layer equals its torch.nn twin in float64 on every grid: output, input grad, param grads."""

import harness
import pytest
import torch
import torch.nn.functional as F
from checks import (
    GRIDS_8,
    assert_close,
    compare_module,
    local,
    nodes_named,
    on_grids,
    rel,
    seed_for,
    sums_replicas,
)
from torch import nn

from lightning_3d import (
    CrossEntropyLoss3D,
    LayerNorm3D,
    Linear3D,
    RMSNorm3D,
    VocabParallelEmbedding3D,
)
from lightning_3d.ops.replicated import ReplicatedGradsAtOnce
from lightning_3d.sharding import get_spec, shard_tensor

# Distinct sizes everywhere: batch 4, sequence 3, features 8 (in) and 12 (out), vocab 20.
B, S, N, K, V = 4, 3, 8, 12, 20
F64 = torch.float64


def _pair(make3d, makedense, grid, seed):
    torch.manual_seed(seed)
    dense = makedense().to(F64)
    with torch.no_grad():  # random affine params, so a norm's gradient test cannot pass by ones/zeros
        for p in dense.parameters():
            p.normal_()
    mod = make3d(grid)
    mod.load_dense_state_dict(dense.state_dict())
    return mod, dense


def linear_job(grid, layout, bias):
    out_layout = "y" if layout == "z" else "z"
    mod, dense = _pair(
        lambda g: Linear3D(N, K, bias=bias, input_layout=layout, grid=g, dtype=F64),
        lambda: nn.Linear(N, K, bias=bias),
        grid,
        1,
    )
    torch.manual_seed(seed_for(grid, 2))
    return compare_module(mod, dense, torch.randn(B, S, N, dtype=F64), layout, out_layout, grid, 3)


def norm_job(grid, kind, layout):
    make3d = {
        "layernorm": lambda g: LayerNorm3D(N, layout=layout, grid=g, dtype=F64),
        "layernorm_nobias": lambda g: LayerNorm3D(N, bias=False, layout=layout, grid=g, dtype=F64),
        "rmsnorm": lambda g: RMSNorm3D(N, eps=1e-6, layout=layout, grid=g, dtype=F64),
    }[kind]
    makedense = {
        "layernorm": lambda: nn.LayerNorm(N),
        "layernorm_nobias": lambda: nn.LayerNorm(N, bias=False),
        "rmsnorm": lambda: nn.RMSNorm(N, eps=1e-6),
    }[kind]
    mod, dense = _pair(make3d, makedense, grid, 4)
    torch.manual_seed(seed_for(grid, 5))
    x = torch.randn(B, S, N, dtype=F64) * 3 + 1
    return compare_module(mod, dense, x, layout, layout, grid, 6)


class _Stack(nn.Module):
    """LayerNorm → Linear z→y → GELU → Linear y→z: layouts compose."""

    def __init__(self, ln, fc1, fc2):
        super().__init__()
        self.ln, self.fc1, self.fc2 = ln, fc1, fc2

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.ln(x))))


def _stack_pair(grid, make=_Stack, *extra):
    """A dense :class:`_Stack` with random norm affine parameters, and ``make(ln, fc1, fc2, *extra)``
    of 3-D layers holding its weights."""
    torch.manual_seed(7)
    dense = _Stack(nn.LayerNorm(N), nn.Linear(N, K), nn.Linear(K, N)).to(F64)
    with torch.no_grad():
        dense.ln.weight.normal_()
        dense.ln.bias.normal_()
    mod = make(
        LayerNorm3D(N, grid=grid, dtype=F64),
        Linear3D(N, K, grid=grid, dtype=F64),
        Linear3D(K, N, input_layout="y", grid=grid, dtype=F64),
        *extra,
    )
    for name in ("ln", "fc1", "fc2"):
        getattr(mod, name).load_dense_state_dict(getattr(dense, name).state_dict())
    return dense, mod


def stack_job(grid):
    dense, mod = _stack_pair(grid)
    torch.manual_seed(seed_for(grid, 8))
    return compare_module(mod, dense, torch.randn(B, S, N, dtype=F64), "z", "z", grid, 9)


class _AtOnce(_Stack):
    """:class:`_Stack` inside one :class:`ReplicatedGradsAtOnce` that also lists a norm the forward
    never uses (held outside the module tree, which the comparison walks); records how many
    replica-sum nodes its output's graph holds."""

    def __init__(self, ln, fc1, fc2, unused):
        super().__init__(ln, fc1, fc2)
        self.unused, self.sums = (unused,), None

    def forward(self, x):
        layers = (self.ln, self.fc1, self.fc2, *self.unused)
        with ReplicatedGradsAtOnce(self.ln.grid, [use for m in layers for use in m.replicated_parameters()]):
            y = super().forward(x)
        self.sums = nodes_named(y, "_SumGradsOverReplicasBackward")
        return y


def at_once_job(grid):
    """Norm and both Linear3D directions summed in one node: the stack's gradients, none for the unused norm."""
    unused = LayerNorm3D(N, grid=grid, dtype=F64)
    dense, mod = _stack_pair(grid, _AtOnce, unused)
    torch.manual_seed(seed_for(grid, 8))
    errs = compare_module(mod, dense, torch.randn(B, S, N, dtype=F64), "z", "z", grid, 9)
    errs["unused_gets_no_grad"] = float(unused.weight.grad is not None or unused.bias.grad is not None)
    errs["one_sum_node"] = float(mod.sums != int(sums_replicas(mod.modules(), grid)))
    return errs


def embedding_job(grid):
    mod, dense = _pair(
        lambda g: VocabParallelEmbedding3D(V, N, grid=g, dtype=F64), lambda: nn.Embedding(V, N), grid, 10
    )
    torch.manual_seed(seed_for(grid, 11))
    ids = torch.randint(0, V, (B, S))
    out_ref = dense(ids)
    w = torch.randn_like(out_ref)
    (out_ref * w).sum().backward()
    out = mod(ids)
    (out * local(w, "z", grid)).sum().backward()
    return {
        "out": rel(out, local(out_ref, "z", grid)),
        "dweight": rel(mod.weight.grad, shard_tensor(dense.weight.grad, get_spec(mod.weight), grid)),
    }


def cross_entropy_job(grid):
    torch.manual_seed(seed_for(grid, 12))
    logits_full = (torch.randn(B, S, V, dtype=F64) * 4).requires_grad_()
    targets = torch.randint(0, V, (B, S))
    targets[0, 0] = targets[-1, 1] = -100  # ignored tokens
    ref = F.cross_entropy(logits_full.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
    ref.backward()
    logits = local(logits_full.detach(), "y", grid).clone().requires_grad_()
    loss = CrossEntropyLoss3D(grid=grid)(logits, targets)
    loss.backward()
    return {
        "loss": rel(loss, ref),
        "dlogits": rel(logits.grad, local(logits_full.grad, "y", grid)),
        "dtype": 0.0 if loss.dtype == F64 else 1.0,
    }


@pytest.mark.parametrize("layout", ["z", "y"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear3d(layout, bias):
    assert_close(harness.run(8, on_grids, GRIDS_8, linear_job, layout, bias))


@pytest.mark.parametrize("kind", ["layernorm", "layernorm_nobias", "rmsnorm"])
@pytest.mark.parametrize("layout", ["z", "y"])
def test_norms(kind, layout):
    assert_close(harness.run(8, on_grids, GRIDS_8, norm_job, kind, layout))


def test_stacked_layers_compose():
    assert_close(harness.run(8, on_grids, GRIDS_8, stack_job))


def test_replicated_grads_summed_at_once():
    assert_close(harness.run(8, on_grids, GRIDS_8, at_once_job))


def test_vocab_parallel_embedding():
    assert_close(harness.run(8, on_grids, GRIDS_8, embedding_job))


def test_vocab_parallel_cross_entropy():
    assert_close(harness.run(8, on_grids, GRIDS_8, cross_entropy_job))


def all_layers_job(grid):
    return {
        **{f"linear_{k}": v for k, v in linear_job(grid, "y", True).items()},
        **{f"stack_{k}": v for k, v in stack_job(grid).items()},
        **{f"emb_{k}": v for k, v in embedding_job(grid).items()},
        **{f"ce_{k}": v for k, v in cross_entropy_job(grid).items()},
        **{f"rms_{k}": v for k, v in norm_job(grid, "rmsnorm", "y").items()},
    }


def test_layers_on_2x1x1_with_dp2():
    assert_close(harness.run(4, on_grids, [(2, 1, 1)], all_layers_job))
