"""Sharded checkpoints without Lightning: DTensor views match the ShardSpec, reshard across grids, dense export.

One 8-rank gloo pool: a model with every kind of 3-D parameter is saved with Adam state on
2×2×2 and loaded on 2×2×1 (dp 2), 1×2×2 (dp 2) and 1×1×1 (dp 8); every tensor of the model and of the
optimizer state must come back exactly, and the one-process dense export must equal the gathered model.
"""

import harness
import torch
from torch import nn
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_3d import LayerNorm3D, Linear3D, VocabParallelEmbedding3D
from lightning_3d import checkpoint as ckpt
from lightning_3d.sharding import get_spec, unshard_tensor

V, H, K = 16, 8, 12


class Net(nn.Module):
    """Embedding (z→y weight layout), LayerNorm (replicated vector), both Linear3D directions, a plain buffer."""

    def __init__(self, grid):
        super().__init__()
        self.emb = VocabParallelEmbedding3D(V, H, grid=grid)
        self.ln = LayerNorm3D(H, grid=grid)
        self.fc1 = Linear3D(H, K, input_layout="z", grid=grid)
        self.fc2 = Linear3D(K, H, input_layout="y", grid=grid)
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))


def _full(module, grid):
    """Every tensor of the module, gathered to its global shape."""
    return {k: (unshard_tensor(v.detach(), get_spec(v), grid) if get_spec(v) else v.detach().clone())
            for k, v in module.state_dict(keep_vars=True).items()}


def _full_optim(opt, net, grid):
    names = ckpt.parameter_names(net)
    return {names[id(p)] + "." + k: (unshard_tensor(v, get_spec(p), grid) if v.dim() else v.clone())
            for p, st in opt.state.items() for k, v in st.items()}


def save_job(shape, path):
    grid = harness.grid(shape)
    torch.manual_seed(0)
    net = Net(grid)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    torch.manual_seed(1)  # the same global gradients on every rank: draw them whole, keep the shard
    for name, p in net.named_parameters():
        full = torch.randn(get_spec(p).global_shape)
        p.grad = full[get_spec(p).local_slices(grid)].clone()
    opt.step()
    offsets_ok = all(
        compute_local_shape_and_global_offset(spec.global_shape, view.device_mesh, view.placements)
        == (spec.local_shape(grid), tuple(s.start for s in spec.local_slices(grid)))
        for p in net.parameters() for spec, view in [(get_spec(p), ckpt.sharded_view(p, get_spec(p), grid))])
    state = ckpt.optimizer_state(opt, ckpt.parameter_names(net), grid)
    ckpt.save(path, {ckpt.MODEL_KEY: ckpt.model_state(net, grid), ckpt.optimizer_key(0): {"state": state["state"]}}, grid, net)
    return offsets_ok, _full(net, grid), _full_optim(opt, net, grid), state["param_groups"]


def load_job(shape, dp, path, groups):
    grid = harness.grid(shape, dp)
    torch.manual_seed(5)
    net = Net(grid)
    with torch.no_grad():
        net.scale.zero_()
    opt = torch.optim.Adam(net.parameters(), lr=0.5)
    ckpt.load_model_(net, grid, path)
    ckpt.load_optimizer_(opt, 0, ckpt.parameter_names(net), grid, path, groups)
    return _full(net, grid), _full_optim(opt, net, grid), opt.param_groups[0]["lr"]


def _assert_equal(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: tensors differ: {bad}"


def test_reshard_and_dense_export(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = harness.run(8, save_job, (2, 2, 2), path)
    _, model, optim, groups = saved[0]
    assert all(r[0] for r in saved), "a DTensor view's global offset differs from its ShardSpec's slice"
    assert optim and all(torch.equal(r[1]["fc1.weight"], model["fc1.weight"]) for r in saved)
    for shape, dp in [((2, 2, 1), 2), ((1, 2, 2), 2), ((1, 1, 1), 8)]:
        for rank, (m, o, lr) in enumerate(harness.run(8, load_job, shape, dp, path, groups)):
            _assert_equal(m, model, f"model on {shape} dp {dp} rank {rank}")
            _assert_equal(o, optim, f"Adam state on {shape} dp {dp} rank {rank}")
            assert lr == 0.1
    dense = ckpt.to_dense(path)
    _assert_equal(dense, model, "dense export")
    out = tmp_path / "dense.pt"
    ckpt.main(["to-dense", path, str(out)])
    _assert_equal(torch.load(out), model, "to-dense command")
