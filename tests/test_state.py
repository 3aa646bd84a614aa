"""Initialisation, dense state dicts, metadata, and the errors of the layers."""

import harness
import pytest
import torch
from checks import GRIDS_8, on_grids
from torch import nn

from lightning_3d import LayerNorm3D, Linear3D, VocabParallelEmbedding3D, get_spec

F64 = torch.float64


def init_job(grid):
    """Same seed → the same global weights as torch.nn, on every grid."""
    out = {}
    for name, make3d, makedense in [
        ("linear_z", lambda: Linear3D(8, 12, grid=grid), lambda: nn.Linear(8, 12)),
        ("linear_y", lambda: Linear3D(12, 8, input_layout="y", grid=grid), lambda: nn.Linear(12, 8)),
        ("embedding", lambda: VocabParallelEmbedding3D(20, 8, grid=grid), lambda: nn.Embedding(20, 8)),
    ]:
        torch.manual_seed(40)
        dense = makedense()
        torch.manual_seed(40)
        mod = make3d()
        sd = mod.dense_state_dict()
        out[name] = sorted(sd) == sorted(dense.state_dict()) and all(
            torch.equal(sd[k], v) for k, v in dense.state_dict().items()
        )
    return out


def test_init_matches_torch_nn_on_every_grid():
    for r in harness.run(8, on_grids, GRIDS_8, init_job):
        for shape, ok in r.items():
            assert all(ok.values()), (shape, ok)


def reshard_job():
    """Export on 2×2×2, load on 1×2×2 (dp 2) and 2×1×1 (dp 4): same function."""
    torch.manual_seed(41)
    x = torch.randn(4, 3, 8, dtype=F64)
    grid = harness.grid((2, 2, 2))
    src = Linear3D(8, 12, grid=grid, dtype=F64)
    sd = src.dense_state_dict()
    ref = x @ sd["weight"].t() + sd["bias"]
    results = []
    for shape in [(1, 2, 2), (2, 1, 1)]:
        g = harness.grid(shape)
        dst = Linear3D(8, 12, grid=g, dtype=F64)
        dst.load_dense_state_dict(sd)
        from lightning_3d import gather_activation, split_activation

        y = gather_activation(dst(split_activation(x, "z", g)), "y", g)
        results.append(torch.allclose(y, ref, rtol=0, atol=1e-12))
    return results


def test_dense_state_dict_reshards_across_grids():
    assert all(all(r) for r in harness.run(8, reshard_job))


def metadata_job(grid):
    lin = Linear3D(8, 12, grid=grid)
    ln = LayerNorm3D(8, grid=grid)
    counts = {}
    for name, p in [("w", lin.weight), ("b", lin.bias), ("g", ln.weight)]:
        spec = get_spec(p)
        assert isinstance(p, nn.Parameter) and type(p) is nn.Parameter
        assert tuple(p.shape) == spec.local_shape(grid)
        counts[name] = (spec.replicated_axes, spec.is_representative(grid))
    rep = repr(lin)
    assert "global=[12, 8]" in rep and f"grid={'×'.join(map(str, grid.shape))}" in rep and "z→y" in rep, rep
    return counts


def test_metadata_counts_each_shard_once():
    results = harness.run(8, on_grids, [(2, 2, 2)], metadata_job)
    reps = {name: sum(r[(2, 2, 2)][name][1] for r in results) for name in ("w", "b", "g")}
    axes = {name: results[0][(2, 2, 2)][name][0] for name in ("w", "b", "g")}
    assert axes == {"w": "", "b": "xz", "g": "xy"}
    # weight: 8 distinct shards; bias: 2 blocks (by y); LN weight: 2 blocks (by z)
    assert reps == {"w": 8, "b": 2, "g": 2}


def errors_job(grid):
    msgs = {}

    def catch(key, fn):
        with pytest.raises(ValueError) as e:
            fn()
        msgs[key] = str(e.value)

    catch("out", lambda: Linear3D(8, 6, grid=grid))
    catch("in", lambda: Linear3D(7, 12, grid=grid))
    catch("ln", lambda: LayerNorm3D(7, grid=grid))
    catch("vocab", lambda: VocabParallelEmbedding3D(18, 8, grid=grid))
    lin = Linear3D(8, 12, grid=grid)
    catch("features", lambda: lin(torch.randn(1, 3, 8)))
    flat = harness.grid((2, 1, 2))  # z-layout rows are cut px·py = 2 ways, y-layout rows px·pz = 4 ways
    catch("batch", lambda: Linear3D(8, 12, grid=flat)(torch.randn(1, 3, 4)))
    harness.grid(grid.shape)
    catch(
        "emb_batch", lambda: VocabParallelEmbedding3D(20, 8, grid=grid)(torch.zeros(6, 3, dtype=torch.long))
    )
    catch("load", lambda: lin.load_dense_state_dict({"weight": torch.zeros(12, 9), "bias": torch.zeros(12)}))
    return msgs


def test_bad_shapes_raise_with_numbers_and_fix():
    msgs = harness.run(8, on_grids, [(2, 2, 2)], errors_job)[0][(2, 2, 2)]
    assert (
        "dim 0 of size 6 is split over py=2·px=2 = 4 ranks, but 6 % 4 = 2; make it a multiple of 4"
        in msgs["out"]
    )
    assert "dim 1 of size 7 is split over pz=2 = 2 ranks" in msgs["in"]
    assert "dim 0 of size 7 is split over pz=2" in msgs["ln"]
    assert "dim 0 of size 18 is split over py=2·px=2 = 4 ranks" in msgs["vocab"]
    assert "expected a z-layout block" in msgs["features"] and "[1, 3, 8]" in msgs["features"]
    assert (
        "global batch 2 must be divisible by px·py = 2 and px·pz = 4" in msgs["batch"]
        and "multiple of 4" in msgs["batch"]
    )
    assert "batch 6 must be divisible by px·py = 4" in msgs["emb_batch"]
    assert "holds shape [12, 9], the module expects [12, 8]" in msgs["load"]


def to_empty_job(grid):
    """Building on meta and materialising with to_empty keeps every parameter's ShardSpec."""
    lin = Linear3D(8, 12, grid=grid, device="meta")
    specs = {n: get_spec(p) for n, p in lin.named_parameters()}
    lin.to_empty(device="cpu")
    return all(get_spec(p) == specs[n] and not p.is_meta for n, p in lin.named_parameters())


def test_to_empty_keeps_specs():
    assert all(r[(2, 2, 2)] for r in harness.run(8, on_grids, [(2, 2, 2)], to_empty_job))
