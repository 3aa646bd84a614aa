"""A user's model parallelized by an explicit plan that names its attention runs on token rows: batches of 1
and 3 sequences, which whole-sequence rows split on neither grid below, equal the unmodified model.

One world of 8 runs 2×1×2 (dp 2: px·pz = 4 ≠ px·py, py ≠ pz) and 2×2×2, in float64. The model is the
dense model's own code: learned positions (``PositionEmbedding``), RoPE tables and SDPA masks passed to
each attention as arguments (``Attention(rope=..., masks=...)``), grouped-query heads, one block whose
attention calls ``scaled_dot_product_attention`` (``Attention()``) and one whose core attention is a
hand-written child module (``Attention(core="core")``), the loss a module. Batch 1 is plain causal (the
zig-zag kernels); batch 3 carries a padding mask that the model turns into SDPA's mask of whole sequences
and positions per sequence (learned and RoPE), on 2×1×2 with its blocks recomputed in backward; on 2×1×2
a batch of 4 runs on whole sequences with the same model and padding. Logits, loss and every parameter's
gradient equal the dense model's; a plan that names no attention, targets shifted by slicing and entries
their modules cannot take are refused with the fix.
"""

from __future__ import annotations

import copy

import harness
import torch
import torch.nn.functional as F
from checks import assert_close, on_grids, rel, seed_for, value_error
from torch import nn

from lightning_3d.layout import gather_activation
from lightning_3d.models.attention import rope_tables
from lightning_3d.options import RuntimeOptions
from lightning_3d.parallel import (
    Attention,
    Linear,
    LMHead,
    Loss,
    Norm,
    Plan,
    PositionEmbedding,
    VocabEmbedding,
    dense_state_dict,
    parallelize,
    set_options,
)
from lightning_3d.token_rows import TokenRows, choose_rows

V, H, HEADS, KV, D, FFN, MAX_S = 18, 16, 4, 2, 4, 24, 32  # 4 query heads on 2 key/value heads over py ≤ 2
GRIDS = [(2, 1, 2), (2, 2, 2)]  # in a world of 8: dp 2, 1
F64 = torch.float64


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half) of ``x`` ``[b, T, heads, d]`` by tables ``[T, d]`` or one per row ``[b, T, d]``."""
    x1, x2 = x.chunk(2, -1)
    return x * cos.unsqueeze(-2) + torch.cat([-x2, x1], -1) * sin.unsqueeze(-2)


class HandWrittenCore(nn.Module):
    """Causal (or masked) softmax attention, written out; query head ``i`` uses key/value head ``i // r``."""

    def forward(self, q, k, v, attn_mask=None):
        r = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if attn_mask is None:
            attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        return scores.masked_fill(~attn_mask, float("-inf")).softmax(-1) @ v


class SelfAttention(nn.Module):
    """q, k, v of ``-1`` heads (this rank's), RoPE by the tables given, SDPA or a core module."""

    def __init__(self, core: bool):
        super().__init__()
        self.q, self.k, self.v = (
            nn.Linear(H, HEADS * D),
            nn.Linear(H, KV * D, bias=False),
            nn.Linear(H, KV * D),
        )
        self.o = nn.Linear(HEADS * D, H)
        self.core = HandWrittenCore() if core else None

    def forward(self, x, cos, sin, mask=None):
        q, k, v = (proj(x).unflatten(-1, (-1, D)) for proj in (self.q, self.k, self.v))
        q, k, v = rotate(q, cos, sin).transpose(1, 2), rotate(k, cos, sin).transpose(1, 2), v.transpose(1, 2)
        if self.core is not None:
            out = self.core(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )
        return self.o(out.transpose(1, 2).flatten(-2))


class Block(nn.Module):
    def __init__(self, core: bool):
        super().__init__()
        self.ln, self.attn, self.rms = nn.LayerNorm(H, eps=1e-2), SelfAttention(core), nn.RMSNorm(H, eps=1e-2)
        self.fc1, self.fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.ln(x), cos, sin, mask)
        return x + self.fc2(F.gelu(self.fc1(self.rms(x))))


