"""Fabric(strategy="tensor3d") in real multi-process Fabric loops (gloo, CPU), judged against DenseGPT in float64.

The loops live in driver scripts (``fabric_scripts/``): ``suite.py world4`` is started here one
process per rank (see its docstring for the runs F1, F2, T, F3), ``stops.py`` in worlds of 2 for
the preemption and the killed rank, and ``cli_run.py`` by ``fabric run`` (torchrun).
"""

import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).parent / "lightning_scripts"))

import common
import worlds

from lightning_3d import checkpoint as ckpt
from lightning_3d.models import DenseGPT

SCRIPTS = Path(__file__).parent / "fabric_scripts"
TOL = 1e-9  # float64 throughout
LOSS_TOL = 1e-7  # Fabric's 64-true hands the model's output back in float32 (the gradients stay float64)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fabric")
    worlds.launch(SCRIPTS / "suite.py", 4, out, "world4", str(out), timeout=300)
    return out


def dense_reference(epochs: int) -> dict:
    """DenseGPT in float64 from the same init, trained on the first epoch's global batches ``epochs`` times over;
    its losses, pre-clip gradient norms, and state after the first epoch."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(common.INIT_SEED)
        model = DenseGPT(common.config())
    finally:
        torch.set_default_dtype(default)
    opt = torch.optim.AdamW(model.parameters(), lr=common.LR, weight_decay=0.1)
    data = common.Tokens()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=common.SEED)
    losses, norms, states = [], [], []
    for _ in range(epochs):
        for _, tokens in DataLoader(data, batch_size=common.GLOBAL_BATCH, sampler=sampler):
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            losses.append(loss.item())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), common.CLIP).item())
            opt.step()
            opt.zero_grad()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return {"loss": losses, "grad_norm": norms, "state": states[0]}


@pytest.fixture(scope="module")
def dense() -> dict:
    return dense_reference(3)


def records(out: Path, name: str) -> list[dict]:
    recs = common.read_records(out, name)
    assert recs, f"run {name} wrote no records"
    return recs


def assert_close(got: list, want: list, what: str, tol: float = TOL) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} values, expected {len(want)}"
    err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}\n got  {got}\n want {want}"


def test_fabric_steps_equal_the_dense_model_and_the_trainer(runs, dense):
    """F1 (2×1×1 dp 2, ZeRO-1, two micro-batches a step): the dense model's first three AdamW steps; F2 (Fabric,
    2×2×1) and T (Trainer, 1×2×2), both resumed from F1's checkpoint: the next three, equal to each other;
    F3 (1×1×1 dp 4) resumed from T's checkpoint: the three after those."""
    for name, steps in [("F1", slice(0, 3)), ("F2", slice(3, 6)), ("T", slice(3, 6)), ("F3", slice(6, 9))]:
        for rec in records(runs, name):
            assert_close(rec["loss"], dense["loss"][steps], f"{name} losses", LOSS_TOL)
            assert_close(rec["grad_norm"], dense["grad_norm"][steps], f"{name} gradient norms")
    f2, t = records(runs, "F2")[0], records(runs, "T")[0]
    assert_close(f2["grad_norm"], t["grad_norm"], "Fabric's gradient norms against the Trainer's", tol=1e-12)
    assert_close(f2["loss"], t["loss"], "Fabric's losses against the Trainer's", LOSS_TOL)


def test_models_built_on_meta_go_on_the_grid_in_the_precision(runs):
    grids = {
        name: (records(runs, name)[0]["grid"], records(runs, name)[0]["dp"]) for name in ("F1", "F2", "F3")
    }
    assert grids == {"F1": ([2, 1, 1], 2), "F2": ([2, 2, 1], 1), "F3": ([1, 1, 1], 4)}
    assert records(runs, "T")[0]["grid"] == [1, 2, 2]
    for name in ("F1", "F2", "F3"):
        assert all(r["meta_built"] and r["dtype"] == "torch.float64" for r in records(runs, name)), name
    assert (
        records(runs, "F2")[0]["strategy"] == "lightning_3d.strategy.fabric.Tensor3DFabricStrategy"
    )  # by name
    assert (
        records(runs, "F3")[0]["strategy"] == "lightning_3d.strategy.lightning_fabric.Tensor3DFabricStrategy"
    )


