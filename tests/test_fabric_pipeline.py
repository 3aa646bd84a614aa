"""Pipeline stages in real multi-process Fabric loops and mixed precision under stages (gloo, CPU).

One world of 4 (``fabric_scripts/pipeline.py``, its docstring names the runs): Fabric splits the
plain untied DenseGPT into pp 2 × 2×1×1 stages and trains it in float64 as the dense twin; under
``bf16-mixed`` Fabric's and the Trainer's pp 2 runs train as Fabric's run without stages on the
same cube, and as the float32 dense twin within the tolerances below.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "lightning_scripts"))

import common
import worlds
from test_fabric import LOSS_TOL, SCRIPTS, TOL, assert_close

# bf16-mixed, 3 AdamW steps: pp 2 against pp 1 (the same computations in another order), and either against
# the float32 dense twin; updates: the relative L2 distance of all parameters' change over the steps
BF16_LOSS, BF16_NORM, BF16_UPDATE = 1e-3, 2e-3, 0.05
F32_LOSS, F32_NORM, F32_UPDATE = 5e-3, 5e-3, 0.1


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fabric_pipeline")
    worlds.launch(SCRIPTS / "pipeline.py", 4, out, "world4", str(out), timeout=300)
    return out


def records(out: Path, name: str) -> list[dict]:
    recs = common.read_records(out, name)
    assert len(recs) == 4, f"run {name} wrote {len(recs)} records, expected 4"
    return recs


def parameters(out: Path, name: str, stages: int) -> dict[str, torch.Tensor]:
    """The whole model's dense parameters after run ``name``'s steps, from its stages' files."""
    state = {}
    for stage in range(stages):
        state.update(torch.load(out / f"{name}.stage{stage}.pt"))
    return state


def update_distance(got: dict, want: dict, start: dict) -> float:
    """``‖got − want‖ / ‖want − start‖`` over every parameter: how far apart two runs' updates are."""
    assert set(got) == set(want), f"parameters {sorted(set(got) ^ set(want))} in one run only"
    diff = sum(float((got[k].double() - want[k].double()).square().sum()) for k in want)
    moved = sum(float((want[k].double() - start[k].double()).square().sum()) for k in want)
    return (diff / moved) ** 0.5


@pytest.fixture(scope="module")
def dense() -> dict:
    """The dense twin's runs: float64, float32, and its initial state."""
    config = dict(n_layer=2, tied=False)
    return {
        "f64": common.dense_reference(3, **config, dtype=torch.float64),
        "f32": common.dense_reference(3, **config),
        "init": common.dense_reference(0, **config)["state"],
    }


def test_fabric_splits_the_model_into_stages_and_trains_as_the_dense_twin(runs, dense):
    """FP: ``fabric.setup(model, optimizer)`` of the model built on meta at pp 2 × 2×1×1: each rank holds and
    optimizes its stage's parameters only; three AdamW steps give the float64 dense twin's losses, clipped
    gradient norms and every parameter."""
    want = dense["f64"]
    recs = records(runs, "FP")
    assert sorted(r["stage"] for r in recs) == [0, 0, 1, 1]
    held = {r["stage"]: r["held"] for r in recs}
    assert all(
        r["meta_built"] and r["dtype"] == "torch.float64" and r["optimized"] == r["held"] for r in recs
    )
    assert not set(held[0]) & set(held[1]) and any("lm_head" in n for n in held[1])
    for r in recs:
        assert_close(r["loss"], want["loss"], f"FP stage {r['stage']} losses", LOSS_TOL)
        assert_close(r["grad_norm"], want["grad_norm"], f"FP stage {r['stage']} gradient norms", TOL)
    assert max(want["grad_norm"]) > common.CLIP, "clipping never acted: this test could not fail on it"
    got = parameters(runs, "FP", 2)
    assert set(got) == set(want["state"])
    err = max(float((got[k] - want["state"][k]).abs().max()) for k in want["state"])
    assert err < TOL, f"FP's parameters after 3 steps differ from the dense twin's by {err:.2e}"


def test_bf16_mixed_under_stages_trains_as_without_them(runs, dense):
    """FB (Fabric) and TB (Trainer), bf16-mixed at pp 2 × 2×1×1, against FA (Fabric, bf16-mixed, 2×1×1 × dp 2)
    within bf16's tolerances, and against the float32 dense twin within wider ones: losses, clipped gradient
    norms, parameters after 3 steps. TB computes what FB does."""
    fa, want = records(runs, "FA")[0], dense["f32"]
    fa_state = parameters(runs, "FA", 1)
    assert fa["dp"] == 2 and fa["dtype"] == "torch.float32"
    for name in ("FB", "TB"):
        recs = records(runs, name)
        state = parameters(runs, name, 2)
        for r in recs:
            assert_close(r["loss"], fa["loss"], f"{name} stage {r['stage']} losses against FA", BF16_LOSS)
            assert_close(r["grad_norm"], fa["grad_norm"], f"{name} gradient norms against FA", BF16_NORM)
            assert_close(r["loss"], want["loss"], f"{name} losses against float32", F32_LOSS)
            assert_close(
                r["grad_norm"], want["grad_norm"], f"{name} gradient norms against float32", F32_NORM
            )
        assert r["loss"] != want["loss"], f"{name} gave float32's exact losses: autocast was off"
        apart = update_distance(state, fa_state, dense["init"])
        assert apart < BF16_UPDATE, f"{name}'s updates {apart:.3f} from FA's"
        apart = update_distance(state, want["state"], dense["init"])
        assert apart < F32_UPDATE, f"{name}'s updates {apart:.3f} from float32's"
    tb, fb = parameters(runs, "TB", 2), parameters(runs, "FB", 2)
    assert all(torch.equal(tb[k], fb[k]) for k in fb), (
        "the Trainer's bf16-mixed stages trained apart from Fabric's"
    )


# ----- refusals, without processes -----


def test_a_split_priced_for_another_model_and_two_plans_are_refused():
    from lightning_3d import Tensor3DFabricStrategy
    from lightning_3d.models import DenseGPT, gpt_plan
    from lightning_3d.pipeline import PipelineOptions
    from lightning_3d.strategy.stages import split_model

    model = DenseGPT(common.config(n_layer=2, tied=False), device="meta")
    with pytest.raises(ValueError, match=r"model_shape has layers=3, but DenseGPT has 2 \(transformer.h\)"):
        split_model(model, None, PipelineOptions(split_points=[1]), None, torch.device("cpu"), None, 3)
    plan = gpt_plan(common.config())
    with pytest.raises(
        ValueError, match="plan= and pipeline=PipelineOptions.plan=.... both give the stages' plan"
    ):
        Tensor3DFabricStrategy(pipeline_size=2, plan=plan, pipeline=PipelineOptions(plan=plan))
    assert Tensor3DFabricStrategy(pipeline_size=2, plan=plan).pipeline.plan is plan
