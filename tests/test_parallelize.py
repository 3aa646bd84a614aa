"""parallelize(model, plan) on a plain user-defined nn.Module equals the unmodified model (float64,
loss and every parameter gradient) on every grid; a meta-device build gives the same shards as a
materialised one; unmapped modules and unused patterns are refused before anything changes."""

import copy
import subprocess
import sys

import harness
import torch
import torch.nn.functional as F
from checks import assert_close, on_grids, rel, seed_for, value_error
from torch import nn

from lightning_3d.layers import Module3D
from lightning_3d.options import RuntimeOptions
from lightning_3d.parallel import (
    Linear,
    LMHead,
    Loss,
    Norm,
    Plan,
    PositionEmbedding,
    VocabEmbedding,
    dense_state_dict,
    options_of,
    parallelize,
    runtime_of,
    set_options,
)
from lightning_3d.sharding import get_spec

# vocabulary 18: padded to 20 where px·py = 4; batch 4 splits on every grid below
V, H, HEADS, FFN, B, S = 18, 8, 2, 12, 4, 5
GRIDS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 2, 2), (2, 2, 2), (2, 2, 1)]  # world 8: dp 8, 4, 4, 2, 1, 2
F64 = torch.float64


class Block(nn.Module):
    """Pre-norm causal attention (separate q, k, v; k without the bias whose gradient softmax makes 0) and a
    GELU MLP."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(
            H, eps=1e-2
        )  # epsilons off the defaults, large enough to change float64 results
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H, bias=False), nn.Linear(H, H)
        self.o = nn.Linear(H, H)
        self.rms = nn.RMSNorm(H, eps=1e-2)
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x):
        h = self.ln(x)
        q, k, v = (
            proj(h).unflatten(-1, (-1, H // HEADS)).transpose(1, 2) for proj in (self.q, self.k, self.v)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)
        x = x + self.o(att)
        return x + self.fc2(F.gelu(self.fc1(self.rms(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, H)
        self.pos = nn.Embedding(S, H)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, ids, targets):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return self.loss(logits.flatten(0, -2), targets.flatten())


def plan(**kw) -> Plan:
    rules = {
        "tok": VocabEmbedding(),
        "pos": PositionEmbedding(),
        "blocks.*.ln": Norm("z"),
        "blocks.*.[qkv]": Linear("z"),
        "blocks.*.o": Linear("y"),
        "blocks.*.rms": Norm("z"),
        "blocks.*.fc1": Linear("z"),
        "blocks.*.fc2": Linear("y"),
        "norm": Norm("z"),
        "head": LMHead(),
        "loss": Loss(),
    }
    return Plan(rules, checkpoint=("blocks.*",), **kw)


def _grads_as_dense(model) -> dict:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    return dense_state_dict(model)


def equality_job(grid):
    """Loss and every gradient equal the dense model's; again with every run-time option switched."""
    torch.manual_seed(1)
    dense = TinyLM().to(F64)
    with torch.no_grad():  # no unit norms, no zero biases
        for p in dense.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    torch.manual_seed(seed_for(grid, 2))
    ids, targets = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
    targets[0, 1] = -100
    ref = dense(ids, targets)
    ref.backward()
    errs = {}
    # the defaults (a block's weights gathered at once, weight gradients at the end), none of it,
    # and re-gathering under checkpointing with another prefetch
    for run, options in enumerate(
        [
            {},
            dict(prefetch=False, grads_at_end=False),
            dict(save_gathered=False, activation_checkpointing=True, prefetch_depth=3, gathered_together=3),
        ]
    ):
        model = parallelize(copy.deepcopy(dense), plan(), grid=grid)
        set_options(model, **options)
        for _ in range(2):  # prefetch follows the order recorded by the first forward
            model.zero_grad()
            loss = model(ids, targets)
            loss.backward()
        errs[f"{run}_loss"] = rel(loss.detach(), ref.detach())
        wanted, fetched = (
            RuntimeOptions(**options),
            runtime_of(model).prefetch,
        )  # the options' prefetch, where x gathers weights
        errs[f"{run}_prefetch"] = float(
            wanted.prefetch
            and grid.size("x") > 1
            and (fetched._forward.depth, fetched._forward.together)
            != (wanted.prefetch_depth, wanted.gathered_together)
        )
        grads = _grads_as_dense(model)
        errs.update({f"{run}_d{k}": rel(grads[k], p.grad) for k, p in dense.named_parameters()})
    errs["keys"] = float(list(grads) != list(dense.state_dict()))
    errs["is_3d"] = float(
        not all(isinstance(model.get_submodule(n), Module3D) for n in ("tok", "blocks.1.fc2", "head"))
    )
    return errs


def test_plain_module_equals_dense_on_grids():
    assert_close(harness.run(8, on_grids, GRIDS, equality_job), tol=1e-10)


