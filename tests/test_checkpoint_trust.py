"""Checkpoints a user can trust: nothing read runs code, damage is named, a checkpoint is complete or
absent, another model's checkpoint is refused, and the dense export needs no hidden knowledge.

One 4-rank gloo pool writes a small GPT3D (held as ``self.model``, as a LightningModule would) on
2×2×1; copies of that checkpoint are then damaged, left out of the manifest, or planted with a
pickle whose ``__reduce__`` would write a marker file (whole files, and an entry inside a ``.distcp``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import harness
import pytest
import torch
import torch.distributed
from torch import nn

from lightning_3d import Linear3D
from lightning_3d import checkpoint as ckpt
from lightning_3d.checkpoint import CheckpointError
from lightning_3d.checkpoint.manifest import file_entry
from lightning_3d.models import GPT3D, GPTConfig, dense_gpt

GRID = (2, 2, 1)


def config(vocab: int = 60, layers: int = 2) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, block_size=8, n_layer=layers, n_head=2, n_embd=16)


class Holder(nn.Module):
    """A 3-D model as a LightningModule holds it: under one attribute, beside a plain buffer."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.model = GPT3D(cfg)
        self.register_buffer("seen", torch.tensor([3.0]))


class CountingSGD(torch.optim.SGD):
    """SGD that counts its steps in a plain int per parameter, as many optimizers keep ``step``: DCP writes
    each as a pickled bytes entry of a ``.distcp`` file."""

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["steps"] = self.state[p].get("steps", 0) + 1
        return loss


class Payload:
    """Unpickling it writes ``marker``: what a crafted checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


# ----- jobs on every rank -----


def save_job(path: str, seed: int = 0) -> dict:
    harness.grid(GRID)
    torch.manual_seed(seed)
    holder = Holder(config())
    ckpt.save(
        path,
        {ckpt.MODEL_KEY: ckpt.model_state(holder, holder.model.grid)},
        holder.model.grid,
        holder,
        meta={"epoch": 3, "hyper_parameters": {"lr": 0.1}},
    )
    return holder.model.dense_state_dict()


def failing_save_job(path: str, failing_rank: int) -> str:
    """Rank ``failing_rank`` cannot write its RNG file (after its DCP shard): every rank must raise."""
    from lightning_3d.checkpoint import store

    def broken():
        raise OSError(28, "No space left on device")

    grid = harness.grid(GRID)
    torch.manual_seed(1)
    holder = Holder(config())
    if torch.distributed.get_rank() == failing_rank:
        store.rng_state, kept = broken, store.rng_state
    try:
        ckpt.save(path, {ckpt.MODEL_KEY: ckpt.model_state(holder, grid)}, grid, holder)
    except CheckpointError as e:
        return str(e)
    finally:
        if torch.distributed.get_rank() == failing_rank:
            store.rng_state = kept
    return "saved"


def load_job(path: str, vocab: int = 60, layers: int = 2, strict: bool = True) -> str:
    grid = harness.grid(GRID)
    holder = Holder(config(vocab, layers))
    try:
        ckpt.load_model_(holder, grid, path, strict=strict)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def optimizer_job(path: str, save: bool) -> str:
    """Save the model and a :class:`CountingSGD`'s state after one step, or load both back: what was loaded."""
    grid = harness.grid(GRID)
    torch.manual_seed(0)
    holder = Holder(config())
    names = ckpt.parameter_names(holder)
    optimizer = CountingSGD(holder.parameters(), lr=0.1)
    if save:
        for p in holder.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        state = ckpt.optimizer_state(optimizer, names, grid)["state"]
        ckpt.save(
            path,
            {ckpt.MODEL_KEY: ckpt.model_state(holder, grid), ckpt.optimizer_key(0): {"state": state}},
            grid,
            holder,
        )
        return "saved"
    try:
        ckpt.load_model_(holder, grid, path)
        ckpt.load_optimizer_(
            optimizer, 0, names, grid, path, ckpt.optimizer_state(optimizer, names, grid)["param_groups"]
        )
    except CheckpointError as e:
        return str(e)
    every = len(optimizer.state) == len(names)
    steps = sorted({s["steps"] for s in optimizer.state.values()}, key=repr)
    return f"loaded steps {steps} for {'every' if every else 'some'} parameter"


