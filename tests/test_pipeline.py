"""Pipeline stages (``lightning_3d.pipeline``) train as the dense model does (float64, real gloo groups).

On each layout (pp 2 × 2×1×1, pp 2 × 1×1×1 × dp 2, pp 4 × 1×1×1 in a world of 4; pp 2 × 2×2×1 in a
world of 8) and each schedule (GPipe and 1F1B everywhere; Interleaved1F1B, InterleavedZeroBubble,
ZBVZeroBubble and DualPipeV on one layout each, the zero-bubble ones where weights are gathered over
x, so that every backward defers the gathered weights' gradients and every W action adds them): a DenseGPT
built on ``meta`` is split into stages, given the dense model's weights, and takes three AdamW steps
on four micro-batches of one sequence each (token rows on the cubes of several ranks, whole sequences
on one rank); the loss of every step and every parameter after them equal DenseGPT's on one
process (each dp replica on its own batch).
Tied embeddings (the head's weight the token embedding's) train as the dense model's on the last
layouts, where the first and the last stage hold the weight on two ranks of a pp-4 pipe, on ranks of
2×2×1 cubes, and on one rank (ZBVZeroBubble). Each stage holds its parameters under the whole
model's names, and a stage built on ``meta`` draws the same initial values as the whole model (the
last stage's tied head the first stage's embedding). Hugging Face's Llama (GQA, untied) and GPT-2
(tied), split into two stages of 2×1×1, train as the unmodified models do. A ``PipelinedModel``'s schedule runs its
backward from the loss times an fp16 scaler's scale. The refusals name their numbers and fixes.
"""

from __future__ import annotations

import dataclasses

import harness
import pytest
import torch
from checks import rel, seed_for, value_error
from test_hf_parallelize import float64_reference, gpt2, llama, perturbed, shifted_loss

from lightning_3d import destroy_grid, init_grid
from lightning_3d.models import GPT3D, DenseGPT, GPTConfig
from lightning_3d.parallel import Attention, dense_state_dict, find_plan, load_dense_state_dict
from lightning_3d.pipeline import PipelinedModel, build_schedule, layer_ranges, split_stages

V, B, S, STEPS = 50, 4, 8, 3
F64 = torch.float64
TOL = 1e-9
LLAMA = dict(style="llama", ffn_hidden=24, n_kv_head=2)
STYLES = {
    "gpt2": {},
    "llama": LLAMA,
    "gpt2_tied": dict(tie_embeddings=True),
    "llama_tied": dict(LLAMA, tie_embeddings=True),
}
# world → [((pp, (px, py, pz), dp), style, schedules)]; a schedule with split points as (name, points).
# Tied embeddings: the first and the last stage on ranks of a pp-4 pipe (their "ends" group), on a
# 2×2×1 cube (the pipe group), and on one rank (ZBVZeroBubble: rank 0 runs both).
LAYOUTS = {
    4: [
        # GPipe: layers 0 | 1-3
        ((2, (2, 1, 1), 1), "gpt2", (("GPipe", [1]), "1F1B", "InterleavedZeroBubble", "DualPipeV")),
        ((2, (1, 1, 1), 2), "llama", ("GPipe", "1F1B", "Interleaved1F1B")),
        ((4, (1, 1, 1), 1), "gpt2_tied", ("GPipe", "1F1B")),
    ],
    8: [((2, (2, 2, 1), 1), "llama_tied", ("GPipe", "1F1B", "ZBVZeroBubble"))],
}


def config(style: str, **kw) -> GPTConfig:
    base = dict(vocab_size=V, block_size=12, n_layer=4, n_head=4, n_embd=16, tie_embeddings=False)
    return GPTConfig(**{**base, **STYLES[style], **kw})


def dense_model(cfg: GPTConfig, seed: int) -> DenseGPT:
    """DenseGPT with perturbed weights (no zero biases, no unit norms)."""
    torch.manual_seed(seed)
    dense = DenseGPT(cfg, dtype=F64)
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return dense


