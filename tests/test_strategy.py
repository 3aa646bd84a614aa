"""Trainer(strategy="tensor3d") in real multi-process ``Trainer.fit`` runs (gloo, CPU), judged against DenseGPT.

Lightning's launcher re-executes ``sys.argv``, so the runs live in driver scripts
(``lightning_scripts/``). ``suite.py`` worlds are started here, one process per rank with
``RANK``/``WORLD_SIZE``/... set, so each world serves several Trainers (see its docstring for
the runs A–I); the kill test lets Lightning launch its own processes. Every run trains the same
tiny GPT3D on the same global batches as ``common.dense_reference``.
"""

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "lightning_scripts"))

import common
import worlds
from side_by_side import Finished, run_side_by_side

from lightning_3d import RuntimeOptions
from lightning_3d import checkpoint as ckpt
from lightning_3d.models import DenseGPT
from lightning_3d.strategy import grid_rules

SCRIPTS = Path(__file__).parent / "lightning_scripts"
TOL = 1e-5


_env = worlds.env  # the drivers' environment, also for test_preemption and test_launch_errors


def launch(world: int, out: Path, *args: str) -> None:
    worlds.launch(SCRIPTS / "suite.py", world, out, *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Worlds of 4 and 1 (resuming the world of 4's run B) processes; their records under one folder."""
    out = tmp_path_factory.mktemp("tensor3d")
    launch(4, out, "world4", str(out))
    launch(1, out, "world1", str(out), str(out / "B" / "epoch=1.ckpt"))
    return out


@pytest.fixture(scope="module")
def dense() -> dict:
    return common.dense_reference(9)


def records(out: Path, name: str) -> list[dict]:
    recs = common.read_records(out, name)
    assert recs, f"run {name} wrote no records"
    return recs


def assert_close(got: list, want: list, what: str, tol: float = TOL) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} values, expected {len(want)}"
    err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}\n got  {got}\n want {want}"


# ----- without processes -----


@pytest.mark.parametrize(
    "n, shape",
    [(1, (1, 1, 1)), (2, (2, 1, 1)), (4, (2, 2, 1)), (8, (2, 2, 2)), (12, (3, 2, 2)), (6, (3, 2, 1))],
)
def test_auto_grid_factors_evenly(n, shape):
    assert grid_rules.auto_shape(n) == shape
    assert grid_rules.resolve("auto", "auto", n, n) == (shape, 1)


def test_auto_grid_from_the_cost_model():
    """With the model's shape, "auto" takes the planner's pick: the grids measured fastest on 4 GPUs."""
    from lightning_3d.cost import ModelShape

    assert grid_rules.resolve("auto", "auto", 4, 4, ModelShape(4096, 32, 2048, 8, 4)) == ((4, 1, 1), 1)
    assert grid_rules.resolve("auto", "auto", 4, 4, ModelShape(8192, 64, 2048, 4, 2)) == ((1, 4, 1), 1)
    odd = ModelShape(4096, 32, 2048, 3, 4)  # 3 sequences on 4 ranks: token rows, or no grid at all
    assert grid_rules.resolve("auto", "auto", 4, 4, odd)[1] == 1
    with pytest.raises(ValueError, match="no px·py·pz grid"):
        grid_rules.resolve("auto", "auto", 4, 4, odd, options=RuntimeOptions(rows="sequences"))


def _links(pairs_GBps: float | None, quads_GBps: float):
    """DEFAULT_MACHINE with the links of groups of four (and of two, unless None) at the given bus bandwidth."""
    import dataclasses

    from lightning_3d.cost import DEFAULT_MACHINE, Link

    def link(size, default):
        speed = quads_GBps if size == 4 else pairs_GBps
        return default if speed is None else Link(speed, 50.0)

    return dataclasses.replace(
        DEFAULT_MACHINE,
        intra={op: {g: link(g, old) for g, old in t.items()} for op, t in DEFAULT_MACHINE.intra.items()},
    )


LLAMA_7B_JOB = dict(
    hidden=4096, heads=32, seq=2048, batch=8, layers=32, ffn=11008, kv_heads=8, gated=True, vocab=32000
)