class Tally(nn.Module):
    """Extra state as plain JSON data."""

    def __init__(self):
        super().__init__()
        self.stats = {"seen": 0, "tags": [], "rate": 0.0, "last": None}

    def get_extra_state(self):
        return self.stats

    def set_extra_state(self, state):
        self.stats = state


class Scale(nn.Module):
    """Extra state as a tensor (a fresh one each time, as a module computing it would return)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.zeros(3)

    def get_extra_state(self):
        return self.scale.clone()

    def set_extra_state(self, state):
        self.scale = state.clone()


class WithExtraState(nn.Module):
    def __init__(self, grid):
        super().__init__()
        self.proj = Linear3D(4, 4, grid=grid)
        self.tally, self.scale = Tally(), Scale()


def extra_state_job(path: str, save: bool):
    """Save extra state on 2×1×1 (and try what must be refused), or load it on 1×1×1·dp2: what came back."""
    grid = harness.grid((2, 1, 1)) if save else harness.grid((1, 1, 1), dp=2)
    torch.manual_seed(0)
    model = WithExtraState(grid)
    if not save:
        ckpt.load_model_(model, grid, path)
        return {
            "stats": model.tally.stats,
            "scale": model.scale.scale.tolist(),
            "weight": model.proj.dense_state_dict(),
        }
    model.tally.stats = {"seen": 7, "tags": ["x", "y"], "rate": 0.25, "last": None}
    model.scale.scale = torch.tensor([1.0, 2.0, 3.0])
    ckpt.save(path, {ckpt.MODEL_KEY: ckpt.model_state(model, grid)}, grid, model)
    refused = []
    for bad in [("a", 1), {1: "x"}, Path("p"), float("nan")]:
        model.tally.stats = bad
        try:
            ckpt.model_state(model, grid)
            refused.append(f"{bad!r} accepted")
        except CheckpointError as e:
            refused.append(str(e))
    return {"refused": refused, "weight": model.proj.dense_state_dict()}


def rng_job(path: str) -> str:
    try:
        ckpt.load_rng_state(path, harness.grid(GRID))
    except CheckpointError as e:
        return str(e)
    return "loaded"


def killed_rank_world(rank: int, port: int, path: str, old: str) -> None:
    """A 2-process world: rank 1 is SIGKILLed after its DCP shard, before its RNG file."""
    import datetime

    import torch.distributed as dist

    from lightning_3d import init_grid
    from lightning_3d.checkpoint import store

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    grid = init_grid((2, 1, 1))
    holder = Holder(config())
    state = lambda: {ckpt.MODEL_KEY: ckpt.model_state(holder, grid)}  # noqa: E731
    ckpt.save(old, state(), grid, holder)
    if rank == 1:
        store.rng_state = lambda: os.kill(os.getpid(), signal.SIGKILL)
    ckpt.save(path, state(), grid, holder)


# ----- helpers -----


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A complete checkpoint of ``Holder(config())`` and the model's dense state dict."""
    path = tmp_path_factory.mktemp("trust") / "epoch=0.ckpt"
    dense = harness.run(4, save_job, str(path))
    return path, dense[0]


def copy_of(saved: Path, tmp_path: Path, name: str = "copy.ckpt") -> Path:
    out = tmp_path / name
    shutil.copytree(saved, out, symlinks=True)
    return out


def relist(path: Path, names: list[str], drop: bool = False) -> None:
    """Enter the files ``names`` in the manifest as they are now (``drop``: remove their entries)."""
    manifest = path / "manifest.json"
    if manifest.exists():
        data = json.loads(manifest.read_text())
        for name in names:
            if drop:
                del data["files"][name]
            else:
                data["files"][name] = file_entry(path, name)
        manifest.write_text(json.dumps(data))


def plant(path: Path, pattern: str, marker: Path, with_torch: bool = True) -> str:
    """Replace the file matching ``pattern`` by a payload; update the manifest as an attacker would."""
    (file,) = sorted(path.glob(pattern))
    if with_torch:
        torch.save(Payload(marker), file)
    else:
        file.write_bytes(pickle.dumps(Payload(marker)))
    name = file.relative_to(path).as_posix()
    relist(path, [name])
    return name


def plant_entry(path: Path, fqn: str, marker: Path) -> str:
    """Make the bytes entry ``fqn`` a payload: appended to its ``.distcp`` file, pointed to by a rewritten
    ``.metadata``, both entered in the manifest, as an attacker would. Returns the ``.distcp`` file's name."""
    from lightning_3d.checkpoint.untrusted import read_dcp_metadata

    metadata = read_dcp_metadata(path)
    (index,) = [i for i in metadata.storage_data if i.fqn == fqn]
    info = metadata.storage_data[index]
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    file = path / info.relative_path
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    relist(path, [".metadata", info.relative_path])
    return info.relative_path


def assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: tensors differ: {bad}"


# ----- nothing read runs code -----


def test_payload_in_meta_runs_nothing(saved, tmp_path):
    path, marker = copy_of(saved[0], tmp_path), tmp_path / "ran"
    plant(path, "meta.*", marker)
    with pytest.raises(Exception, match="meta") as e:
        ckpt.load_meta(path)
    assert not marker.exists(), "unpickling meta ran the planted code"
    assert "exec" in str(e.value), e.value


def test_payload_in_dcp_metadata_runs_nothing(saved, tmp_path):
    path, marker = copy_of(saved[0], tmp_path), tmp_path / "ran"
    plant(path, ".metadata", marker, with_torch=False)
    with pytest.raises(Exception, match=r"\.metadata") as e:
        ckpt.to_dense(path)
    assert not marker.exists(), "unpickling .metadata ran the planted code"
    for r in harness.run(4, load_job, str(path)):
        assert ".metadata" in r and "builtins.exec" in r, r
    assert not marker.exists(), "loading on the grid ran the planted code"
    assert "builtins.exec" in str(e.value), e.value


def test_payload_in_rng_file_runs_nothing(saved, tmp_path):
    path, marker = copy_of(saved[0], tmp_path), tmp_path / "ran"
    name = plant(path, "rng/1.*", marker)
    results = harness.run(4, rng_job, str(path))
    assert not marker.exists(), "reading the RNG state ran the planted code"
    assert name in results[1], results[1]
    assert results[0] == results[2] == results[3] == "loaded"


def test_payload_in_a_distcp_bytes_entry_runs_nothing(tmp_path):
    """DCP unpickles a non-tensor entry with ``weights_only=False``: the planner reads it weights-only first."""
    path, marker = tmp_path / "optimizer.ckpt", tmp_path / "ran"
    harness.run(4, optimizer_job, str(path), True)
    assert (
        harness.run(4, optimizer_job, str(path), False) == ["loaded steps [1] for every parameter"] * 4
    )  # as written
    entry = "optimizer_0.state.model.transformer.h.0.attn.c_attn.weight.steps"
    shard = plant_entry(path, entry, marker)
    assert shard.endswith(".distcp"), shard
    for r in harness.run(
        4, optimizer_job, str(path), False
    ):  # a CheckpointError, not DCP's CheckpointException
        assert f"cannot load {path}: ranks 0-3: refusing to read the entry {entry!r} in {shard}" in r, r
        assert "GLOBAL exec" in r and "add_safe_globals" in r and r.count("refusing") == 1, r
    assert not marker.exists(), "loading the checkpoint ran the code planted in a .distcp entry"