def batch(grid, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh ids and targets per dp replica, some targets ignored."""
    torch.manual_seed(seed_for(grid, seed))
    idx, targets = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
    targets[0, 0] = targets[-1, 3] = -100
    return idx, targets


def held(key: str, stage) -> bool:
    """Whether ``stage`` holds the dense tensor ``key``: its layers, the embeddings first, the head last."""
    if key.startswith("transformer.h."):
        return int(key.split(".")[2]) in stage.layers
    return stage.is_first if key.startswith(("transformer.wte", "transformer.wpe")) else stage.is_last


def train(grid, style: str, schedule: str, split_points=None) -> dict:
    """Losses of three AdamW steps and every parameter after them, against DenseGPT."""
    cfg = config(style)
    dense = dense_model(cfg, 1)
    state = dense.state_dict()
    meta = DenseGPT(cfg, device="meta", dtype=F64)
    stages = split_stages(meta, grid, schedule=schedule, split_points=split_points)
    errs = {}
    for stage in stages:
        keys = set(stage.module.state_dict())
        errs[f"names_of_stage{stage.index}"] = float(keys != {k for k in state if held(k, stage)})
        load_dense_state_dict(stage.module, {k: state[k] for k in keys})
    pipeline = build_schedule(stages, schedule, 4, (B, S))
    passes = watch_weight_passes(pipeline) if pipeline.defers_weights else None
    params = [p for stage in stages for p in stage.module.parameters()]
    opts = [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1) for ps in (dense.parameters(), params)]
    idx, targets = batch(grid, 2)
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        ref = dense(idx, targets)
        ref.backward()
        loss = pipeline.step(idx, targets)
        for opt in opts:
            opt.step()
        errs[f"loss{step}"] = rel(loss, ref.detach())
    state = dense.state_dict()
    for stage in stages:
        errs.update({k: rel(t, state[k]) for k, t in dense_state_dict(stage.module).items()})
    if passes is not None:  # every backward deferred products, every W action ran them into .grad
        errs["deferred_none"] = float(not passes or min(deferred for deferred, _, _ in passes) == 0)
        errs["deferred_not_run"] = float(any(left != 0 or not added for _, left, added in passes))
    return errs


def watch_weight_passes(pipeline) -> list:
    """The weight passes the schedule's stages build, each as ``[products its backward deferred,
    products left after its W action, whether W changed every deferred weight's .grad]``."""
    seen = []
    for torch_stage in pipeline.schedule._stages:
        build = torch_stage.dw_builder

        def watched(build=build):
            deferred = build()
            entry = [len(deferred.products), None, False]
            seen.append(entry)

            def weight_action():
                params = [param for *_, param in deferred.products]
                before = [None if p.grad is None else p.grad.clone() for p in params]
                deferred()
                entry[1] = len(deferred.products)
                entry[2] = all(b is None or not torch.equal(b, p.grad) for b, p in zip(before, params))

            return weight_action

        torch_stage.dw_builder = watched
    return seen


def meta_init(grid, style: str) -> dict:
    """A stage built on meta holds the initial values the whole model draws from the same seed."""
    cfg = config(style)
    torch.manual_seed(11)
    whole = DenseGPT(cfg, dtype=F64).state_dict()
    torch.manual_seed(11)
    stages = split_stages(DenseGPT(cfg, device="meta", dtype=F64), grid, schedule="GPipe")
    return {
        f"init_{k}": float(not torch.equal(t, whole[k]))
        for stage in stages
        for k, t in dense_state_dict(stage.module).items()
    }


def layouts_job(world: int) -> dict:
    out = {}
    for (pp, shape, dp), style, schedules in LAYOUTS[world]:
        grid = init_grid(shape, dp, pipeline_size=pp)
        where = f"pp{pp}_{'x'.join(map(str, shape))}_dp{grid.data_parallel_size}_{style}"
        for schedule, points in ((s, None) if isinstance(s, str) else s for s in schedules):
            errs = train(grid, style, schedule, points)
            out.update({f"{where}_{schedule}_{k}": e for k, e in errs.items()})
        out.update({f"{where}_{k}": e for k, e in meta_init(grid, style).items()})
        destroy_grid(grid)
    return out


def _assert_small(results: list[dict]) -> None:
    bad = [(rank, k, e) for rank, r in enumerate(results) for k, e in r.items() if not e < TOL]
    assert not bad, f"errors above {TOL}: {bad[:10]}"


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_stages_train_as_dense(world):
    _assert_small(harness.run(world, layouts_job, world))


HF_MODELS = {
    "llama": lambda: llama(False),
    "gpt2": lambda: gpt2(True),
}  # GQA Llama untied, GPT-2 tied; 2 layers


def hf_job() -> dict:
    """Hugging Face models in two stages of 2×1×1 under 1F1B: three AdamW steps as the unmodified model's."""
    grid = init_grid((2, 1, 1), pipeline_size=2)
    errs = {}
    for name, make in HF_MODELS.items():
        dense = perturbed(make, 1)
        ref = float64_reference(dense)  # Llama's RMSNorms in float64, as the 3-D norms compute
        stages = split_stages(dense, grid, schedule="1F1B")  # consumes ``dense``
        pipeline = build_schedule(stages, "1F1B", 2, (4, 8))
        params = [p for stage in stages for p in stage.module.parameters()]
        opts = [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1) for ps in (ref.parameters(), params)]
        torch.manual_seed(seed_for(grid, 3))
        ids = torch.randint(0, 60, (4, 8))
        labels = ids.clone()
        labels[0, 2] = labels[3, 5] = -100
        for step in range(STEPS):
            for opt in opts:
                opt.zero_grad()
            want = shifted_loss(ref(input_ids=ids, use_cache=False).logits, labels)
            want.backward()
            loss = pipeline.step(ids, labels)
            for opt in opts:
                opt.step()
            errs[f"{name}_loss{step}"] = rel(loss, want.detach())
        state = ref.state_dict()
        for stage in stages:
            errs.update({f"{name}_{k}": rel(t, state[k]) for k, t in dense_state_dict(stage.module).items()})
    destroy_grid(grid)
    return errs


