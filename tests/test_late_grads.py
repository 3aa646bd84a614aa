"""``RuntimeOptions(grads_at_end=True)``: each gathered weight's gradient is reduce-scattered beside
backward and handed to autograd once, at its end.

It is the default, so ``test_gpt.py`` proves GPT3D with it equal to DenseGPT on every grid (a
block's weights gathered as one call, blocks recomputed in backward too); here, on grids with
px > 1, also with weights re-gathered and prefetched, and gathered weight by weight two products
ahead (float64: loss and every gradient; compiled: ``test_compile.py``); the block weights' gradients
really wait for the end, eager and compiled, the stacked q/k/v and gate/up weights included (each
is pending when the embedding's output gradient is computed, none is without the option);
gradients accumulate over micro-batches; DDP over dp reduces them as without the option; a
backward that fails half-way leaves nothing a later step hands on; and the reduce-scatters a block
starts as one collective equal those of its gradients one by one.
"""

import harness
import torch
import torch.distributed as dist
from checks import assert_close, on_grids, rel
from test_gpt import batch, config, equivalence, pair
from torch.nn.parallel import DistributedDataParallel

from lightning_3d import comm
from lightning_3d.options import RuntimeOptions
from lightning_3d.parallel import runtime_of
from lightning_3d.runtime import late_grads
from lightning_3d.sharding import get_spec, unshard_tensor

GRIDS = [(2, 1, 1), (2, 2, 1), (2, 1, 2)]  # in a world of 4: dp = 2, 1, 1


def _block_weights(model) -> list:
    return [p for name, p in model.named_parameters() if ".h." in name and p.dim() > 1]


def _pending_share(grid, grads_at_end: bool, compile: bool = False) -> float:
    """Share of the block weights whose gradient is left for the end of backward (its
    reduce-scatter started or queued, not yet handed to autograd) when the embedding's output gradient is
    computed: every one with the option, none without."""
    if compile:
        torch.compiler.reset()
    _, model = pair(
        grid, config("llama"), 3, options=RuntimeOptions(grads_at_end=grads_at_end, compile=compile)
    )
    idx, targets = batch(grid, 4)
    seen = []
    weights, held = _block_weights(model), runtime_of(model).late_grads

    def watch(module, args, out) -> None:
        def share(grad) -> None:
            left = set(held.pending) | {late_grads._key(w) for _, _, w in held.queued}
            seen.append(sum(late_grads._key(w) in left for w in weights) / len(weights))

        out.register_hook(share)

    model.transformer.wte.register_forward_hook(watch)
    model(idx, targets).backward()
    return seen[0]


def _accumulated(grid, options: RuntimeOptions, micro_batches: int = 2) -> list:
    _, model = pair(grid, config("gpt2"), 5, options=options)
    for step in range(micro_batches):
        model(*batch(grid, 6 + step)).backward()
    return [unshard_tensor(p.grad, get_spec(p), grid) for p in model.parameters()]


def _after_failed_backward(grid) -> list:
    """Gradients of one step, after a backward that raised once every product had started its scatter."""
    _, model = pair(grid, config("llama"), 7, options=RuntimeOptions(grads_at_end=True))

    def fail(module, args, out) -> None:
        out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("stop")))

    handle = model.transformer.wte.register_forward_hook(fail)
    try:
        model(*batch(grid, 8)).backward()
    except RuntimeError:
        pass
    handle.remove()
    model.zero_grad()
    model(*batch(grid, 9)).backward()
    return [unshard_tensor(p.grad, get_spec(p), grid) for p in model.parameters()]


def _accumulated_fresh(grid) -> list:
    """The gradients :func:`_after_failed_backward` must end with: its model's one clean step."""
    _, model = pair(grid, config("llama"), 7, options=RuntimeOptions(grads_at_end=True))
    model(*batch(grid, 9)).backward()
    return [unshard_tensor(p.grad, get_spec(p), grid) for p in model.parameters()]


def _ddp(grid, grads_at_end: bool) -> list:
    _, model = pair(grid, config("gpt2"), 11, options=RuntimeOptions(grads_at_end=grads_at_end))
    ddp = DistributedDataParallel(model, process_group=grid.group("dp"))
    for step in range(2):
        ddp.zero_grad()
        ddp(*batch(grid, 12 + step)).backward()
    return [p.grad.clone() for p in model.parameters()]


def late_job(grid):
    errs = {
        f"regather_{k}": e
        for k, e in equivalence(grid, "llama", RuntimeOptions(save_gathered=False, prefetch=True)).items()
    }
    one_by_one = RuntimeOptions(
        prefetch_depth=2, gathered_together=1
    )  # gpt2 ties the embedding to the LM head
    errs.update({f"one_by_one_{k}": e for k, e in equivalence(grid, "gpt2", one_by_one).items()})
    errs["pending_at_end"] = 1.0 - _pending_share(grid, True)
    errs["none_pending_without"] = _pending_share(grid, False)
    if (
        grid.size("y") == grid.size("z") == 1
    ):  # the compiled blocks' custom ops leave them too, stacked weights included
        errs["pending_at_end_compiled"] = 1.0 - _pending_share(grid, True, compile=True)
    plain, late = _accumulated(grid, RuntimeOptions()), _accumulated(grid, RuntimeOptions(grads_at_end=True))
    errs.update({f"accumulated{n}": rel(g, ref) for n, (g, ref) in enumerate(zip(late, plain))})
    after = _after_failed_backward(grid)
    fresh = _accumulated_fresh(grid)
    errs.update({f"after_failure{n}": rel(g, ref) for n, (g, ref) in enumerate(zip(after, fresh))})
    if grid.size("dp") > 1:
        errs.update(
            {f"ddp{n}": rel(g, ref) for n, (g, ref) in enumerate(zip(_ddp(grid, True), _ddp(grid, False)))}
        )
    return errs


def test_weight_grads_at_end_equal_dense_and_arrive_at_end():
    assert_close(harness.run(4, on_grids, GRIDS, late_job))


def scattered_together_job():
    """Per case: whether ``reduce_scatter_dim0_together`` equals one ``reduce_scatter_dim0`` per
    tensor, dtype included: tensors of different shapes, cast on the way, and of mixed dtypes
    (reduce-scattered one by one); then the error a dim 0 the group does not divide raises."""
    group, g = dist.group.WORLD, dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    ts = [
        torch.randn(3 * g, 5, dtype=torch.float64),
        torch.randn(2 * g, dtype=torch.float64),
        torch.randn(g, 2, 4, dtype=torch.float64),
    ]
    same = []
    for items, dtype in ((ts, None), (ts, torch.float32), ([ts[0], ts[1].float()], None)):
        outs = comm.reduce_scatter_dim0_together(items, group, dtype)
        expected = [comm.reduce_scatter_dim0(t, group)[0].to(dtype or t.dtype) for t in items]
        same.append(all(o.dtype == e.dtype and torch.equal(o, e) for o, e in zip(outs, expected)))
    try:
        comm.reduce_scatter_dim0_together([ts[0], torch.randn(g + 1, 2, dtype=torch.float64)], group)
    except ValueError as e:
        return same, str(e)
    return same, None


def test_scattered_together_equals_scattered_one_by_one():
    for same, error in harness.run(4, scattered_together_job):
        assert same == [True, True, True]
        assert error == "cannot reduce-scatter dim 0 of size 5 over 4 ranks: 5 % 4 != 0"
