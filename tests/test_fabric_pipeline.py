"""Pipeline stages in real multi-process Fabric loops and mixed precision under stages (gloo, CPU).

One world of 4 (``fabric_scripts/pipeline.py``, its docstring names the runs): Fabric splits the
plain DenseGPT (its head tied to its embedding) into pp 2 × 2×1×1 stages and trains it in float64 as the dense twin; its
checkpoint resumes at pp 2 × 1×1×1 × dp 2 with ZeRO-1 and gradient accumulation, whose checkpoint
resumes without stages on 1×2×2, each training on as the uninterrupted dense twin; under
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

from lightning_3d import checkpoint as ckpt

# bf16-mixed, 3 AdamW steps: pp 2 against pp 1 (the same computations in another order; the tied weight's
# gradient two stages' sums added), and either against the float32 dense twin; updates: the relative L2
# distance of all parameters' change over the steps
BF16_LOSS, BF16_NORM, BF16_UPDATE = 1e-3, 4e-3, 0.05
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


def assert_parameters(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: parameters {sorted(set(got) ^ set(want))} in one only"
    err = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert err < TOL, f"{what} differ from the dense twin's by {err:.2e}"


@pytest.fixture(scope="module")
def dense() -> dict:
    """The dense twin's runs: float64 (3, 6 and 9 steps), float32 (3), and its initial state."""
    config = dict(n_layer=2)
    return {
        **{f"f64 {n}": common.dense_reference(n, **config, dtype=torch.float64) for n in (6, 9)},
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
    assert_parameters(parameters(runs, "FP", 2), want["state"], "FP's parameters after 3 steps")


def test_what_fabric_setup_returns_holds_the_stages(runs, dense):
    """FP: the model ``fabric.setup`` returns has the object passed in, now this rank's stage module of its
    own class, as its ``module``, and its ``state_dict()`` holds this rank's stage's shards (the parameters'
    own tensors) under the whole model's names: the stages' keys are apart and together the dense twin's."""
    recs = records(runs, "FP")
    keys = {r["stage"]: r["state_dict"] for r in recs}
    for r in recs:
        assert r["module"] == "DenseGPT", f"fabric_model.module is a {r['module']}"
        assert r["state_dict"] == r["held"] and r["state_dict_holds_the_shards"], r["state_dict"]
    assert not set(keys[0]) & set(keys[1]) and set(keys[0]) | set(keys[1]) == set(dense["f64"]["state"])


def test_a_checkpoint_of_stages_resumes_on_other_grids_with_zero1_and_accumulation(runs, dense):
    """``fabric.save`` of FP (pp 2 × 2×1×1) after 3 steps, loaded by FZ at pp 2 × 1×1×1 × dp 2 with ZeRO-1 (two
    batches a step, the first under ``no_backward_sync``), whose checkpoint after 3 more steps FR loads without
    stages on 1×2×2: steps 4-6 and 7-9 (losses, clipped gradient norms, every parameter after them) are the
    uninterrupted float64 dense twin's, so model, AdamW state, LR schedule and step counter came back."""
    assert ckpt.read_record(runs / "FP.ckpt")["pipeline_size"] == 2
    ckpt.verify(runs / "FZ.ckpt")
    for name, steps, grid, dp, stages in (("FZ", 6, [1, 1, 1], 2, 2), ("FR", 9, [1, 2, 2], 1, 1)):
        want = dense[f"f64 {steps}"]
        for r in records(runs, name):
            assert (r["first_step"], r["grid"], r["dp"]) == (steps - 3, grid, dp), r
            assert_close(r["loss"], want["loss"][-3:], f"{name} losses after resuming", LOSS_TOL)
            assert_close(r["grad_norm"], want["grad_norm"][-3:], f"{name} gradient norms after resuming", TOL)
        assert_parameters(
            parameters(runs, name, stages), want["state"], f"{name}'s parameters after {steps} steps"
        )


def test_zero1_and_no_backward_sync_under_stages(runs):
    """FZ: each stage's two dp replicas keep the AdamW state of disjoint halves of its parameters (ZeRO-1), and
    their gradients stay apart after the backward under ``no_backward_sync`` and agree after the synced one."""
    recs = records(runs, "FZ")
    for stage in (0, 1):
        first, second = (r for r in recs if r["stage"] == stage)
        assert first["with_state"] and second["with_state"], "a replica kept no optimizer state"
        assert not set(first["with_state"]) & set(second["with_state"])
        assert sorted(first["with_state"] + second["with_state"]) == first["held"]
    for r in recs:
        assert r["unsynced"] == [False] * 3 and r["synced"] == [True] * 3, r


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

    model = DenseGPT(common.config(n_layer=2), device="meta")
    with pytest.raises(ValueError, match=r"model_shape has layers=3, but DenseGPT has 2 \(transformer.h\)"):
        split_model(model, None, PipelineOptions(split_points=[1]), None, torch.device("cpu"), None, 3)
    plan = gpt_plan(common.config())
    with pytest.raises(
        ValueError, match="plan= and pipeline=PipelineOptions.plan=.... both give the stages' plan"
    ):
        Tensor3DFabricStrategy(pipeline_size=2, plan=plan, pipeline=PipelineOptions(plan=plan))
    assert Tensor3DFabricStrategy(pipeline_size=2, plan=plan).pipeline.plan is plan
