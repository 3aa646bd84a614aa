"""Tensor3DStrategy(pipeline_size=...) in real multi-process ``Trainer.fit`` runs (gloo, CPU), judged against DenseGPT.

One world of 4, each rank a process started here (``lightning_scripts/pipeline.py``, whose docstring
names the runs), DenseGPT with its head tied to its embedding (the first and the last stage each
hold the weight): pp 2 × 2×1×1 under 1F1B, and pp 2 × 1×1×1 × dp 2 with ZeRO-1 under Interleaved1F1B
with two batches accumulated a step, train as the dense twin (losses, clipped gradient norms), and
``validate`` runs through the pipeline. Checkpoints of stages: the latter's resumes at pp 4 ×
1×1×1; SIGTERM to a rank of stage 1 stops every rank at the same step with a checkpoint, which
resumes without stages on 1×2×1 × dp 2 with ZeRO-1; both train on as the uninterrupted dense twin
(float64), and ``to-dense`` of the preempted one is the dense twin's state dict. A rank of stage 1
killed inside the schedule makes every other rank fail fast with tensor3d's message. The refusals
of pipeline sizes that do not fit need no process.
"""

from __future__ import annotations

import json
import signal
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent / "lightning_scripts"))

import common
import worlds
from test_strategy import SCRIPTS, assert_close

from lightning_3d import checkpoint as ckpt
from lightning_3d.models import DenseGPT, dense_gpt
from lightning_3d.pipeline import PipelineOptions
from lightning_3d.strategy import grid_rules
from lightning_3d.strategy.failures import ConfigurationError
from lightning_3d.strategy.stages import into_stages

F64 = torch.float64
TOL64 = 1e-10
WORLD_TIMEOUT_S = 300


def tails(out: Path) -> str:
    return "\n".join(f"--- rank {r} ---\n{worlds.tail(out / f'world4.log{r}')}" for r in range(4))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The world's folder; its ranks' exit statuses in ``statuses.json`` (a hang fails every test)."""
    out = tmp_path_factory.mktemp("pipeline")
    procs, _ = worlds.start(SCRIPTS / "pipeline.py", 4, out, ("world4", str(out)))
    hung = worlds.wait(procs, WORLD_TIMEOUT_S)
    assert not hung, f"pipeline.py: ranks {hung} hung past {WORLD_TIMEOUT_S} s\n{tails(out)}"
    (out / "statuses.json").write_text(json.dumps([p.returncode for p in procs]))
    return out


def records(out: Path, name: str) -> list[dict]:
    recs = common.read_records(out, name)
    assert len(recs) == 4, f"run {name} wrote {len(recs)} records, expected 4\n{tails(out)}"
    return recs


def test_two_stages_train_as_the_dense_twin(runs):
    """pp 2 × 2×1×1: every rank of both stages logs the dense twin's losses and clipped gradient norms."""
    dense = common.dense_reference(6, n_layer=2)
    recs = records(runs, "P")
    assert sorted(r["stage"] for r in recs) == [0, 0, 1, 1]
    for r in recs:
        assert r["global_step"] == 6
        assert_close(r["loss"], dense["loss"], f"pp 2 × 2×1×1 losses, stage {r['stage']}")
        assert_close(r["grad_norm"], dense["grad_norm"], f"pp 2 × 2×1×1 gradient norms, stage {r['stage']}")
    assert max(dense["grad_norm"]) > common.CLIP, "clipping never acted: this test could not fail on it"


def test_model_summary_counts_every_stage(runs):
    """Rank 0 holds stage 0 only; Lightning's table states the whole model's size."""
    from lightning.pytorch.utilities.model_summary import get_human_readable_count

    total = sum(p.numel() for p in DenseGPT(common.config(n_layer=2)).parameters())
    log = (runs / "world4.log0").read_text()
    stated = [line.split(":")[-1].strip() for line in log.splitlines() if "Total params" in line]
    assert stated[:1] == [get_human_readable_count(total).strip()], (
        f"summary: {stated}, the model has {total}"
    )


def test_validate_runs_through_the_pipeline(runs):
    """``trainer.validate`` after fit: the dense twin's loss on the same batches, every shard kept."""
    dense = DenseGPT(common.config(n_layer=2))
    dense.load_state_dict(common.dense_reference(6, n_layer=2)["state"])
    with torch.no_grad():
        losses = [
            dense(t[:, :-1], t[:, 1:]).item() for _, t in DataLoader(common.Tokens(), common.GLOBAL_BATCH)
        ]
    for rank in range(4):
        got = json.loads((runs / f"validate.rank{rank}.json").read_text())
        assert got["kept_shards"], f"rank {rank}: validate changed its stage's parameters"
        assert_close([got["val_loss"]], [sum(losses) / len(losses)], f"rank {rank}: validation loss")