def test_hf_stages_train_as_the_model():
    _assert_small(harness.run(4, hf_job))


def loss_scale_job() -> dict:
    """With ``loss_scale``, the schedule's backward starts from the loss times the scale (a parameter's hook sees
    its gradient so scaled inside the schedule), the loss comes back unscaled, and the backward of the scaled
    loss hands on the gradients the scaler expects: the unscaled run's times the scale (0: exactly so)."""
    grid = init_grid((1, 1, 1), pipeline_size=2, data_parallel_size=2)
    torch.manual_seed(5)
    model = PipelinedModel(DenseGPT(config("gpt2"), device="meta", dtype=F64), grid)
    ids, targets = batch(grid, 6)
    seen = []
    next(model.parameters()).register_hook(lambda g: seen.append(g.clone()))
    runs = {}
    for scale in (1.0, 1024.0):
        model.loss_scale = lambda scale=scale: scale
        model.zero_grad(set_to_none=True)
        seen.clear()
        loss = model(ids, targets)
        (loss * scale).backward()
        runs[scale] = (loss.detach(), seen[0], [p.grad.clone() for p in model.parameters()])
    (loss, inside, grads), (scaled_loss, scaled_inside, scaled_grads) = runs[1.0], runs[1024.0]
    errs = {
        "loss": float(not torch.equal(loss, scaled_loss)),
        "inside_the_schedule": float(not torch.equal(1024 * inside, scaled_inside)),
    }
    errs.update(
        {f"grad{k}": float(not torch.equal(1024 * a, b)) for k, (a, b) in enumerate(zip(grads, scaled_grads))}
    )
    destroy_grid(grid)
    return errs


def test_loss_scale_reaches_the_schedules_backward():
    _assert_small(harness.run(4, loss_scale_job))