def test_a_dcp_failure_is_a_checkpoint_error_and_ctrl_c_stays_itself(tmp_path, monkeypatch):
    """In one process: a refused entry is a CheckpointError naming rank, entry and file; a KeyboardInterrupt
    inside DCP's read stays a BaseException (DCP's own CheckpointException), not an error to catch."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    from lightning_3d.checkpoint import untrusted

    path, marker = tmp_path / "small", tmp_path / "ran"
    with pytest.warns(UserWarning):  # DCP warns that it runs in one process
        dcp.save({"w": torch.ones(2), "note": "text"}, checkpoint_id=path, no_dist=True)
    shard = plant_entry(path, "note", marker)
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as e:
        untrusted.load_dcp({"w": torch.empty(2), "note": ""}, path, no_dist=True)
    assert str(e.value).startswith(
        f"cannot load {path}: rank 0: refusing to read the entry 'note' in {shard}"
    ), e.value
    assert not marker.exists(), "loading ran the planted code"

    def interrupted(self, read_item, value):
        raise KeyboardInterrupt

    monkeypatch.setattr(untrusted.SafePlanner, "load_bytes", interrupted)
    with pytest.warns(UserWarning), pytest.raises(CheckpointException) as e:
        untrusted.load_dcp({"w": torch.empty(2), "note": ""}, path, no_dist=True)
    assert not isinstance(e.value, Exception)


def test_extra_state_round_trips_across_grids_and_only_as_plain_data(tmp_path):
    """``get_extra_state``: JSON data and tensors are saved, restored through ``set_extra_state`` on another grid;
    anything that would need unpickling a class is refused at save time, naming the module and the fix."""
    path = tmp_path / "extra.ckpt"
    saved = harness.run(2, extra_state_job, str(path), True)
    for r in saved:
        for message in r["refused"]:
            assert (
                message.startswith("tally._extra_state: Tally.get_extra_state() returned")
                and "plain JSON data" in message
            ), message
    loaded = harness.run(2, extra_state_job, str(path), False)
    for r in loaded:
        assert r["stats"] == {"seen": 7, "tags": ["x", "y"], "rate": 0.25, "last": None}, r["stats"]
        assert r["scale"] == [1.0, 2.0, 3.0], r["scale"]
        assert_equal(r["weight"], saved[0]["weight"], "Linear3D beside extra state, 2x1x1 -> 1x1x1 dp2")


def test_payload_in_deepspeed_model_states_runs_nothing(tmp_path):
    deepspeed_3d = pytest.importorskip("deepspeed_3d")
    marker = tmp_path / "ran"
    (tmp_path / "ds" / "tag").mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("tag")
    torch.save(Payload(marker), tmp_path / "ds" / "tag" / "mp_rank_00_model_states.pt")
    with pytest.raises(Exception, match="mp_rank_00_model_states.pt"):
        deepspeed_3d.to_dense(tmp_path / "ds")
    assert not marker.exists(), "reading a DeepSpeed checkpoint ran the planted code"


# ----- complete or not a checkpoint -----


def _flip_values(file: Path) -> None:
    """Change four float32 values in the middle of a DCP shard (its pickled headers stay intact)."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2 & ~3
    for i in range(4):
        data[middle + 4 * i + 2] ^= 0x40
    file.write_bytes(bytes(data))


def test_damaged_files_are_named(saved, tmp_path):
    shard = "__1_0.distcp"
    altered = copy_of(saved[0], tmp_path, "altered.ckpt")
    _flip_values(altered / shard)
    truncated = copy_of(saved[0], tmp_path, "truncated.ckpt")
    (truncated / shard).write_bytes((truncated / shard).read_bytes()[:-100])
    missing = copy_of(saved[0], tmp_path, "missing.ckpt")
    (missing / "rng" / "2.json").unlink()
    for path, words in [
        (altered, [shard, "SHA-256"]),
        (truncated, [shard, "bytes"]),
        (missing, ["rng/2.json", "missing"]),
    ]:
        with pytest.raises(CheckpointError) as e:
            ckpt.to_dense(path)
        assert all(w in str(e.value) for w in words), (path.name, str(e.value))
    for r in harness.run(4, load_job, str(altered)):
        assert shard in r and "SHA-256" in r, r


def test_files_the_manifest_does_not_list_are_refused(saved, tmp_path):
    """A file read from a checkpoint was checked only if the manifest lists it: an unlisted one is refused."""
    unlisted = {}
    for name in ("layout.json", "meta.pt", ".metadata"):
        unlisted[name] = copy_of(saved[0], tmp_path, f"unlisted{name}")
        relist(unlisted[name], [name], drop=True)
    for name, read in [
        ("layout.json", ckpt.read_record),
        ("layout.json", ckpt.to_dense),
        ("meta.pt", ckpt.load_meta),
        (".metadata", ckpt.to_dense),
    ]:
        with pytest.raises(CheckpointError, match=f"{name} is not listed in the manifest"):
            read(unlisted[name])
    for r in harness.run(4, load_job, str(unlisted["layout.json"])):
        assert "layout.json is not listed in the manifest" in r, r


def test_a_failed_rank_leaves_the_previous_checkpoint(tmp_path):
    last = tmp_path / "last.ckpt"
    first = harness.run(4, save_job, str(last), 0)[0]
    errors = harness.run(4, failing_save_job, str(last), 2)
    assert all("rank 2" in e and "No space left" in e for e in errors), errors
    assert ckpt.latest_complete(tmp_path) == last
    assert_equal(ckpt.to_dense(last), first, "last.ckpt after a failed overwrite")
    second = harness.run(4, save_job, str(last), 5)[0]
    assert_equal(ckpt.to_dense(last), second, "last.ckpt after an overwrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"], (
        "a staging or old directory was left behind"
    )
    assert ckpt.latest_complete(tmp_path) == last


