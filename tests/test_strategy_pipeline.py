"""Tensor3DStrategy(pipeline_size=...) in real multi-process ``Trainer.fit`` runs (gloo, CPU), judged against DenseGPT.

One world of 4 (``lightning_scripts/pipeline.py``, its docstring names the runs): pp 2 × 2×1×1 under
1F1B, and pp 2 × 1×1×1 × dp 2 with ZeRO-1 under Interleaved1F1B with two batches accumulated a
step, train as the dense twin (losses, clipped gradient norms), and ``validate`` runs through the
pipeline. The refusals of pipeline sizes that do not fit need no process.
"""

from __future__ import annotations

import json
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

from lightning_3d.models import DenseGPT
from lightning_3d.pipeline import PipelineOptions
from lightning_3d.strategy import grid_rules
from lightning_3d.strategy.failures import ConfigurationError
from lightning_3d.strategy.stages import into_stages


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    worlds.launch(SCRIPTS / "pipeline.py", 4, out, "world4", str(out))
    return out


def records(out: Path, name: str) -> list[dict]:
    recs = common.read_records(out, name)
    assert len(recs) == 4, f"run {name} wrote {len(recs)} records, expected 4"
    return recs


def test_two_stages_train_as_the_dense_twin(runs):
    """pp 2 × 2×1×1: every rank of both stages logs the dense twin's losses and clipped gradient norms."""
    dense = common.dense_reference(6, n_layer=2, tied=False)
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

    total = sum(p.numel() for p in DenseGPT(common.config(n_layer=2, tied=False)).parameters())
    log = (runs / "world4.log0").read_text()
    stated = [line.split(":")[-1].strip() for line in log.splitlines() if "Total params" in line]
    assert stated[:1] == [get_human_readable_count(total).strip()], (
        f"summary: {stated}, the model has {total}"
    )


def test_validate_runs_through_the_pipeline(runs):
    """``trainer.validate`` after fit: the dense twin's loss on the same batches, every shard kept."""
    dense = DenseGPT(common.config(n_layer=2, tied=False))
    dense.load_state_dict(common.dense_reference(6, n_layer=2, tied=False)["state"])
    with torch.no_grad():
        losses = [
            dense(t[:, :-1], t[:, 1:]).item() for _, t in DataLoader(common.Tokens(), common.GLOBAL_BATCH)
        ]
    for rank in range(4):
        got = json.loads((runs / f"validate.rank{rank}.json").read_text())
        assert got["kept_shards"], f"rank {rank}: validate changed its stage's parameters"
        assert_close([got["val_loss"]], [sum(losses) / len(losses)], f"rank {rank}: validation loss")


def test_zero1_over_dp_interleaved_and_accumulated_as_the_dense_twin(runs):
    """pp 2 × 1×1×1 × dp 2, ZeRO-1, two stages a rank (Interleaved1F1B), batches of 4 accumulated two a step: the
    dense twin's steps of 8 (each step's loss the mean of its two batches')."""
    dense = common.dense_reference(3, n_layer=4, tied=False)
    for r in records(runs, "Q"):
        assert r["global_step"] == 3 and r["dp"] == 2
        steps = [(a + b) / 2 for a, b in zip(r["loss"][::2], r["loss"][1::2])]
        assert_close(steps, dense["loss"], f"stage {r['stage']}, dp {r['coords'][0]}: losses")
        assert_close(
            r["grad_norm"], dense["grad_norm"], f"stage {r['stage']}, dp {r['coords'][0]}: gradient norms"
        )


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