def prefetch_options_job(grid):
    """Per forward, how many weight gathers were in flight once ``blocks.0.q`` had run, and whether every loss
    is the first's: the defaults, then ``set_options`` changing the prefetch after a forward (a forward records
    the order anew); and the counts of models given each change before their first forward."""
    torch.manual_seed(4)
    dense = TinyLM().to(F64)
    ids = torch.randint(0, V, (B, S))
    changes = [dict(prefetch_depth=1, gathered_together=1), dict(prefetch_depth=2)]

    def run(model, options_per_forward):
        in_flight, losses = [], []
        model.blocks[0].q.register_forward_hook(
            lambda *_: in_flight.append(len(runtime_of(model).prefetch._forward.ahead))
        )
        for options in options_per_forward:
            set_options(model, **options)
            with torch.no_grad():
                losses.append(model(ids, ids))
        return in_flight, all(torch.equal(loss, losses[0]) for loss in losses)

    changed = run(
        parallelize(copy.deepcopy(dense), plan(), grid=grid), [{}, {}, changes[0], {}, changes[1], {}]
    )
    fresh = [
        run(parallelize(copy.deepcopy(dense), plan(), grid=grid), [options, {}])[0]
        for options in (changes[0], {**changes[0], **changes[1]})
    ]
    return changed, fresh


def test_prefetch_options_set_after_the_first_forward_take_effect():
    for (changed, same_losses), fresh in harness.run(2, on_grids, [(2, 1, 1)], prefetch_options_job)[
        0
    ].values():
        assert fresh == [[0, 1], [0, 2]], fresh  # a first forward records the order; one ahead, two ahead
        assert changed[:2] == [0, 7] and changed[2:] == fresh[0] + fresh[1], (
            changed
        )  # as if set before a first forward
        assert same_losses


def meta_job(grid):
    """A model built on meta and initialised by parallelize holds the shards of the same seed's dense init."""
    torch.manual_seed(3)
    real = parallelize(TinyLM(), plan(), grid=grid)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = TinyLM()
    meta = parallelize(meta, plan(), grid=grid, device="cpu")
    a, b = real.state_dict(), meta.state_dict()
    return {
        "keys": float(list(a) != list(b)),
        "shards": float(max((a[k] - b[k]).abs().max() for k in a)),
        "specs": float(any(get_spec(p) is None for p in meta.parameters())),
        "on_meta": float(any(t.is_meta for t in b.values())),
    }


def test_meta_build_equals_materialised_build():
    assert_close(harness.run(8, on_grids, [(2, 2, 2), (1, 2, 1)], meta_job), tol=1e-300)


def errors_job(grid):
    model = TinyLM()
    no_fc2 = plan()
    del no_fc2.rules["blocks.*.fc2"]
    unused = plan()
    unused.rules["blocks.*.gate"] = Linear("z")
    msgs = {
        "unmapped": value_error(lambda: parallelize(model, no_fc2, grid=grid)),
        "unused": value_error(lambda: parallelize(model, unused, grid=grid)),
        "no_plan": value_error(lambda: parallelize(model, grid=grid)),
        "split": value_error(lambda: parallelize(model, plan(), grid=harness.grid((1, 8, 1)))),
    }
    harness.grid(grid.shape)
    msgs["unchanged"] = not any(isinstance(m, Module3D) for m in model.modules())
    parallelize(model, plan(), grid=grid)
    msgs["twice"] = value_error(lambda: parallelize(model, plan(), grid=grid))
    msgs["option"] = value_error(lambda: set_options(model, asynctp=True))
    msgs["shared"] = all(m.options is options_of(model) for m in model.modules() if isinstance(m, Module3D))
    return msgs


def test_unmapped_modules_and_bad_plans_are_refused():
    msgs = harness.run(8, on_grids, [(2, 2, 2)], errors_job)[0][(2, 2, 2)]
    assert "blocks.0.fc2 (Linear)" in msgs["unmapped"] and "blocks.1.fc2 (Linear)" in msgs["unmapped"], msgs[
        "unmapped"
    ]
    assert '\'blocks.*.fc2\': Linear("z") or Linear("y")' in msgs["unmapped"], msgs["unmapped"]
    assert "['blocks.*.gate'] match no module of TinyLM" in msgs["unused"], msgs["unused"]
    assert "no built-in plan for TinyLM" in msgs["no_plan"] and "register_plan('TinyLM'" in msgs["no_plan"], (
        msgs["no_plan"]
    )
    assert (
        msgs["split"].startswith("blocks.0.fc1: ")
        and "dim 0 of size 12 is split over py=8·px=1 = 8 ranks" in msgs["split"]
    ), msgs["split"]
    assert msgs["unchanged"] is True
    assert "already holds 3-D layers" in msgs["twice"]
    assert "unknown RuntimeOptions fields ['asynctp']" in msgs["option"], msgs["option"]
    assert msgs["shared"] is True


def test_core_imports_without_transformers():
    code = (
        "import sys, lightning_3d, lightning_3d.parallel, lightning_3d.models; "
        "assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
