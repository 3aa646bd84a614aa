"""DeepSpeed's pipeline engine over the grid's stages (``deepspeed_3d.initialize`` with ``"pipeline_size": 2``)
against the dense model, in one gloo world of 4 processes: DeepSpeed imports slowly and CPU is scarce, so one
job checks everything.

- pp 2 × 2×1×1, ZeRO-1: a DenseGPT whose head is tied to its embedding (the first and the last stage
  each hold the weight, their gradients summed), built on ``meta`` (each rank materialises its own
  stage, drawing the whole model's initial values), micro-batches of one sequence (token rows), four accumulated a step:
  three AdamW steps of ``engine.train_batch()`` with clipping active give the dense model's losses,
  gradient norms and every parameter, under the whole model's names; ``eval_batch`` its loss;
  ``save_checkpoint``, a step, ``load_checkpoint`` and the same step again give the same weights bit for
  bit; ``to_dense`` of the checkpoint is the dense model's state dict.
- pp 2 × 1×1×1 × dp 2, ZeRO-1: a materialised DenseGPT of three layers split after layer 0
  (``"split_points": [1]``), its blocks recomputed (``"options": {"activation_checkpointing": true}``),
  each replica on its own micro-batches.
- Hugging Face Llama (GQA, untied) on pp 2 × 2×1×1: as the unmodified model trains.
- bf16 under ZeRO-1 on pp 2 × 2×1×1: the float32 dense model's losses and gradient norms, to bf16 accuracy.
- What ``initialize`` refuses with stages (ZeRO-2/3, DeepSpeed's partitioned activations, ...), each
  message naming its numbers and fix; the Lightning DeepSpeed strategy refuses stages.

Precision: the models are float64, but ZeRO-1 keeps float32 master weights and DeepSpeed reports losses
in float32, so everything agrees to about 1e-7 (``TOL``); a lost gradient, a wrong reduction or a
wrong clip is off by percents. (Without ZeRO, DeepSpeed cannot reduce float64 gradients on its CPU
accelerator, which lists float32 and bf16 alone.) Each micro-batch's mean loss counts equally, as in
DeepSpeed's gradient accumulation: the dense reference averages the micro-batches' means.
"""

from __future__ import annotations

import os

import harness
import pytest
import torch
from checks import rel
from test_deepspeed import _local_rank_env
from test_hf_parallelize import V as HF_V
from test_hf_parallelize import float64_reference, llama, perturbed, shifted_loss

F64 = torch.float64
V, S, STEPS, CLIP, LR, WEIGHT_DECAY = 50, 8, 3, 0.05, 1e-2, 0.1
TOL = 1e-5


def ds_config(shape, micro: int, accumulation: int, dp: int = 1, **extra) -> dict:
    return {
        "train_batch_size": micro * accumulation * dp,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 1},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True},
        },
        "steps_per_print": 1000,
        **extra,
        "tensor3d": {"grid": list(shape), "pipeline_size": 2, **extra.get("tensor3d", {})},
    }


def gpt_config(n_layer: int, tied: bool = False):
    from lightning_3d.models import GPTConfig

    return GPTConfig(vocab_size=V, block_size=12, n_layer=n_layer, n_head=4, n_embd=16, tie_embeddings=tied)


def data(dp: int, accumulation: int, micro: int, vocab: int, seed: int, shifted: bool = False) -> list:
    """Per step, every replica's micro-batches: ids and targets ``[dp, accumulation, micro, S]``, fresh,
    some targets ignored (labels to shift where ``shifted``: the ids themselves)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS + 1):
        ids = torch.randint(0, vocab, (dp, accumulation, micro, S), generator=g)
        targets = ids.clone() if shifted else torch.randint(0, vocab, ids.shape, generator=g)
        targets[0, 0, 0, 2] = targets[-1, -1, -1, 5] = -100
        out.append((ids, targets))
    return out


def dense_steps(loss_of, params, batches) -> tuple[list[float], list[float]]:
    """AdamW steps of the dense model, each on the mean of its micro-batches' mean losses, clipped."""
    params = list(params)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for ids, targets in batches:
        opt.zero_grad()
        loss = torch.stack([loss_of(i, t) for i, t in zip(ids.flatten(0, 1), targets.flatten(0, 1))]).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        losses.append(float(loss))
    return losses, norms