def test_a_rank_killed_mid_save_leaves_no_checkpoint(tmp_path):
    import torch.multiprocessing as mp

    path, old = tmp_path / "new.ckpt", tmp_path / "old.ckpt"
    ctx = mp.get_context("spawn")
    port = harness._free_port()
    procs = [ctx.Process(target=killed_rank_world, args=(r, port, str(path), str(old))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    assert procs[1].exitcode == -signal.SIGKILL, [p.exitcode for p in procs]
    assert procs[0].exitcode not in (0, None), "the surviving rank finished a save its peer never completed"
    assert not path.exists(), "a checkpoint became visible though a rank died before writing its RNG file"
    assert ckpt.latest_complete(tmp_path) == old
    with pytest.raises(CheckpointError, match="not a complete"):
        ckpt.to_dense(path)


# ----- another model is refused -----


def test_another_model_is_refused_naming_both_shapes(saved):
    path = str(saved[0])
    for r in harness.run(4, load_job, path, 62, 2):
        assert "model.transformer.wte.weight [60, 16]; this model has [62, 16]" in r, r
    for r in harness.run(4, load_job, path, 60, 1):
        assert "model.transformer.h.1.ln_1.weight" in r and "this model lacks" in r, r
    assert harness.run(4, load_job, path, 60, 1, False) == ["loaded"] * 4  # not strict: the tensors both have


# ----- dense export -----


def test_to_dense_needs_no_prefix_and_carries_the_config(saved, tmp_path):
    path, dense = saved
    for out in [tmp_path / "dense.safetensors", tmp_path / "dense.pt"]:
        ckpt.main(["to-dense", str(path), str(out)])
        model = dense_gpt(out)
        assert model.config == config()
        assert_equal(model.state_dict(), dense, f"DenseGPT built from {out.name} alone")
    assert sorted(ckpt.to_dense(path, prefix="")) == sorted(["seen"] + [f"model.{k}" for k in dense])


# ----- under Lightning -----


def test_lightning_refuses_another_model_and_exports_without_prefix(tmp_path):
    """fit/validate(ckpt_path=) of a vocab-60, 2-layer checkpoint into vocab 62 or 1 layer; "last"; to-dense."""
    script = Path(__file__).parent / "lightning_scripts" / "other_model.py"
    root = Path(__file__).parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    record = json.loads((tmp_path / "other_model.json").read_text())
    for fn in ("validate", "fit"):
        vocab = record["errors"][f"{fn} vocab 62 layers 2"]
        assert (
            vocab
            and "checkpoint holds model.transformer.wte.weight [60, 16]; this model has [62, 16]" in vocab
        ), vocab
        layers = record["errors"][f"{fn} vocab 60 layers 1"]
        assert layers and "model.transformer.h.1." in layers and "which this model lacks" in layers, layers
    assert record["steps_after_resume"] == 2, (
        "fit(ckpt_path='last') did not resume after the first epoch's 2 steps"
    )
    out = tmp_path / "dense.safetensors"
    ckpt.main(["to-dense", str(tmp_path / "first.ckpt"), str(out)])
    model = dense_gpt(out)
    assert model.config == GPTConfig(vocab_size=60, block_size=8, n_layer=2, n_head=2, n_embd=16)
    assert_equal(
        model.state_dict(),
        torch.load(tmp_path / "dense_state.pt"),
        "DenseGPT from a Lightning checkpoint's export",
    )


def test_meta_holds_a_model_config_only_where_the_caller_allows_it(tmp_path):
    """The checkpoint package allows no model's class in ``meta.pt``; the strategies allow ``GPTConfig``
    (a LightningModule's hyper-parameter), and still nothing that runs code."""
    from lightning_3d.checkpoint.untrusted import load_weights_only
    from lightning_3d.strategy.checkpoints import META_CLASSES

    meta = tmp_path / "meta.pt"
    torch.save({"hyper_parameters": {"config": config()}}, meta)
    with pytest.raises(CheckpointError, match="GPTConfig"):
        load_weights_only(meta)
    assert load_weights_only(meta, allowed=META_CLASSES)["hyper_parameters"]["config"] == config()
    marker = tmp_path / "ran"
    torch.save({"hyper_parameters": {"config": config(), "payload": Payload(marker)}}, meta)
    with pytest.raises(CheckpointError):
        load_weights_only(meta, allowed=META_CLASSES)
    assert not marker.exists()