def test_auto_grid_prices_with_the_given_machine():
    """``Tensor3DStrategy(machine=...)``: slow links between four ranks (15 GB/s, as through host
    memory) move Llama 7B's whole job on 4 GPUs from 4×1×1 to 1×2×1 with dp 2, whose groups are
    pairs; resolved in the launching process."""
    import lightning.pytorch as pl

    from lightning_3d import Tensor3DStrategy
    from lightning_3d.cost import ModelShape

    shape = ModelShape(**LLAMA_7B_JOB)
    picks = [
        pl.Trainer(
            accelerator="cpu",
            devices=4,
            strategy=Tensor3DStrategy(model_shape=shape, machine=m),
            logger=False,
        ).strategy._resolve_grid()
        for m in (None, _links(None, 15.0))
    ]
    assert picks == [((4, 1, 1), 1), ((1, 2, 1), 2)]


def test_auto_grid_prices_a_half_precision_gradient_hook():
    """``ddp_comm_hook=bf16_compress_hook`` halves the bytes of the gradient reduction over dp, and
    ``grid="auto"`` prices it so: with pairs at 60 GB/s and groups of four at 15, Llama 7B's whole
    job moves from 2×2×1 to 1×2×1 with dp 2; a hook that does not halve them changes nothing."""
    import lightning.pytorch as pl
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lightning_3d import Tensor3DStrategy
    from lightning_3d.cost import ModelShape

    shape, machine = ModelShape(**LLAMA_7B_JOB), _links(60.0, 15.0)

    def pick(hook):
        strategy = Tensor3DStrategy(model_shape=shape, machine=machine, ddp_comm_hook=hook)
        return pl.Trainer(
            accelerator="cpu", devices=4, strategy=strategy, logger=False
        ).strategy._resolve_grid()

    assert pick(default_hooks.bf16_compress_hook) == pick(default_hooks.fp16_compress_hook) == ((1, 2, 1), 2)
    assert pick(None) == pick(default_hooks.allreduce_hook) == ((2, 2, 1), 1)


def test_auto_grid_prices_the_options():
    """``grid="auto"`` prices the strategy's ``options``, else the defaults (the model is made after the grid):
    the weight gradients handed on at the end of backward (``grads_at_end``) reach the bf16 dp reduction only
    after backward and so move the pick from 1×2×1 dp 2 to 2×2×1."""
    import lightning.pytorch as pl
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lightning_3d import Tensor3DStrategy
    from lightning_3d.cost import ModelShape
    from lightning_3d.options import RuntimeOptions

    shape, machine = ModelShape(**LLAMA_7B_JOB), _links(30.0, 15.0)
    assert RuntimeOptions().grads_at_end
    priced = {
        late: grid_rules.resolve(
            "auto",
            "auto",
            4,
            4,
            shape,
            options=RuntimeOptions(grads_at_end=late),
            machine=machine,
            half_grads=True,
        )
        for late in (False, True)
    }
    assert priced == {False: ((1, 2, 1), 2), True: ((2, 2, 1), 1)}

    def pick(options):
        strategy = Tensor3DStrategy(
            model_shape=shape,
            machine=machine,
            ddp_comm_hook=default_hooks.bf16_compress_hook,
            options=options,
        )
        return pl.Trainer(
            accelerator="cpu", devices=4, strategy=strategy, logger=False
        ).strategy._resolve_grid()

    assert pick(None) == pick(RuntimeOptions()) == ((2, 2, 1), 1)
    assert pick(RuntimeOptions(grads_at_end=False)) == ((1, 2, 1), 2)