def dense_eval(loss_of, ids, targets) -> float:
    with torch.no_grad():
        return float(
            torch.stack([loss_of(i, t) for i, t in zip(ids.flatten(0, 1), targets.flatten(0, 1))]).mean()
        )


def micro_batches(grid, ids, targets):
    """This replica's micro-batches, as DeepSpeed's pipeline engine takes them."""
    d = grid.coord("dp")
    return iter(list(zip(ids[d], targets[d])))


def engine_steps(engine, grid, batches) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for ids, targets in batches:
        losses.append(float(engine.train_batch(micro_batches(grid, ids, targets))))
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def compare(name: str, engine, grid, dense, loss_of, batches) -> dict:
    """Three steps of ``engine`` against ``dense``: losses, gradient norms, every parameter after them."""
    from lightning_3d.parallel import dense_state_dict

    want, want_norms = dense_steps(loss_of, dense.parameters(), batches[:STEPS])
    got, norms = engine_steps(engine, grid, batches[:STEPS])
    state = dense.state_dict()
    mine = dense_state_dict(engine.module)
    errs = {f"{name}_loss{k}": abs(a - b) / b for k, (a, b) in enumerate(zip(got, want))}
    errs.update({f"{name}_norm{k}": abs(a - b) / b for k, (a, b) in enumerate(zip(norms, want_norms))})
    errs.update({f"{name}_{k}": rel(t, state[k]) for k, t in mine.items()})
    errs[f"{name}_unclipped"] = float(min(want_norms) <= CLIP)  # the test must clip at every step
    return {"errors": errs, "keys": sorted(mine), "whole": sorted(state)}


def gpt_on_meta(ckpt: str) -> dict:
    """pp 2 × 2×1×1: DenseGPT on meta, token rows; steps, eval, checkpoint round trip, dense export."""
    import deepspeed_3d
    from lightning_3d import destroy_grid, init_grid
    from lightning_3d.models import DenseGPT

    grid = init_grid((2, 1, 1), pipeline_size=2)
    torch.manual_seed(4)
    dense = DenseGPT(gpt_config(2, tied=True), dtype=F64)
    torch.manual_seed(4)  # the stages draw the whole model's initial values from the same seed
    engine, *_ = deepspeed_3d.initialize(
        model=DenseGPT(gpt_config(2, tied=True), device="meta", dtype=F64), config=ds_config((2, 1, 1), 1, 4)
    )
    batches = data(1, 4, 1, V, 7)
    out = compare("gpt", engine, grid, dense, dense, batches)
    errs = out["errors"]
    ids, targets = batches[STEPS]
    errs["eval"] = abs(
        float(engine.eval_batch(micro_batches(grid, ids, targets))) / dense_eval(dense, ids, targets) - 1
    )
    deepspeed_3d.save_checkpoint(engine, ckpt)
    engine.train_batch(micro_batches(grid, ids, targets))
    after = {k: v.clone() for k, v in engine.module.state_dict().items()}
    deepspeed_3d.load_checkpoint(engine, ckpt)
    engine.train_batch(micro_batches(grid, ids, targets))
    errs["resumed_step_differs"] = float(
        any(not torch.equal(v, after[k]) for k, v in engine.module.state_dict().items())
    )
    if grid.stage == 0 and grid.rank_in("cube") == 0:
        exported = deepspeed_3d.to_dense(ckpt)
        state = dense.state_dict()
        errs["export_keys_differ"] = float(sorted(exported) != sorted(state))
        errs.update({f"export_{k}": rel(exported[k], state[k]) for k in state})
    destroy_grid(grid)
    return out


