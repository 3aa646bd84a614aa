"""``RuntimeOptions(compile=True)``: GPT3D with its blocks compiled equals DenseGPT (float64).

The grids, in a world of 2, cut each axis once and cover both kinds of compiled product: a grid
cut over x only (the compiler's GEMM between the weight's gather and its gradient's
reduce-scatter) and grids cut over y or z (the product's own custom ops). Each rank compiles its
own graphs, and compilation on CPU is slow, so the eager twin tests (``test_gpt.py``) carry the
grids with several axes and dp.

Each block compiles into one graph on every grid: its 3-D products, norm statistics and
replicated gradients are custom ops inside it. Each job starts from a fresh compiler cache and
fails unless graphs were really compiled, none broke, and none fell back to eager at the
recompile limit.
"""

import harness
import torch
from checks import assert_close, on_grids, rel
from test_gpt import STYLES, batch, config, equivalence, pair

from lightning_3d.options import RuntimeOptions
from lightning_3d.parallel import runtime_of, set_options
from lightning_3d.sharding import get_spec, unshard_tensor


def _compiled(errs: dict, breaks_allowed: bool) -> dict:
    """Add the checks that compilation happened: graphs captured, no eager fallback, no break on a one-rank cube."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    errs["graphs_compiled"] = float(graphs == 0)
    errs["no_recompile_limit"] = float(any("recompile limit" in k.lower() for k in counters["unimplemented"]))
    if not breaks_allowed:
        errs["one_graph_per_block"] = float(sum(counters["graph_break"].values()) != 0)
    return errs


def _fresh_compiler() -> None:
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()


def compiled_job(grid):
    """Logits, loss and every gradient of the compiled GPT3D against DenseGPT, for both styles.

    Every block shares one compiled graph per grad mode: with a recompile limit of 2 (no grad for
    the logits, grad for the loss), a guard on anything a block owns (its parameters' identity)
    would recompile the second block and hit the limit."""
    errs = {}
    for style in STYLES:
        _fresh_compiler()
        with torch._dynamo.config.patch(recompile_limit=2):
            errs.update(
                _compiled(equivalence(grid, style, RuntimeOptions(compile=True)), breaks_allowed=False)
            )
    return {f"compiled_{k}": e for k, e in errs.items()}


def compiled_options_job(grid):
    """The compiled model with each other run-time choice on (prefetched weights, regathered
    operands, collective matmuls, weight gradients handed on at the end of backward) against
    DenseGPT; every weight its forward gathered through the prefetch is re-gathered through it in
    backward (the custom ops see their weights as parameters)."""
    options = RuntimeOptions(
        compile=True, prefetch=True, save_gathered=False, async_tp=True, grads_at_end=True
    )
    _fresh_compiler()
    models = []
    errs = _compiled(equivalence(grid, "llama", options, models), breaks_allowed=False)
    fetched = runtime_of(models[0]).prefetch  # the model's own, where x gathers weights
    errs["backward_prefetch_order"] = float(
        grid.size("x") > 1
        and (fetched is None or not 0 < len(fetched._backward.order) == len(fetched._forward.order))
    )
    return {f"options_{k}": e for k, e in errs.items()}


def _compiled_against_eager(model, run) -> dict:
    """Relative errors of the loss and every gradient of ``run(True)`` (compiled) against ``run(False)``."""
    runs = []
    for compiled in (False, True):
        model.zero_grad()
        loss = run(compiled)
        loss.backward()
        runs.append(
            (loss.detach(), [unshard_tensor(p.grad, get_spec(p), model.grid) for p in model.parameters()])
        )
    (loss0, grads0), (loss1, grads1) = runs
    return {
        "loss": rel(loss1, loss0),
        **{f"grad{n}": rel(g1, g0) for n, (g0, g1) in enumerate(zip(grads0, grads1))},
    }


def compiled_autocast_job(grid):
    """Under bf16 autocast (products cast inside the custom ops), the compiled float32 model's
    loss and gradients against the same model run eagerly."""
    _, model = pair(grid, config("gpt2"), 3, dtype=torch.float32)
    idx, targets = batch(grid, 4)

    def run(compiled):
        _fresh_compiler()
        set_options(model, compile=compiled)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(idx, targets)

    return _compiled(_compiled_against_eager(model, run), breaks_allowed=False)


def compiled_checkpointing_job(grid, grads_at_end=False):
    """Compiled and recomputed blocks with dropout: the loss and gradients of the eager model with the same masks
    (with ``grads_at_end``, both leave the weight gradients for the end of backward)."""
    _fresh_compiler()
    _, model = pair(grid, config("llama", dropout=0.2), 3, options=RuntimeOptions(grads_at_end=grads_at_end))
    idx, targets = batch(grid, 4)

    def run(compiled):
        set_options(model, compile=compiled, activation_checkpointing=compiled)
        torch.manual_seed(5)
        return model(idx, targets)

    return _compiled(_compiled_against_eager(model, run), breaks_allowed=True)


def op_calls_job(grid) -> dict:
    """On a grid cut over x only every compiled product is the compiler's GEMM between two ops, the
    weight's gather (``lightning_3d::gathered_weight``) and the backward GEMMs with dB's
    reduce-scatter (``lightning_3d::gathered_product_backward``); elsewhere the product's own two
    ops. Counted in a profile of one step of the compiled model."""
    _fresh_compiler()
    _, model = pair(grid, config("llama"), 1, options=RuntimeOptions(compile=True))
    idx, targets = batch(grid, 2)
    model(idx, targets).backward()
    with torch.profiler.profile() as prof:
        model(idx, targets).backward()
    calls = {}
    for event in prof.events():
        calls[event.name] = calls.get(event.name, 0) + 1
    products = 4 * model.config.n_layer
    x_only = grid.size("y") == grid.size("z") == 1
    gathered, own = (products, 0) if x_only else (0, products)
    return {
        "gathered_weight_calls": float(calls.get("lightning_3d::gathered_weight", 0) != gathered),
        "gathered_backward_calls": float(calls.get("lightning_3d::gathered_product_backward", 0) != gathered),
        "matmul3d_calls": float(calls.get("lightning_3d::matmul3d", 0) != own),
        "matmul3d_backward_calls": float(calls.get("lightning_3d::matmul3d_backward", 0) != own),
    }


def test_compiled_products_on_an_x_grid_are_the_compilers():
    assert_close(harness.run(2, on_grids, [(2, 1, 1), (1, 2, 1)], op_calls_job), tol=0.5)


def test_compiled_gpt3d_equals_dense_on_grids():
    assert_close(harness.run(2, on_grids, [(2, 1, 1), (1, 2, 1)], compiled_job), tol=1e-9)


def test_compiled_gpt3d_with_prefetch_regather_and_collective_matmuls():
    assert_close(harness.run(2, on_grids, [(2, 1, 1), (1, 1, 2)], compiled_options_job), tol=1e-9)


def test_compiled_gpt3d_under_autocast_matches_eager():
    assert_close(harness.run(2, on_grids, [(2, 1, 1), (1, 1, 2)], compiled_autocast_job), tol=3e-2)


def test_compiled_blocks_with_checkpointing_and_dropout():
    assert_close(harness.run(2, on_grids, [(1, 2, 1)], compiled_checkpointing_job), tol=1e-9)
    assert_close(harness.run(2, on_grids, [(2, 1, 1)], compiled_checkpointing_job, True), tol=1e-9)


def test_schedule_op_arguments_round_trip_every_field():
    """What a compiled product's custom ops are told (typed arguments) is the schedule it was made from."""
    from itertools import product

    from lightning_3d.ops.matmul import _op_args, _schedule_of
    from lightning_3d.runtime import MatmulSchedule, Runtime

    class Named:
        def __init__(self, name: str):
            self.group_name = name

    groups, runtime = (Named("3"), Named("17"), Named("1a2b")), Runtime()
    for form, cast, flags in product(
        ("ab", "abt", "atb"),
        (None, torch.bfloat16, torch.float16, torch.float32),
        product((False, True), repeat=4),
    ):
        save_gathered, b_is_parameter, grads_at_end, async_tp = flags
        schedule = MatmulSchedule(
            form, groups, (2, 4, 1), save_gathered, cast, b_is_parameter, grads_at_end, 3, async_tp
        )
        args = _op_args(schedule, runtime)
        assert _schedule_of(*args[:-1], resolve=False) == schedule._replace(groups=(None,) * 3), args
        assert args[1] == ["3", "17", "1a2b"] and args[-1] == runtime.name, args