def test_grid_rules_and_errors():
    assert grid_rules.resolve("auto", "auto", 16, 8) == ((2, 2, 2), 2)  # two nodes of 8: dp across nodes
    assert grid_rules.resolve("auto", 2, 8, 8) == ((2, 2, 1), 2)
    assert grid_rules.resolve((2, 1, 1), "auto", 8, 8) == ((2, 1, 1), 4)
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by px·py·pz = 3"):
        grid_rules.resolve((3, 1, 1), "auto", 8, 8)
    with pytest.raises(ValueError, match=r"world size 8 != data_parallel_size·px·py·pz = 2·8 = 16"):
        grid_rules.resolve((2, 2, 2), 2, 8, 8)
    with pytest.raises(ValueError, match=r"data_parallel_size=3 does not divide the world size 8"):
        grid_rules.resolve("auto", 3, 8, 8)
    from lightning_3d import Tensor3DStrategy

    for bad in [
        {"grid": (2, 2)},
        {"grid": (2, 0, 1)},
        {"grid": "2x2x2"},
        {"data_parallel_size": 0},
        {"zero_stage": 2},
        {"timeout": -1},
    ]:
        with pytest.raises(ValueError):
            Tensor3DStrategy(**bad)


IMPORT_ORDERS = [
    "from lightning_3d import Tensor3DStrategy",
    "import deepspeed_3d, lightning_3d",
    # a namespace's module imported first, after deepspeed_3d: DeepSpeed's strategy (which subclasses it) waits for it
    "import deepspeed_3d\nfrom lightning_3d.strategy.pytorch_lightning import Tensor3DStrategy\n"
    "from lightning_3d.strategy.lightning import Tensor3DStrategy",
]


@pytest.fixture(scope="module")
def registrations() -> dict[str, Finished]:
    """For each import order, a fresh interpreter (side by side) checking both namespaces and strategies."""
    commands = {}
    for first in IMPORT_ORDERS:
        code = (
            f"{first}\n"
            "import deepspeed_3d, sys\n"
            "assert 'Tensor3DStrategy' in sys.argv[-1] or not {'lightning', 'pytorch_lightning'} & set(sys.modules)\n"
            "import pytorch_lightning as ptl, lightning.pytorch as pl\n"
            "from lightning.pytorch.strategies import StrategyRegistry as A\n"
            "from pytorch_lightning.strategies import StrategyRegistry as B\n"
            "assert all(name in reg for name in ('tensor3d', 'tensor3d_deepspeed') for reg in (A, B))\n"
            "assert all(hasattr(m, n) for m in (pl, ptl) for n in ('loggers', 'callbacks', 'Trainer'))\n"
        )
        commands[first] = dict(args=[sys.executable, "-c", code, first])
    return run_side_by_side(commands, timeout=180)


@pytest.mark.parametrize("first", IMPORT_ORDERS)
def test_registration_in_either_import_order(registrations, first):
    """Whatever comes first, both namespaces end up whole, with both strategies registered."""
    run = registrations[first]
    assert run.returncode == 0, run.stderr[-3000:]


# ----- the worlds -----


def test_selected_by_name_in_both_namespaces(runs):
    a, e = records(runs, "A")[0], records(runs, "E")[0]
    assert (
        a["strategy"] == "lightning_3d.strategy.lightning.Tensor3DStrategy"
        and a["grid"] == [2, 2, 1]
        and a["dp"] == 1
    )
    assert e["strategy"] == "lightning_3d.strategy.pytorch_lightning.Tensor3DStrategy" and e["grid"] == [
        1,
        1,
        1,
    ]
    cli = json.loads((runs / "cli.json").read_text())
    assert (
        cli["by_name"] == cli["by_path"] == "Tensor3DStrategy"
        and "pytorch_lightning.strategies.ddp" in cli["by_name_bases"]
    )
    assert not any(
        m.startswith("lightning.") for m in cli["by_name_bases"]
    )  # the other namespace's class stays apart
    assert cli["by_path_args"] == [[1, 1, 1], 1, 45.0]


def test_cube_ranks_share_a_batch_and_dp_ranks_split_it(runs):
    a = records(runs, "A")
    assert all(r["batches"] == a[0]["batches"] for r in a), (
        "2×2×1, dp 1: every rank must see the same batches"
    )
    b = records(runs, "B")  # 2×1×1, dp 2 over epoch 1 (A's steps 4-6)
    by_dp = {}
    for r in b:
        by_dp.setdefault(r["coords"][0], []).append(r["batches"])
    assert sorted(by_dp) == [0, 1] and all(len(v) == 2 for v in by_dp.values())
    assert all(all(x == v[0] for x in v) for v in by_dp.values()), "ranks of one cube saw different batches"
    for step, (b0, b1) in enumerate(zip(by_dp[0][0], by_dp[1][0])):
        assert len(b0) == len(b1) == 4 and not set(b0) & set(b1), (
            f"step {step}: dp replicas overlap: {b0} {b1}"
        )
        assert sorted(b0 + b1) == sorted(a[0]["batches"][3 + step]), (
            "the dp replicas must split the global batch"
        )