def gpt_dp2() -> dict:
    """pp 2 × 1×1×1 × dp 2: a materialised DenseGPT of three layers split after layer 0, blocks recomputed."""
    import copy

    import deepspeed_3d
    from lightning_3d import destroy_grid, init_grid
    from lightning_3d.models import DenseGPT
    from lightning_3d.parallel import options_of

    grid = init_grid((1, 1, 1), 2, pipeline_size=2)
    torch.manual_seed(5)
    dense = perturbed(lambda: DenseGPT(gpt_config(3)), 5)
    config = ds_config(
        (1, 1, 1),
        2,
        2,
        dp=2,
        pipeline={"split_points": [1]},
        tensor3d={"options": {"activation_checkpointing": True}},
    )
    engine, *_ = deepspeed_3d.initialize(model=copy.deepcopy(dense), config=config)
    out = compare("dp2", engine, grid, dense, dense, data(2, 2, 2, V, 8))
    out["errors"]["dp2_not_recomputed"] = float(
        not options_of(engine.module.stage.module).activation_checkpointing
    )
    out["layers"] = sorted({k.split(".")[2] for k in out["keys"] if k.startswith("transformer.h.")})
    destroy_grid(grid)
    return out


def hf_llama() -> dict:
    """Llama (GQA, untied) on pp 2 × 2×1×1, whole sequences: as the unmodified model trains."""
    import deepspeed_3d
    from lightning_3d import destroy_grid, init_grid

    grid = init_grid((2, 1, 1), pipeline_size=2)
    model = perturbed(lambda: llama(False), 6)
    ref = float64_reference(model)  # Llama's RMSNorms in float64, as the 3-D norms compute
    engine, *_ = deepspeed_3d.initialize(model=model, config=ds_config((2, 1, 1), 2, 2))  # consumes model

    def loss_of(ids, labels):
        return shifted_loss(ref(input_ids=ids, use_cache=False).logits, labels)

    out = compare("llama", engine, grid, ref, loss_of, data(1, 2, 2, HF_V, 9, shifted=True))
    destroy_grid(grid)
    return out


def gpt_bf16() -> dict:
    """bf16 under ZeRO-1 on pp 2 × 2×1×1: losses and gradient norms follow the float32 dense model to bf16
    accuracy (a norm missing a stage or a cube rank's shards would be off by tens of percent)."""
    import deepspeed_3d
    from lightning_3d import destroy_grid, init_grid
    from lightning_3d.models import DenseGPT

    grid = init_grid((2, 1, 1), pipeline_size=2)
    torch.manual_seed(4)
    dense = DenseGPT(gpt_config(2))
    torch.manual_seed(4)
    config = {**ds_config((2, 1, 1), 2, 2), "bf16": {"enabled": True}}
    engine, *_ = deepspeed_3d.initialize(model=DenseGPT(gpt_config(2), device="meta"), config=config)
    batches = data(1, 2, 2, V, 7)[:STEPS]
    want, want_norms = dense_steps(dense, dense.parameters(), batches)
    got, norms = engine_steps(engine, grid, batches)
    destroy_grid(grid)
    return {
        "loss": max(abs(a - b) / b for a, b in zip(got, want)),
        "norm": max(abs(a - b) / b for a, b in zip(norms, want_norms)),
    }


def refusals() -> dict:
    """What initialize refuses with pipeline stages: each message (None where nothing was raised)."""
    import deepspeed_3d
    import lightning_3d
    from lightning_3d import Linear3D, destroy_grid, init_grid
    from lightning_3d.models import DenseGPT

    grid = init_grid((2, 1, 1), pipeline_size=2)
    base = ds_config((2, 1, 1), 1, 4)
    section = base["tensor3d"]
    bad = {
        "zero2": {**base, "zero_optimization": {"stage": 2}},
        "zero3": {**base, "zero_optimization": {"stage": 3}},
        "other_pp": {**base, "tensor3d": {**section, "pipeline_size": 1}},
        "pp_type": {**base, "tensor3d": {**section, "pipeline_size": "2"}},
        "stages": {**base, "pipeline": {"stages": 4}},
        "partitioned": {**base, "pipeline": {"pipe_partitioned": True}},
        "partition": {**base, "pipeline": {"partition": "parameters"}},
        "interval": {**base, "pipeline": {"activation_checkpoint_interval": 1}},
        "split_points": {**base, "pipeline": {"split_points": [2]}},
    }
    meta = lambda: DenseGPT(gpt_config(2), device="meta", dtype=F64)  # noqa: E731
    calls = {
        what: lambda config=config: deepspeed_3d.initialize(model=meta(), config=config)
        for what, config in bad.items()
    }
    calls["model_parameters"] = lambda: deepspeed_3d.initialize(
        model=meta(), config=base, model_parameters=[torch.nn.Parameter(torch.ones(1))]
    )
    calls["parallelized"] = lambda: deepspeed_3d.initialize(model=Linear3D(16, 16, grid=grid), config=base)
    out = {}
    for what, call in calls.items():
        try:
            call()
            out[what] = None
        except ValueError as e:
            out[what] = str(e)
    destroy_grid(grid)
    lightning_3d.set_grid(None)
    return out


