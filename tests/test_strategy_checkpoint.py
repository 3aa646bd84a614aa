"""Sharded checkpoints without Lightning: DTensor views match the ShardSpec, reshard across grids, dense export.

One 8-rank gloo pool: a float64 model with every kind of 3-D parameter takes one Adam step on
2×2×2 and is saved; it is loaded on 2×2×1 (dp 2), 1×2×2 (dp 2) and 1×1×1 (dp 8). The reference is
``torch.nn``'s twin (same seed, same global gradients, one Adam step) in one process: every rank's
shard of every parameter and of its Adam state must equal the twin's slice, when saved and after
each reshard, and the one-process dense export must equal the twin.
"""

import harness
import torch
from torch import nn
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_3d import LayerNorm3D, Linear3D, VocabParallelEmbedding3D
from lightning_3d import checkpoint as ckpt
from lightning_3d.sharding import get_spec

V, H, K = 16, 8, 12
F64 = torch.float64
TOL = 1e-12


class Net(nn.Module):
    """Embedding (z→y weight layout), LayerNorm (replicated vector), both Linear3D directions, a plain buffer."""

    def __init__(self, grid):
        super().__init__()
        self.emb = VocabParallelEmbedding3D(V, H, grid=grid, dtype=F64)
        self.ln = LayerNorm3D(H, grid=grid, dtype=F64)
        self.fc1 = Linear3D(H, K, input_layout="z", grid=grid, dtype=F64)
        self.fc2 = Linear3D(K, H, input_layout="y", grid=grid, dtype=F64)
        self.register_buffer("scale", torch.tensor([2.0, 3.0], dtype=F64))


class DenseNet(nn.Module):
    """``Net``'s torch.nn twin: the same keys, global shapes and initialisation order."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H, dtype=F64)
        self.ln = nn.LayerNorm(H, dtype=F64)
        self.fc1 = nn.Linear(H, K, dtype=F64)
        self.fc2 = nn.Linear(K, H, dtype=F64)
        self.register_buffer("scale", torch.tensor([2.0, 3.0], dtype=F64))


def adam_step(net, shapes, grid=None):
    """One Adam step on gradients drawn whole from one seed (each 3-D rank keeps its slice)."""
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    torch.manual_seed(1)
    for name, p in net.named_parameters():
        full = torch.randn(shapes[name], dtype=F64)
        p.grad = full if grid is None else full[get_spec(p).local_slices(grid)].clone()
    opt.step()
    return opt


def reference() -> dict:
    """The twin after one Adam step: ``{"model": {key: tensor}, "adam": {"<param>.<state>": tensor}}``."""
    torch.manual_seed(0)
    net = DenseNet()
    opt = adam_step(net, {n: p.shape for n, p in net.named_parameters()})
    names = {id(p): n for n, p in net.named_parameters()}
    return {
        "model": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "adam": {f"{names[id(p)]}.{k}": v.clone() for p, st in opt.state.items() for k, v in st.items()},
    }


def _shards(net, opt, grid) -> dict:
    """This rank's local tensors, each with the global slice its spec says it holds (None: the whole tensor)."""
    names = ckpt.parameter_names(net)
    out = {
        k: (v.detach().clone(), get_spec(v).local_slices(grid) if get_spec(v) else None)
        for k, v in net.state_dict(keep_vars=True).items()
    }
    for p, st in opt.state.items():
        for k, v in st.items():
            sliced = v.dim() > 0 and get_spec(p) is not None
            out[f"adam.{names[id(p)]}.{k}"] = (v.clone(), get_spec(p).local_slices(grid) if sliced else None)
    return out


def save_job(shape, path):
    grid = harness.grid(shape)
    torch.manual_seed(0)
    net = Net(grid)
    opt = adam_step(net, {n: get_spec(p).global_shape for n, p in net.named_parameters()}, grid)
    offsets_ok = all(
        compute_local_shape_and_global_offset(spec.global_shape, view.device_mesh, view.placements)
        == (spec.local_shape(grid), tuple(s.start for s in spec.local_slices(grid)))
        for p in net.parameters()
        for spec, view in [(get_spec(p), ckpt.sharded_view(p, get_spec(p), grid))]
    )
    state = ckpt.optimizer_state(opt, ckpt.parameter_names(net), grid)
    ckpt.save(
        path,
        {ckpt.MODEL_KEY: ckpt.model_state(net, grid), ckpt.optimizer_key(0): {"state": state["state"]}},
        grid,
        net,
    )
    return offsets_ok, _shards(net, opt, grid), state["param_groups"]


def load_job(shape, dp, path, groups):
    grid = harness.grid(shape, dp)
    torch.manual_seed(5)
    net = Net(grid)
    with torch.no_grad():
        net.scale.zero_()
    opt = torch.optim.Adam(net.parameters(), lr=0.5)
    ckpt.load_model_(net, grid, path)
    ckpt.load_optimizer_(opt, 0, ckpt.parameter_names(net), grid, path, groups)
    return _shards(net, opt, grid), opt.param_groups[0]["lr"]


def _assert_shards_match(shards: dict, ref: dict, where: str) -> None:
    """Every local tensor equals the reference's slice (``adam.`` keys: the reference's Adam state)."""
    want_keys = set(ref["model"]) | {f"adam.{k}" for k in ref["adam"]}
    assert set(shards) == want_keys, f"{where}: keys {sorted(shards)} != {sorted(want_keys)}"
    for key, (local, slices) in shards.items():
        full = ref["adam"][key[5:]] if key.startswith("adam.") else ref["model"][key]
        want = full if slices is None else full[slices]
        assert local.shape == want.shape, (
            f"{where}: {key} has shape {list(local.shape)}, its slice {list(want.shape)}"
        )
        err = float((local.double() - want.double()).abs().max()) if local.numel() else 0.0
        assert err <= TOL, f"{where}: {key} differs from the torch.nn twin's slice by {err:.2e}"


def test_reshard_and_dense_export(tmp_path):
    path = str(tmp_path / "ckpt")
    ref = reference()
    saved = harness.run(8, save_job, (2, 2, 2), path)
    assert all(r[0] for r in saved), "a DTensor view's global offset differs from its ShardSpec's slice"
    for rank, (_, shards, _) in enumerate(saved):
        _assert_shards_match(shards, ref, f"saved on 2×2×2, rank {rank}")
    groups = saved[0][2]
    for shape, dp in [((2, 2, 1), 2), ((1, 2, 2), 2), ((1, 1, 1), 8)]:
        for rank, (shards, lr) in enumerate(harness.run(8, load_job, shape, dp, path, groups)):
            _assert_shards_match(shards, ref, f"loaded on {shape} dp {dp}, rank {rank}")
            assert lr == 0.1
    dense = ckpt.to_dense(path)
    _assert_shards_match(
        {k: (v, None) for k, v in dense.items()}, {"model": ref["model"], "adam": {}}, "dense export"
    )
    out = tmp_path / "dense.pt"
    ckpt.main(["to-dense", path, str(out)])
    _assert_shards_match(
        {k: (v, None) for k, v in torch.load(out).items()},
        {"model": ref["model"], "adam": {}},
        "to-dense command",
    )