def test_dataloader_workers_draw_alike_within_a_cube_and_apart_across_dp(runs):
    """F loads with one worker process a rank, seeded by seed_everything(workers=True): the ranks of a cube share
    a batch, so their workers must draw the same numbers; the dp replicas' workers must draw different ones."""
    f = records(runs, "F")
    by_dp = {}
    for r in f:
        assert len(r["draws"]) == 6 and all(len(d) == 4 for d in r["draws"]), (
            "every step's batch carries its workers' draws"
        )
        by_dp.setdefault(r["coords"][0], []).append(r["draws"])
    assert sorted(by_dp) == [0, 1] and all(len(v) == 2 for v in by_dp.values())
    for dp, draws in by_dp.items():
        assert draws[0] == draws[1], (
            f"dp replica {dp}: the two ranks of its cube drew differently in their workers"
        )
    assert not set(map(tuple, by_dp[0][0])) & set(map(tuple, by_dp[1][0])), (
        "the dp replicas' workers drew alike"
    )


def test_fit_equals_dense_twin(runs, dense):
    for name, what in [("A", "2×2×1"), ("F", "2×1×1 dp 2")]:
        rec = records(runs, name)[0]
        assert_close(rec["loss"], dense["loss"][:6], f"{what} losses")
        assert_close(rec["grad_norm"], dense["grad_norm"][:6], f"{what} gradient norms")
    assert max(dense["grad_norm"][:6]) > common.CLIP, "clipping never acted: this test could not fail on it"


def test_one_sequence_a_replica_runs_on_token_rows_as_the_dense_twin(runs):
    """2×1×1 dp 2 at a global batch of 2: each replica's one sequence is cut into token rows."""
    rec, reference = records(runs, "J")[0], common.dense_reference(12, global_batch=2)
    assert rec["global_step"] == 12
    assert_close(rec["loss"], reference["loss"], "2×1×1 dp 2 batch 1 losses")
    assert_close(rec["grad_norm"], reference["grad_norm"], "2×1×1 dp 2 batch 1 gradient norms")


def test_bf16_mixed_follows_the_dense_twin(runs, dense):
    h = records(runs, "H")[0]
    assert_close(h["loss"], dense["loss"][:3], "2×1×1 dp 2 bf16-mixed losses", 5e-3)
    assert h["loss"] != dense["loss"][:3], "bf16-mixed gave float32's exact losses: autocast was off"


def test_ddp_comm_hook_reduces_dp_gradients_in_half_precision(runs):
    f, i = records(runs, "F")[0], records(runs, "I")[0]
    assert i["loss"][0] == f["loss"][0], "the first loss comes before any reduction"
    assert_close(i["loss"], f["loss"][: len(i["loss"])], "fp16-reduced vs float32-reduced losses", 1e-2)
    assert i["loss"][1:] != f["loss"][1 : len(i["loss"])], (
        "fp16_compress_hook changed nothing: the hook was not registered"
    )


def test_options_reach_every_layer(runs):
    """``Tensor3DStrategy(options=...)`` replaces the model's options in every 3-D layer at setup; without them the
    model keeps those it was built with."""
    from lightning_3d.options import RuntimeOptions

    given = dataclasses.asdict(RuntimeOptions(save_gathered=False, check_inputs=False))
    assert [r["options"] for r in records(runs, "I")] == [given] * 4
    assert [r["options"] for r in records(runs, "F")] == [dataclasses.asdict(RuntimeOptions())] * 4


def test_resume_continues_exactly(runs):
    c, d = records(runs, "C")[0], records(runs, "D")[0]  # with dropout: RNG state must come back too
    assert d["global_step"] == 6 and d["loss"] == c["loss"][3:], (
        f"resumed {d['loss']} != uninterrupted {c['loss'][3:]}"
    )