def pipeline_job(ckpt: str) -> dict:
    _local_rank_env()
    import lightning_3d

    lightning_3d.set_grid(None)  # each part builds its own grid of stages
    return {
        "gpt": gpt_on_meta(ckpt),
        "dp2": gpt_dp2(),
        "llama": hf_llama(),
        "bf16": gpt_bf16(),
        "refused": refusals(),
    }


def test_pipeline_engine_trains_as_the_dense_model(tmp_path):
    import lightning.pytorch as pl

    from deepspeed_3d.strategy.lightning import Tensor3DDeepSpeedStrategy
    from lightning_3d.strategy.failures import ConfigurationError

    results = harness.run(4, pipeline_job, os.fspath(tmp_path / "ckpt"))
    bad = [
        (rank, k, e)
        for rank, r in enumerate(results)
        for run in ("gpt", "dp2", "llama")
        for k, e in r[run]["errors"].items()
        if not e < TOL
    ]
    assert not bad, f"differences from the dense model above {TOL}: {bad[:10]}"
    for run in (
        "gpt",
        "dp2",
        "llama",
    ):  # each rank holds its stage under the whole model's names, all of them
        held = [set(r[run]["keys"]) for r in results]
        assert set().union(*held) == set(results[0][run]["whole"]), f"{run}: not every parameter is held"
        assert not held[0] & held[-1], f"{run}: the two stages hold a parameter in common"
    assert [r["dp2"]["layers"] for r in results] == [["0"], ["0"], ["1", "2"], ["1", "2"]]
    assert "export_keys_differ" in results[0]["gpt"]["errors"], "rank 0 did not convert the checkpoint"
    for rank, r in enumerate(results):
        assert r["bf16"]["loss"] < 2e-2 and r["bf16"]["norm"] < 2e-2, f"rank {rank}, bf16: {r['bf16']}"

    needles = {
        "zero2": ["ZeRO-2 and ZeRO-3 do not run with pipeline stages", '"stage": 1'],
        "zero3": ['"zero_optimization": {"stage": 3} on a grid of 2 pipeline stages'],
        "other_pp": ['"pipeline_size": 1} but the current grid is 2×1×1 in 2 stage(s)'],
        "pp_type": ["pipeline_size must be a positive int, got '2' (a str)"],
        "stages": ['"pipeline": {"stages": 4} but "tensor3d": {"pipeline_size": 2}', '"stages": 2 or "auto"'],
        "partitioned": ['"pipe_partitioned": True}', "its own block", "set it to False"],
        "partition": ["\"partition\": 'parameters'}", '"split_points"'],
        "interval": ['"activation_checkpoint_interval": 1}', '"activation_checkpointing": true'],
        "split_points": ["split_points [2] must be 1 increasing layer indices in 1..1"],
        "model_parameters": ["leave out model_parameters=", "optimizer=lambda params"],
        "parallelized": ["already holds 3-D layers: split the plain model"],
    }
    for rank, r in enumerate(results):
        for what, parts in needles.items():
            message = r["refused"][what]
            assert message is not None and all(p in message for p in parts), f"rank {rank}, {what}: {message}"
    strategy = Tensor3DDeepSpeedStrategy(
        config={**ds_config((2, 1, 1), 1, 4), "tensor3d": {"grid": [2, 1, 1], "pipeline_size": 2}}
    )
    with pytest.raises(
        ConfigurationError, match=r"runs no pipeline schedule; use Tensor3DStrategy\(pipeline_size=2"
    ):
        pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