def tied_layers(model: DenseGPT) -> DenseGPT:
    """``model`` with layer 1's QKV weight layer 0's (stages 0 and 1 of four would share it)."""
    model.transformer.h[1].attn.c_attn.weight = model.transformer.h[0].attn.c_attn.weight
    return model


def refusals_job() -> dict:
    """Each refusal's message names its numbers and its fix (0: as expected)."""
    grid = init_grid((1, 1, 1), pipeline_size=2, data_parallel_size=2)
    meta = lambda **kw: DenseGPT(config("gpt2", **kw), device="meta", dtype=F64)  # noqa: E731
    stages = split_stages(meta(), grid, schedule="1F1B")
    expected = {
        "tied_between": (
            lambda: split_stages(tied_layers(meta()), grid, schedule="Interleaved1F1B"),
            "only the first and the last pipeline stage may share a parameter",
        ),
        "parallelized": (lambda: split_stages(GPT3D(config("gpt2"), grid), grid), "split the plain model"),
        "attention_plan": (
            lambda: split_stages(
                meta(),
                grid,
                plan=dataclasses.replace(find_plan(meta()), attention={"transformer.h.*.attn": Attention()}),
            ),
            "such a plan is not split into pipeline stages; run it with pipeline_size=1",
        ),
        "schedule": (
            lambda: split_stages(meta(), grid, schedule="Zigzag"),
            "unknown pipeline schedule 'Zigzag'",
        ),
        "per_rank": (
            lambda: split_stages(meta(), grid, schedule="1F1B", stages_per_rank=2),
            "runs 1 stage(s) per rank, not 2",
        ),
        "too_many_stages": (
            lambda: split_stages(meta(n_layer=2), grid, schedule="Interleaved1F1B", stages_per_rank=2),
            "4 pipeline stages need at least one layer each, but the model has 2",
        ),
        "other_schedule": (
            lambda: build_schedule(split_stages(meta(), grid, schedule="Interleaved1F1B"), "1F1B", 4, (B, S)),
            "under 1F1B this rank runs stages",
        ),
        "micro_batches": (
            lambda: build_schedule(stages, "1F1B", 3, (B, S)),
            "pick n_microbatches among the divisors",
        ),
        "sequence": (lambda: build_schedule(stages, "1F1B", 4, (B, 16)), "exceeds block_size 12"),
    }
    errs = {k: float(needle not in value_error(fn)) for k, (fn, needle) in expected.items()}
    pipeline = build_schedule(stages, "1F1B", 2, (B, S))
    ids, targets = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
    targets[:2] = -100
    wrong = (ids[:2], None) if grid.is_first_stage else (None, targets[:, :4])
    errs["batch_shape"] = float("must be [4, 8]" not in value_error(lambda: pipeline.step(*wrong)))
    if grid.is_last_stage:  # the last stage refuses before the schedule runs; the first waits for nothing
        errs["empty_micro_batch"] = float(
            "micro-batches [0] of 2 have every target ignored"
            not in value_error(lambda: pipeline.step(ids, targets))
        )
    destroy_grid(grid)
    return errs


def test_refusals_name_numbers_and_fixes():
    _assert_small(harness.run(4, refusals_job))


@pytest.mark.parametrize(
    "n_layers, n_stages, points, want",
    [
        (7, 3, None, [range(0, 3), range(3, 5), range(5, 7)]),
        (4, 4, None, [range(k, k + 1) for k in range(4)]),
        (6, 2, [1], [range(0, 1), range(1, 6)]),
    ],
)
def test_layer_ranges(n_layers, n_stages, points, want):
    assert layer_ranges(n_layers, n_stages, points) == want


@pytest.mark.parametrize("points", [[3, 2], [0, 2], [2, 6], [2]])
def test_layer_ranges_refuse_bad_split_points(points):
    with pytest.raises(ValueError, match="increasing layer indices in 1..5"):
        layer_ranges(6, 3, points)