def test_reshard_on_load_across_grids(runs, dense):
    """B resumes A's 2×2×1 run on 2×1×1 with dp 2 and ZeRO-1 (the optimizer state resharded over dp);
    E resumes B's on one process."""
    b, e = records(runs, "B")[0], records(runs, "E")[0]
    assert b["grid"] == [2, 1, 1] and b["dp"] == 2
    assert_close(b["loss"], dense["loss"][3:6], "2×2×1 → 2×1×1 dp 2 (ZeRO-1) losses")
    assert_close(b["grad_norm"], dense["grad_norm"][3:6], "2×2×1 → 2×1×1 dp 2 (ZeRO-1) gradient norms")
    assert_close(e["loss"], dense["loss"][6:9], "2×1×1 dp 2 → 1×1×1 losses")


def test_sync_dist_and_collectives_count_each_replica_once(runs):
    for name in ("A", "B", "F"):
        for r in records(runs, name):
            dp = r["dp"]
            assert r["seqs"] == [common.GLOBAL_BATCH] * len(r["seqs"]), (
                f"{name}: sum-logged batch sizes {r['seqs']}"
            )
            assert r["reduce_sum"] == dp and r["all_gather"] == [[float(d)] for d in range(dp)], (name, r)


def test_model_summary_counts_the_full_model(runs):
    """Rank 0 of 2×1×1 holds about half of each weight; Lightning's table must still state the dense model's size."""
    from lightning.pytorch.utilities.model_summary import get_human_readable_count

    table = (runs / "world4.log0").read_text()
    total = sum(p.numel() for p in DenseGPT(common.config()).parameters())
    lines = [
        line.replace("Total params", "").strip(" :") for line in table.splitlines() if "Total params" in line
    ]
    assert lines, f"no model summary in rank 0's log:\n{table[-2000:]}"
    assert lines[0] == get_human_readable_count(total).strip(), (
        f"summary says {lines[0]!r} parameters: the dense model has {total}"
    )


def test_validate_after_fit_keeps_every_shard(runs):
    recs = [json.loads(f.read_text()) for f in sorted(runs.glob("validate.rank*.json"))]
    assert len(recs) == 4 and all(r["kept_shards"] for r in recs), "validate changed a rank's parameters"
    model = DenseGPT(common.config())
    model.load_state_dict(common.dense_reference(6)["state"])
    tokens = common.Tokens().data
    with torch.no_grad():
        want = model(tokens[:, :-1], tokens[:, 1:]).item()
    assert_close([r["val_loss"] for r in recs], [want] * 4, "validation loss after fit (2×1×1 dp 2)")


def test_dense_export_loads_into_densegpt(runs, dense, tmp_path):
    out = tmp_path / "dense.pt"
    ckpt.main(["to-dense", str(runs / "B" / "epoch=1.ckpt"), str(out), "--prefix", "model."])
    model = DenseGPT(common.config())
    model.load_state_dict(torch.load(out), strict=True)
    reference = common.dense_reference(6)["state"]
    err = max(float((p - reference[k]).abs().max()) for k, p in model.state_dict().items())
    assert err < 1e-5, f"dense export differs from DenseGPT trained 6 steps by {err:.2e}"


def test_a_dead_rank_fails_fast_with_a_checkpoint_to_resume_from(tmp_path):
    """Resuming from such a checkpoint: the resumed runs here and in test_preemption.py."""
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "kill_rank.py"), str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    log = run.stdout + run.stderr
    assert run.returncode != 0, "the run survived the loss of a rank"
    assert (tmp_path / "killed" / "epoch=0.ckpt" / "meta.pt").exists(), (
        f"the run died before its first checkpoint:\n{log[-3000:]}"
    )
    assert "tensor3d: a collective failed" in log and "ckpt_path" in log, log[-3000:]
    took = time.time() - float((tmp_path / "killed_at").read_text())
    assert took < 60, f"the survivors took {took:.0f}s to fail (timeout 60 s)"