def test_cube_ranks_share_a_batch_and_dp_ranks_split_it(runs):
    recs = records(runs, "F1")  # 2×1×1, dp 2: ranks 0, 1 are dp 0; ranks 2, 3 dp 1
    assert recs[0]["batches"] == recs[1]["batches"] and recs[2]["batches"] == recs[3]["batches"]
    for step in range(len(recs[0]["batches"])):
        assert not set(recs[0]["batches"][step]) & set(recs[2]["batches"][step])
    seen = [i for r in (recs[0], recs[2]) for b in r["batches"] for i in b]
    assert sorted(seen) == list(range(common.N_SEQ))


def test_no_backward_sync_leaves_the_dp_replicas_apart_until_the_synced_backward(runs):
    for rec in records(runs, "F1"):
        assert rec["unsynced"] == [False] * 3 and rec["synced"] == [True] * 3


def test_fabric_collectives_span_the_world(runs):
    for rec in records(runs, "F1"):
        assert rec["world_sum"] == 4.0 and rec["gathered"] == [4] and rec["broadcast"] == "from 0"


def test_loaded_state_and_remainder(runs):
    """The step counter and the scheduler come back from a Fabric checkpoint, entries the state does not name are
    returned; from the Trainer's checkpoint, its loop state is returned."""
    for rec in records(runs, "F2"):
        assert rec["loaded_step"] == 3 and rec["scheduler_epoch"] == 3 and rec["remainder"] == ["note"]
    for rec in records(runs, "F3"):
        assert {"epoch", "global_step", "loops"} <= set(
            rec["remainder"]
        ) and "tensor3d_param_groups" not in rec["remainder"]


def test_to_dense_exports_a_fabric_checkpoint(runs, dense, tmp_path):
    out = tmp_path / "dense.pt"
    ckpt.main(["to-dense", str(runs / "F1"), str(out)])
    model = DenseGPT(common.config()).double()
    model.load_state_dict(torch.load(out), strict=True)
    err = max(float((p - dense["state"][k]).abs().max()) for k, p in model.state_dict().items())
    assert err < 1e-12, f"the dense export of F1 differs from DenseGPT trained 3 steps by {err:.2e}"


# ----- stops, registration and the command line: worlds of 2, all started at once -----


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """The preempted and the killed worlds of 2 (both Fabric namespaces imported before lightning_3d) and ``fabric run``
    of 2 (lightning_3d first), side by side."""
    out = tmp_path_factory.mktemp("fabric_stops")
    procs, logs = {}, {}
    for mode in ("preempt", "kill"):
        (out / mode).mkdir()
        procs[mode], logs[mode] = worlds.start(SCRIPTS / "stops.py", 2, out / mode, (mode, str(out / mode)))
    (out / "cli").mkdir()
    commands = {
        "cli": [
            sys.executable,
            "-m",
            "lightning_3d.strategy.fabric_cli",
            "run",
            "--accelerator",
            "cpu",
            "--devices",
            "2",
            "--strategy",
            "tensor3d",
            "--precision",
            "bf16-mixed",
            "--main-port",
            str(worlds.free_port()),
            str(SCRIPTS / "cli_run.py"),
            str(out / "cli"),
        ]
    }
    for name, args in commands.items():
        logs[name] = [out / f"{name}.log"]
        with open(logs[name][0], "w") as log:
            procs[name] = [subprocess.Popen(args, env=worlds.env(), stdout=log, stderr=subprocess.STDOUT)]
    hung = worlds.wait([p for ps in procs.values() for p in ps], timeout=300)
    assert not hung, f"processes {hung} still ran after 300 s"
    return {
        "out": out,
        "status": {name: [p.returncode for p in ps] for name, ps in procs.items()},
        "log": {name: [worlds.tail(f, 60) for f in files] for name, files in logs.items()},
    }