def assert_accumulated_steps(r: dict, dense: dict, what: str) -> None:
    """Run ``r``'s batches, accumulated two a step, against the dense twin's steps of both (each step's loss the
    mean of its two batches')."""
    steps = [(a + b) / 2 for a, b in zip(r["loss"][::2], r["loss"][1::2])]
    where = f"{what}, stage {r['stage']}, dp {r['coords'][0]}"
    assert_close(steps, dense["loss"], f"{where}: losses", TOL64)
    assert_close(r["grad_norm"], dense["grad_norm"], f"{where}: gradient norms", TOL64)


def test_zero1_over_dp_interleaved_and_accumulated_as_the_dense_twin(runs):
    """pp 2 × 1×1×1 × dp 2, ZeRO-1, two stages a rank (Interleaved1F1B), batches of 4 accumulated two a step: the
    dense twin's steps of 8, in float64."""
    dense = common.dense_reference(3, n_layer=4, dtype=F64)
    for r in records(runs, "Q"):
        assert r["global_step"] == 3 and r["dp"] == 2
        assert_accumulated_steps(r, dense, "pp 2 × dp 2 ZeRO-1")


# ----- checkpoints of stages, preemption and a killed rank -----


def test_sigterm_on_a_stage_stops_every_rank_with_a_checkpoint_of_the_stages(runs):
    """Run T: SIGTERM to rank 3 (stage 1) before step 3: every rank of both stages stops at global step 3, saves
    and raises ``Preempted`` (exit status 143) within 30 s; the checkpoint records the whole model (every stage's
    true shapes, the dense root)."""
    out = runs
    log = "".join((out / f"world4.log{r}").read_text() for r in range(4))
    stopped = [json.loads(f.read_text()) for f in sorted(out.glob("T.stopped*"))]
    assert [s["status"] for s in stopped] == [128 + signal.SIGTERM] * 4, f"{stopped}\n{tails(out)}"
    saved = out / "preempted.ckpt"
    assert (
        f"tensor3d: rank 3 received SIGTERM; every rank stopped at global step 3 and saved a checkpoint to {saved}"
        in log
    ), log[-3000:]
    signalled = float((out / "signalled_at").read_text())
    took = [round(s["at"] - signalled, 1) for s in stopped]
    assert max(took) < 30, f"ranks stopped {took} s after the signal"
    record = ckpt.read_record(saved)
    assert (record["pipeline_size"], record["grid"], record["world_size"]) == (2, [2, 1, 1], 4)
    assert {"model.transformer.wte.weight", "model.lm_head.weight"} <= record["dense_shapes"].keys(), (
        f"the record lacks a stage's padded shapes: {sorted(record['dense_shapes'])}"
    )
    assert (record["dense_root"]["prefix"], record["dense_root"]["model"]) == ("model.", "DenseGPT")


def test_to_dense_of_a_checkpoint_of_stages_is_the_dense_twin(runs, tmp_path):
    """``to-dense`` of the stages saved at step 3 rebuilds DenseGPT (config from the file) equal to the dense twin
    after 3 steps, every tensor of both stages."""
    out = tmp_path / "dense.safetensors"
    ckpt.main(["to-dense", str(runs / "preempted.ckpt"), str(out)])
    model = dense_gpt(out, dtype=F64)
    want = common.dense_reference(3, n_layer=2, dtype=F64)["state"]
    got = model.state_dict()
    assert got.keys() == want.keys()
    err = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert err < 1e-12, f"to-dense of the stages differs from DenseGPT trained 3 steps by {err:.2e}"


def test_a_checkpoint_of_two_stages_resumes_without_stages_on_another_grid(runs):
    """The preempted pp 2 × 2×1×1 checkpoint resumed on pp 1 × 1×2×1 × dp 2 with ZeRO-1 (model and AdamW state
    resharded, every stage's tensors read by every rank): steps 4-6 are the uninterrupted dense twin's."""
    dense = common.dense_reference(6, n_layer=2, dtype=F64)
    for r in records(runs, "S"):
        assert (r["global_step"], r["stage"], r["grid"], r["dp"]) == (6, 0, [1, 2, 1], 2)
        assert_close(r["loss"], dense["loss"][3:], f"rank {r['coords']}: losses after resuming", TOL64)
        assert_close(r["grad_norm"], dense["grad_norm"][3:], f"rank {r['coords']}: gradient norms", TOL64)


def test_a_checkpoint_of_two_stages_resumes_on_four(runs):
    """Q's checkpoint (pp 2 × dp 2, ZeRO-1, two stages a rank) resumed at pp 4 × 1×1×1 (each rank reads one
    stage's model and AdamW state): its second epoch is the uninterrupted dense twin's steps 4-6."""
    dense = common.dense_reference(6, n_layer=4, dtype=F64)
    dense = {k: dense[k][3:] for k in ("loss", "grad_norm")}
    recs = records(runs, "R")
    assert sorted(r["stage"] for r in recs) == [0, 1, 2, 3]
    for r in recs:
        assert r["global_step"] == 6
        assert_accumulated_steps(r, dense, "resumed at pp 4")