class RopeLM(nn.Module):
    """``forward(ids, targets=None, padding=None)``: ids, targets (next tokens) and padding ``[b, s]``; RoPE
    tables ``[s, d]``, or with padding per sequence ``[b, s, d]``, as the positions are."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, H), nn.Embedding(MAX_S, H)
        self.blocks = nn.ModuleList([Block(core=False), Block(core=True)])
        self.norm, self.head, self.loss = nn.LayerNorm(H), nn.Linear(H, V, bias=False), nn.CrossEntropyLoss()
        cos, sin = rope_tables(MAX_S, D, 100.0, dtype=F64)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids, targets=None, padding=None):
        s = ids.shape[1]
        positions, mask = torch.arange(s), None
        if padding is not None:  # positions count each sequence's tokens; SDPA's mask [b, 1, s, s]
            positions = (padding.cumsum(1) - 1).clamp(min=0)
            mask = torch.ones(s, s, dtype=torch.bool).tril() & padding.bool()[:, None, None, :]
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, self.cos[positions], self.sin[positions], mask)
        logits = self.head(self.norm(x))
        return logits if targets is None else self.loss(logits.flatten(0, -2), targets.flatten())


def plan(attention: bool = True, entries: dict | None = None) -> Plan:
    rules = {
        "tok": VocabEmbedding(),
        "pos": PositionEmbedding(),
        "blocks.*.ln": Norm("z"),
        "blocks.*.attn.[qkv]": Linear("z"),
        "blocks.*.attn.o": Linear("y"),
        "blocks.*.rms": Norm("z"),
        "blocks.*.fc1": Linear("z"),
        "blocks.*.fc2": Linear("y"),
        "norm": Norm("z"),
        "head": LMHead(),
        "loss": Loss(),
    }
    entries = entries or {
        "blocks.0.attn": Attention(rope=("cos", "sin"), masks=("mask",)),
        "blocks.1.attn": Attention(core="core", rope=("cos", "sin"), masks=("mask",)),
    }
    return Plan(rules, checkpoint=("blocks.*",), attention=entries if attention else {})


def dense_model() -> nn.Module:
    torch.manual_seed(1)
    model = RopeLM().to(F64)
    with torch.no_grad():  # no unit norms, no zero biases
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def inputs(grid, b: int, s: int, padded: bool) -> dict:
    """Fresh ids and next-token targets per dp replica, some ignored; a padding mask (a right-padded
    sequence, a hole in another) when ``padded``."""
    torch.manual_seed(seed_for(grid, 2))
    call = {"ids": torch.randint(0, V, (b, s)), "targets": torch.randint(0, V, (b, s))}
    call["targets"][0, 3] = -100
    if padded:
        padding = torch.ones(b, s, dtype=torch.long)
        padding[0, 11:] = 0
        padding[1, 4:6] = 0
        call["targets"][padding == 0] = -100
        call["padding"] = padding
    return call


def equivalence(grid, dense, b: int, s: int, padded: bool, checkpointing: bool = False) -> dict:
    """Logits, loss and every gradient of the parallelized model on token rows against the dense model."""
    call = inputs(grid, b, s, padded)
    ref = copy.deepcopy(dense)
    ref_logits = ref(call["ids"], padding=call.get("padding")).detach()
    ref_loss = ref(**call)
    ref_loss.backward()
    model = parallelize(copy.deepcopy(dense), plan(), grid=grid)
    set_options(model, activation_checkpointing=checkpointing)
    with torch.no_grad():
        logits = gather_activation(model(call["ids"], padding=call.get("padding")), "y", grid)
        logits = TokenRows(b, s, grid).restore(logits) if choose_rows(b, s, grid) == "tokens" else logits
    loss = model(**call)
    loss.backward()
    errs = {"loss": rel(loss.detach(), ref_loss.detach()), "logits": rel(logits[..., :V], ref_logits)}
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    grads = dense_state_dict(model)
    errs.update({"d" + k: rel(grads[k], p.grad) for k, p in ref.named_parameters()})
    name = f"b{b}{'_padded' if padded else ''}{'_checkpointed' if checkpointing else ''}"
    return {f"{name}_{k}": e for k, e in errs.items()}


def refusals(grid, dense) -> dict:
    """0 where the call raises a ValueError naming the fix."""
    call = inputs(grid, 1, 16, False)
    whole_only = parallelize(copy.deepcopy(dense), plan(attention=False), grid=grid)
    model = parallelize(copy.deepcopy(dense), plan(), grid=grid)
    expected = {
        "no_attention": (
            lambda: whole_only(**call),
            "a batch of 1 sequences does not split into whole-sequence rows",
            "lcm(px·py, px·pz) = 4",
            "Attention()",
        ),
        "tokens_without_attention": (
            lambda: parallelize(
                copy.deepcopy(dense), plan(attention=False), grid=grid, options=RuntimeOptions(rows="tokens")
            )(**inputs(grid, 4, 16, False)),
            "runs with RuntimeOptions(rows='tokens'), but its plan names no attention modules",
            "Attention()",
        ),
        "sliced_targets": (
            lambda: model(call["ids"], call["targets"][:, 1:]),
            "one target per token",
            "shift the labels before the model",
        ),
        "rope_argument": (
            lambda: parallelize(
                dense, plan(entries={"blocks.*.attn": Attention(rope=("freqs",))}), grid=grid
            ),
            "blocks.0.attn (SelfAttention)",
            "names ['freqs'], which its forward does not take",
        ),
        "core": (
            lambda: parallelize(dense, plan(entries={"blocks.*.attn": Attention(core="sdpa")}), grid=grid),
            "Attention(core='sdpa') names no callable attribute",
        ),
    }
    errs = {
        k: float(not all(n in value_error(fn) for n in needles)) for k, (fn, *needles) in expected.items()
    }
    errs["untouched"] = float(type(dense.tok) is not nn.Embedding)  # refused before the model changed
    return errs


def plan_token_rows_job(grid) -> dict:
    dense = dense_model()
    errs = equivalence(grid, dense, 1, 16, False)
    if grid.size("y") == 2:
        return {**errs, **equivalence(grid, dense, 3, 16, True)}
    # the blocks recomputed in backward run on their forward's rows; whole sequences take the same masks
    errs.update(equivalence(grid, dense, 3, 16, True, checkpointing=True))
    errs.update(equivalence(grid, dense, 4, 16, True))
    errs.update({f"refused_{k}": e for k, e in refusals(grid, dense).items()})
    return errs


def test_explicit_plan_on_token_rows_equals_dense():
    assert_close(harness.run(8, on_grids, GRIDS, plan_token_rows_job), tol=1e-9)