def test_fabric_run_takes_the_strategy_by_name_registered_in_both_namespaces(launched):
    """``lightning_3d`` imported first registers ``"tensor3d"`` in both Fabric namespaces as they are imported (and
    ``stops.py``, which imports them first, at once)."""
    assert launched["status"]["cli"] == [0], launched["log"]["cli"][0]
    recs = common.read_records(launched["out"] / "cli", "cli")
    assert len(recs) == 2 and all(
        r["registered"] == [True, True] and r["grid"] == [2, 1, 1] and r["world"] == 2 for r in recs
    )
    assert all(
        r["strategy"] == "lightning_3d.strategy.fabric.Tensor3DFabricStrategy"
        and r["precision"] == "MixedPrecision"
        and math.isfinite(r["loss"])
        for r in recs
    )


def test_sigterm_on_one_rank_stops_every_rank_at_one_step_with_a_checkpoint(launched):
    out, log = launched["out"] / "preempt", launched["log"]["preempt"]
    assert launched["status"]["preempt"] == [128 + signal.SIGTERM] * 2, log
    signalled = float((out / "signalled_at").read_text())
    took = max(float((out / f"exit.rank{r}").read_text()) for r in range(2)) - signalled
    assert took < 30, f"the ranks took {took:.0f} s to stop after the signal"
    steps = common.read_records(out, "steps")  # 16-true: the model in fp16
    assert [(s["dtype"], len(s["loss"])) for s in steps] == [("torch.float16", 4)] * 2 and all(
        map(math.isfinite, steps[0]["loss"])
    )
    assert ckpt.is_complete(out / "preempted")
    assert ckpt.load_meta(out / "preempted")["step"] == 4  # signalled after step 2's vote: agreed at step 4's
    assert (
        "rank 1 received SIGTERM; every rank stopped at check_preemption call 5" in log[0]
        and "fabric.load(" in log[0]
    ), log[0]


def test_a_killed_rank_stops_the_others_within_seconds(launched):
    out, log = launched["out"] / "kill", launched["log"]["kill"]
    assert launched["status"]["kill"][0] not in (0, None), log[0]
    steps = common.read_records(out, "steps")[0]  # bf16-true: the model in bf16 trained until the kill
    assert (
        steps["dtype"] == "torch.bfloat16"
        and len(steps["loss"]) >= 2
        and all(map(math.isfinite, steps["loss"]))
    ), steps
    took = float((out / "exit.rank0").read_text()) - float((out / "killed_at").read_text())
    assert took < 30, f"rank 0 took {took:.0f} s to fail after rank 1 died (timeout 60 s)"


def test_arguments_and_precisions_are_checked_early():
    """Refused at construction, or at ``Fabric(...)`` before any process starts (the grid against the devices)."""
    import lightning.fabric as L
    from lightning.fabric.plugins.precision import FSDPPrecision

    from lightning_3d import Tensor3DFabricStrategy

    for bad in [
        {"grid": (2, 2)},
        {"data_parallel_size": 0},
        {"zero_stage": 2},
        {"timeout": 0},
        {"plan": "gpt"},
        {"options": {}},
        {"precision": FSDPPrecision("bf16-mixed")},
        {"bucket_cap": 1},
    ]:
        with pytest.raises(ValueError):
            Tensor3DFabricStrategy(**bad)
    with pytest.raises(ValueError, match="world size 4 is not divisible by px·py·pz = 3"):
        L.Fabric(accelerator="cpu", devices=4, strategy=Tensor3DFabricStrategy(grid=(3, 1, 1)))
