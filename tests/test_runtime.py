"""Run-time state belongs to each model: two parallelized models with different options, used
alternately in one process (each forward, then each backward), each run by their own options.

Ambient state breaks exactly this: a prefetch or a queue of late gradients kept by the process
would serve the second model's forward from the first's, or hand the first model's backward to
the prefetch of whichever forward ran last.
"""

import harness
import torch
from checks import assert_close, on_grids, rel
from test_gpt import batch, config, grads_as_dense, pair

from lightning_3d.options import RuntimeOptions
from lightning_3d.parallel import runtime_of, set_options
from lightning_3d.runtime import late_grads

# one gathers weight by weight, re-gathers in backward and leaves weight gradients for the end;
# the other gathers a block's weights at once, keeps them, and reduces each gradient in its product
OPTIONS = {
    "a": RuntimeOptions(prefetch_depth=2, gathered_together=1, save_gathered=False, grads_at_end=True),
    "b": RuntimeOptions(prefetch_depth=4, gathered_together=4, grads_at_end=False, check_inputs=False),
}


def _left_for_end(model) -> float:
    """Share of the model's gathered block weights whose gradient its runtime holds, not yet handed on."""
    held = runtime_of(model).late_grads
    left = set(held.pending) | {late_grads._key(w) for _, _, w in held.queued}
    weights = [p for name, p in model.named_parameters() if ".h." in name and p.dim() > 1]
    return sum(late_grads._key(w) in left for w in weights) / len(weights)


def alternating_job(grid):
    errs, models, denses, shares = {}, {}, {}, {}
    for name, options in OPTIONS.items():
        denses[name], models[name] = pair(grid, config("llama"), 3, options=options)
        shares[name] = []

        def watch(
            module, args, out, name=name
        ) -> None:  # at the embedding's output gradient every product's backward has run
            out.register_hook(lambda grad: shares[name].append(_left_for_end(models[name])))

        models[name].transformer.wte.register_forward_hook(watch)
    for step in range(2):  # the second step runs on the orders the first recorded
        idx, targets = batch(grid, 4 + step)
        losses = {name: model(idx, targets) for name, model in models.items()}  # a's forward, then b's
        for name in models:  # then a's backward, then b's
            models[name].zero_grad()
            denses[name].zero_grad()
            losses[name].backward()
            ref = denses[name](idx, targets)
            ref.backward()
            errs[f"{name}{step}_loss"] = rel(losses[name].detach(), ref.detach())
            grads = grads_as_dense(
                models[name]
            )  # overwrites the weights: the next step starts from the same ones
            with torch.no_grad():
                models[name].load_dense_state_dict(denses[name].state_dict())
            errs.update(
                {f"{name}{step}_d{k}": rel(grads[k], p.grad) for k, p in denses[name].named_parameters()}
            )
    for name, options in OPTIONS.items():
        fetched = runtime_of(models[name]).prefetch
        errs[f"{name}_own_prefetch"] = float(
            (fetched.depth, fetched.together) != (options.prefetch_depth, options.gathered_together)
        )
        own = {late_grads._key(p) for p in models[name].parameters()}
        errs[f"{name}_gathered_own_weights"] = float(
            not fetched._forward.order
            or any(late_grads._key(w) not in own for w, _ in fetched._forward.order)
        )
    # a's backward re-gathered through a's prefetch though b's forward ran after a's
    a_fetched = runtime_of(models["a"]).prefetch
    errs["a_backward_prefetched"] = float(
        not 0 < len(a_fetched._backward.order) == len(a_fetched._forward.order)
    )
    errs["a_grads_at_end"] = 1.0 - min(shares["a"])
    errs["b_grads_in_products"] = max(shares["b"])
    # a checks its token ids, b (check_inputs=False) does not
    bad = batch(grid, 6)[0] + 1000
    try:
        models["a"](bad)
        errs["a_checks_ids"] = 1.0
    except ValueError:
        errs["a_checks_ids"] = 0.0
    models["b"](bad)  # no error
    # changing b's options re-applies them to b alone
    set_options(models["b"], prefetch_depth=3, gathered_together=1)
    depths = {name: runtime_of(m).prefetch.depth for name, m in models.items()}
    errs["set_options_own_model"] = float(depths != {"a": 2, "b": 3})
    return errs


def test_models_with_different_options_alternate():
    assert_close(harness.run(4, on_grids, [(2, 1, 1)], alternating_job), tol=1e-9)