def test_a_killed_rank_of_a_stage_fails_every_other_rank_fast(runs):
    """Run K: rank 2 (stage 1) SIGKILLed inside the schedule of step 2: ranks 0 and 1 (stage 0, waiting for its
    gradients) and rank 3 (its cube peer) each exit within the 60 s timeout with tensor3d's one line, which a
    pipeline stage's own error wrapping the failed collective does not hide."""
    ended = json.loads((runs / "statuses.json").read_text())
    assert ended[2] == -signal.SIGKILL, f"rank 2 did not die as planned: {ended}\n{tails(runs)}"
    killed = float((runs / "killed_at").read_text())
    for rank in (0, 1, 3):
        log = (runs / f"world4.log{rank}").read_text()
        assert ended[rank] == 1, f"rank {rank} exited with {ended[rank]}:\n{log[-3000:]}"
        said = f"tensor3d: a collective failed on rank {rank} of 4 (grid 2×1×1, pipeline stage"
        assert said in log, log[-3000:]
        took = float((runs / f"K.exit{rank}").read_text()) - killed
        assert took < 60, f"rank {rank} took {took:.0f} s to fail (timeout 60 s)"


# ----- refusals, without processes -----


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pipeline_size": 3}, "pipeline_size=3 does not divide the world size 4"),
        (
            {"pipeline_size": 2, "grid": (2, 2, 1)},
            "the stage size 2 (world size 4 / pipeline_size 2) is not divisible by px·py·pz = 4",
        ),
        (
            {"pipeline_size": 2, "grid": (2, 1, 1), "data_parallel_size": 2},
            "world size 4 != pipeline_size·data_parallel_size·px·py·pz = 2·2·2 = 8",
        ),
    ],
)
def test_a_pipeline_size_that_does_not_fit_is_refused_in_the_launching_process(kwargs, message):
    import lightning.pytorch as pl

    from lightning_3d import Tensor3DStrategy

    with pytest.raises(ConfigurationError) as error:
        pl.Trainer(accelerator="cpu", devices=4, strategy=Tensor3DStrategy(**kwargs), logger=False)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pipeline_size": 0}, "pipeline_size must be a positive int, got 0"),
        ({"pipeline_size": 2.0}, "pipeline_size must be a positive int, got 2.0"),
        ({"pipeline": PipelineOptions()}, "needs pipeline stages: pass pipeline_size=2 (or more)"),
        ({"pipeline_size": 2, "pipeline": {"schedule": "GPipe"}}, "pipeline must be a lightning_3d.pipeline"),
    ],
)
def test_pipeline_arguments_are_checked(kwargs, message):
    from lightning_3d import Tensor3DFabricStrategy, Tensor3DStrategy

    with pytest.raises(ValueError) as error:
        Tensor3DStrategy(**kwargs)
    assert message in str(error.value)
    if "pipeline" not in kwargs:
        with pytest.raises(ValueError, match="pipeline_size must be a positive int"):
            Tensor3DFabricStrategy(**kwargs)


def test_pipeline_options_are_checked():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'Zigzag'"):
        PipelineOptions(schedule="Zigzag")
    with pytest.raises(ValueError, match="n_microbatches must be a positive int"):
        PipelineOptions(n_microbatches=0)
    with pytest.raises(ValueError, match="runs 1 stage.s. per rank, not 2"):
        PipelineOptions(schedule="GPipe", stages_per_rank=2)
    assert PipelineOptions(schedule="gpipe", split_points=[1]).schedule == "GPipe"


def test_grid_rules_with_stages():
    assert grid_rules.resolve("auto", "auto", 8, 8, pipeline_size=2) == ((2, 2, 1), 1)
    assert grid_rules.resolve((2, 1, 1), "auto", 8, 8, pipeline_size=2) == ((2, 1, 1), 2)
    assert grid_rules.resolve("auto", 2, 16, 8, pipeline_size=2) == ((2, 2, 1), 2)
    with pytest.raises(ValueError, match=r"data_parallel_size=3 does not divide the stage size 4"):
        grid_rules.resolve("auto", 3, 8, 8, pipeline_size=2)
    from lightning_3d.cost import ModelShape

    with pytest.raises(ValueError, match="pricing 2 pipeline stages needs the whole model"):
        grid_rules.resolve("auto", "auto", 8, 8, ModelShape(64, 4, 8, 8, 2), pipeline_size=2)


class _TwoModels(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model, self.head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)


def test_what_the_strategy_cannot_split_is_refused():
    grid = types.SimpleNamespace(pipeline_size=2)
    with pytest.raises(ValueError) as error:
        into_stages(_TwoModels(), grid, lambda model: model)
    assert "must build it in one attribute (self.model = DenseGPT(config)); " in str(error.value)
