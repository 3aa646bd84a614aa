"""GPT3D equals DenseGPT on every grid (float64): logits, loss, every parameter gradient; generation, padding,
checkpointing, import."""

import itertools
from functools import partial

import harness
import pytest
import torch
import torch.distributed as dist
from checks import (
    GRIDS_8,
    assert_close,
    local,
    nodes_named,
    on_grids,
    rel,
    seed_for,
    sums_replicas,
    value_error,
)

from lightning_3d.layout import gather_activation
from lightning_3d.models import (
    GPT3D,
    DenseGPT,
    FusedLinear3D,
    GPTConfig,
    dense_state_dict_from_hf,
    gpt_config_from_hf,
)
from lightning_3d.options import RuntimeOptions
from lightning_3d.parallel import set_options
from lightning_3d.sharding import get_spec, unshard_tensor

# Tiny and distinct sizes: vocab 50 (padded to 64), width 16, 4 heads, MLP 64 (gpt2) / 24 (llama),
# batch 4 (a multiple of every grid's lcm(px·py, px·pz)), sequence 8 of block 12.
V, B, S = 50, 4, 8
BASE = dict(vocab_size=V, block_size=12, n_layer=2, n_head=4, n_embd=16)
STYLES = {"gpt2": dict(style="gpt2"), "llama": dict(style="llama", tie_embeddings=False, ffn_hidden=24)}
GQA = dict(
    style="llama", tie_embeddings=False, ffn_hidden=24, n_kv_head=2
)  # 2 query heads per key/value head
GRIDS = [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 2, 2)]  # in a world of 8: dp = 8, 4, 2, 1
F64 = torch.float64


def config(style, **kw) -> GPTConfig:
    return GPTConfig(**{**BASE, **(GQA if style == "gqa" else STYLES[style]), **kw})


def pair(grid, cfg, seed, dtype=F64, options=None):
    """A DenseGPT with perturbed weights (no zero biases, no unit norms) and the GPT3D holding them."""
    torch.manual_seed(seed)
    dense = DenseGPT(cfg, dtype=dtype)
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = GPT3D(cfg, grid, dtype=dtype, options=options)
    model.load_dense_state_dict(dense.state_dict())
    return dense, model


def batch(grid, seed):
    """Fresh ids and targets per dp replica, some targets ignored."""
    torch.manual_seed(seed_for(grid, seed))
    idx, targets = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
    targets[0, 0] = targets[-1, 3] = -100
    return idx, targets


def full_logits(model, idx):
    return gather_activation(model(idx), "y", model.grid)


def grads_as_dense(model) -> dict:
    """Every parameter's gradient, exported under the dense keys (overwrites the weights)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    return model.dense_state_dict()


def equivalence(grid, style, options=None, models=None):
    """Relative errors of GPT3D against DenseGPT; the model is appended to ``models`` when given."""
    dense, model = pair(grid, config(style), 1, options=options)
    if models is not None:
        models.append(model)
    idx, targets = batch(grid, 2)
    ref_logits = dense(idx).detach()
    ref_loss = dense(idx, targets)
    ref_loss.backward()
    with torch.no_grad():
        logits = full_logits(model, idx)
    loss = model(idx, targets)
    sums = nodes_named(loss, "_SumGradsOverReplicasBackward")
    loss.backward()
    wte = model.transformer.wte.weight
    errs = {
        "one_replica_sum_per_step": float(sums != int(sums_replicas(model.modules(), grid))),
        "logits": rel(logits[..., :V], ref_logits),
        "loss": rel(loss.detach(), ref_loss.detach()),
        "padded_logits_masked": float(not (logits[..., V:] == torch.finfo(F64).min).all()),
        "padded_rows_no_grad": float(unshard_tensor(wte.grad, get_spec(wte), grid)[V:].abs().max()),
    }
    grads = grads_as_dense(model)
    errs.update({"d" + k: rel(grads[k], p.grad) for k, p in dense.named_parameters()})
    return {f"{style}_{k}": e for k, e in errs.items()}


def checkpointing(grid, style):
    """With dropout, recomputing each block gives the same loss and gradients as keeping activations."""
    _, model = pair(grid, config(style, dropout=0.2), 3)
    idx, targets = batch(grid, 4)
    calls = []
    model.transformer.h[0].attn.register_forward_pre_hook(lambda *_: calls.append(1))
    runs = []
    for ckpt in (False, True):
        model.zero_grad()
        set_options(model, activation_checkpointing=ckpt)
        calls.clear()
        torch.manual_seed(5)
        loss = model(idx, targets)
        loss.backward()
        grads = [unshard_tensor(p.grad, get_spec(p), grid) for p in model.parameters()]  # a shard's may be 0
        runs.append((loss.detach(), grads, len(calls)))
    torch.manual_seed(6)
    with torch.no_grad():
        loss_other_masks = model(idx, targets)
    (loss0, grads0, calls0), (loss1, grads1, calls1) = runs
    errs = {
        "loss": rel(loss1, loss0),
        "block_recomputed": float((calls0, calls1) != (1, 2)),
        "dropout_active": float(abs(loss0 - loss_other_masks) < 1e-6),
    }
    errs.update({f"grad{n}": rel(g1, g0) for n, (g0, g1) in enumerate(zip(grads0, grads1))})
    return {f"{style}_ckpt_{k}": e for k, e in errs.items()}


def model_job(grid):
    return {
        k: e for style in STYLES for job in (equivalence, checkpointing) for k, e in job(grid, style).items()
    }


def test_gpt3d_equals_dense_on_grids():
    assert_close(harness.run(8, on_grids, GRIDS, model_job), tol=1e-9)


def async_tp_job(grid):
    return {
        k: e for style in STYLES for k, e in equivalence(grid, style, RuntimeOptions(async_tp=True)).items()
    }


def test_gpt3d_equals_dense_with_async_tp():
    """Collective matmuls (biases added on one rank inside the fused products) change nothing."""
    assert_close(harness.run(8, on_grids, GRIDS, async_tp_job), tol=1e-9)


def gqa_job(grid):
    """Grouped-query attention (2 query heads per key/value head), eager and with collective matmuls."""
    errs = equivalence(grid, "gqa")
    errs.update({f"async_{k}": e for k, e in equivalence(grid, "gqa", RuntimeOptions(async_tp=True)).items()})
    return errs


def test_gpt3d_with_grouped_query_attention_equals_dense_on_grids():
    assert_close(harness.run(8, on_grids, GRIDS, gqa_job), tol=1e-9)


def test_dense_grouped_query_attention_equals_hf_llama():
    """DenseGPT's packing of query slots computes what transformers' Llama computes with the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = config("gqa")
    hf = (
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=V,
                hidden_size=16,
                intermediate_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=12,
                rms_norm_eps=cfg.norm_eps,
                rope_theta=cfg.rope_theta,
                tie_word_embeddings=False,
                attn_implementation="eager",
            )
        )
        .to(F64)
        .eval()
    )
    torch.manual_seed(12)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    r, d = cfg.queries_per_kv, cfg.head_dim
    hs = hf.state_dict()
    state = {
        "transformer.wte.weight": hs["model.embed_tokens.weight"],
        "transformer.ln_f.weight": hs["model.norm.weight"],
        "lm_head.weight": hs["lm_head.weight"],
    }
    for i in range(cfg.n_layer):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        q = (
            hs[src + "self_attn.q_proj.weight"]
            .unflatten(0, (cfg.n_kv_head, r, d))
            .transpose(0, 1)
            .flatten(0, 2)
        )  # HF head t·r+g → slot g, row t
        state.update(
            {
                dst + "attn.c_attn.weight": torch.cat(
                    [q, hs[src + "self_attn.k_proj.weight"], hs[src + "self_attn.v_proj.weight"]]
                ),
                dst + "attn.c_proj.weight": hs[src + "self_attn.o_proj.weight"],
                dst + "mlp.c_fc.weight": torch.cat(
                    [hs[src + "mlp.gate_proj.weight"], hs[src + "mlp.up_proj.weight"]]
                ),
                dst + "mlp.c_proj.weight": hs[src + "mlp.down_proj.weight"],
                dst + "ln_1.weight": hs[src + "input_layernorm.weight"],
                dst + "ln_2.weight": hs[src + "post_attention_layernorm.weight"],
            }
        )
    dense = DenseGPT(cfg, dtype=F64)
    dense.load_state_dict(state)
    idx = torch.randint(0, V, (B, S))
    with torch.no_grad():
        assert (
            rel(dense(idx), hf(idx, use_cache=False).logits) < 1e-6
        )  # transformers computes RoPE's angles in float32
        state["transformer.h.0.attn.c_attn.weight"] = torch.cat(
            [
                hs["model.layers.0.self_attn.q_proj.weight"],
                hs["model.layers.0.self_attn.k_proj.weight"],
                hs["model.layers.0.self_attn.v_proj.weight"],
            ]
        )
        dense.load_state_dict(
            state
        )  # query heads left in transformers' order: the pairing with kv heads differs
        assert rel(dense(idx), hf(idx, use_cache=False).logits) > 1e-3


def test_gpt3d_equals_dense_on_2x1x1_with_dp2():
    assert_close(harness.run(4, on_grids, [(2, 1, 1)], model_job), tol=1e-9)


def adamw_job(grid):
    """10 AdamW steps on one batch: the same loss every step as DenseGPT's, and the loss falls."""
    errs = {}
    idx, targets = batch(grid, 7)
    for style in STYLES:
        dense, model = pair(grid, config(style), 6)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (dense, model)]
        history = []
        for step in range(10):
            losses = []
            for m, opt in zip((dense, model), opts):
                opt.zero_grad()
                loss = m(idx, targets)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            errs[f"{style}_step{step}"] = rel(losses[1], losses[0])
            history.append(float(losses[0]))
        errs[f"{style}_loss_falls"] = float(not history[-1] < history[0] - 0.5)
    return errs


def test_adamw_steps_match_dense_on_2x2x2():
    assert_close(harness.run(8, on_grids, [(2, 2, 2)], adamw_job), tol=1e-6)


def hf_job(grid, hf_config, hf_state_dict, idx, hf_logits):
    cfg = gpt_config_from_hf(hf_config)
    model = GPT3D(cfg, grid)
    model.load_dense_state_dict(dense_state_dict_from_hf(hf_state_dict, cfg.tie_embeddings))
    with torch.no_grad():
        return {"hf_logits": rel(full_logits(model, idx)[..., :V], hf_logits)}


def test_hf_gpt2_import():
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_config = GPT2Config(
        vocab_size=V,
        n_positions=12,
        n_embd=16,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(8)
    hf = GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: perturb so their mapping is tested
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        idx = torch.randint(0, V, (B, S))
        hf_logits = hf(idx).logits
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    results = harness.run(
        8, on_grids, [(1, 1, 1), (1, 2, 2), (2, 2, 2)], hf_job, hf_config.to_dict(), state, idx, hf_logits
    )
    assert_close(results, tol=1e-5)


def bf16_job(grid):
    """A bf16 autocast training step runs (llama: with activation checkpointing); its loss is within
    2% of the float32 loss and the embedding's gradient (reduced in bf16 where px > 1) within 5% of
    the float32 gradient, in float32."""
    errs = {}
    for style in STYLES:
        _, model = pair(grid, config(style), 9, dtype=torch.float32)
        set_options(model, activation_checkpointing=style == "llama")
        idx, targets = batch(grid, 10)
        embedding = model.transformer.wte.weight
        loss32 = model(idx, targets)
        loss32.backward()
        grad32, embedding.grad = embedding.grad, None
        model.zero_grad()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx)
            loss16 = model(idx, targets)
        loss16.backward()
        errs[f"{style}_embedding_grad_rel"] = rel(embedding.grad, grad32) / 0.05
        errs[f"{style}_embedding_grad_fp32"] = float(embedding.grad.dtype != torch.float32)
        opt.step()
        errs[f"{style}_loss_rel"] = rel(loss16.detach(), loss32.detach()) / 0.02
        errs[f"{style}_ran_in_bf16"] = float(logits.dtype != torch.bfloat16)
        errs[f"{style}_finite"] = float(not all(p.isfinite().all() for p in model.parameters()))
    return errs


def test_bf16_autocast_step():
    assert_close(harness.run(8, on_grids, [(1, 2, 2), (2, 2, 2)], bf16_job), tol=1.0)


def errors_job(grid):
    """Construction and forward checks on 2×2×2: each message names the numbers and the fix."""
    model = GPT3D(config("gpt2"), grid, dtype=F64)
    return {
        "heads": value_error(lambda: GPT3D(GPTConfig(**{**BASE, "n_head": 1, "n_embd": 16}), grid)),
        "kv_heads": value_error(lambda: GPT3D(config("llama", n_kv_head=1), grid)),
        "width": value_error(lambda: GPT3D(GPTConfig(**{**BASE, "n_head": 2, "n_embd": 18}), grid)),
        "ffn": value_error(lambda: GPT3D(config("llama", ffn_hidden=18), grid)),
        "batch": value_error(lambda: model(torch.zeros(2, 6, dtype=torch.long))),
        "seq": value_error(lambda: model(torch.zeros(B, 13, dtype=torch.long))),
        "ids": value_error(lambda: model(torch.zeros(B, S))),
    }


def test_checks_raise_value_errors_with_numbers_and_fix():
    msgs = harness.run(8, on_grids, [(2, 2, 2)], errors_job)[0][(2, 2, 2)]
    expected = {
        "heads": ["n_head = 1", "py", "= 2", "multiple of 2"],
        "kv_heads": ["n_kv_head = 1", "py", "= 2", "multiple of 2"],
        "width": ["n_embd = 18", "px·py", "= 4", "multiple of 4"],
        "ffn": ["ffn_hidden = 18", "multiple of 4"],
        "batch": [
            "2 sequences of 6 tokens",
            "lcm(2·px·pz, px·py) = ",
            "pad each sequence to 8",
            "multiple of 4",
        ],
        "seq": ["13", "block_size 12", "crop"],
        "ids": ["integer token ids"],
    }
    for what, parts in expected.items():
        assert all(p in msgs[what] for p in parts), f"{what}: {msgs[what]!r} lacks one of {parts}"
    for bad, fix in [
        (dict(style="bert"), "style"),
        (dict(n_embd=18), "n_head"),
        (dict(n_embd=12, n_head=4, style="llama"), "even"),
        (dict(n_kv_head=3), "divisors of 4"),
    ]:
        with pytest.raises(ValueError, match=fix):
            GPTConfig(**{**BASE, **bad})


def generate_job(grid):
    """Greedy decoding equals DenseGPT's; sampled tokens agree across the cube though the ranks' RNGs differ."""
    out = {}
    for style in STYLES:
        dense, model = pair(grid, config(style), 11)
        model.eval()
        torch.manual_seed(12)
        idx = torch.randint(0, V, (3, 5))  # batch 3: padded to the grid's multiple inside generate
        greedy = model.generate(idx, 4, top_k=1)
        out[f"{style}_greedy_equal"] = bool(torch.equal(greedy, dense.generate(idx, 4, top_k=1)))
        torch.manual_seed(100 + dist.get_rank())
        out[f"{style}_sampled"] = model.generate(idx, 8, temperature=1e3)[:, 5:]  # near-uniform draws
        out[f"{style}_top_k"] = model.generate(idx, 4, top_k=3)[:, 5:]
    out["cube"] = grid.coord("dp")
    return out


def test_generate_agrees_across_cube():
    grids = [(2, 1, 1), (2, 2, 2)]
    results = harness.run(8, on_grids, grids, generate_job)
    for g in grids:
        per_rank = [r[g] for r in results]
        for style in STYLES:
            assert all(r[f"{style}_greedy_equal"] for r in per_rank), (g, style)
            for what in ("sampled", "top_k"):
                key = f"{style}_{what}"
                for r in per_rank:
                    first = next(o for o in per_rank if o["cube"] == r["cube"])
                    assert torch.equal(r[key], first[key]), (g, key, "cube ranks disagree")
            sampled = torch.stack([r[f"{style}_sampled"] for r in per_rank])
            assert sampled.max() < V, f"{g} {style}: a padded vocabulary id was generated"
            assert len(sampled.unique()) > 10, f"{g} {style}: temperature 1e3 should draw nearly uniformly"


def roundtrip_job(grid, other_shape):
    """Same seed → same weights as DenseGPT; dense export from one grid loads on another and exports back equal."""
    errs = {}
    for style in STYLES:
        cfg = config(style)
        torch.manual_seed(13)
        dense = DenseGPT(cfg, dtype=F64)
        torch.manual_seed(13)
        model = GPT3D(cfg, grid, dtype=F64)
        sd = model.dense_state_dict()
        ref = dense.state_dict()
        errs[f"{style}_keys"] = float(list(sd) != list(ref))
        errs.update({f"{style}_init_{k}": float((sd[k] - ref[k]).abs().max()) for k in ref})
        other = GPT3D(cfg, harness.grid(other_shape), dtype=F64)
        other.load_dense_state_dict(sd)
        back = other.dense_state_dict()
        errs.update({f"{style}_back_{k}": float((back[k] - sd[k]).abs().max()) for k in ref})
        try:
            other.load_dense_state_dict({k: v for k, v in sd.items() if k != "transformer.ln_f.weight"})
            errs[f"{style}_strict"] = 1.0
        except KeyError:
            errs[f"{style}_strict"] = 0.0
    return errs


def test_dense_state_dict_roundtrip_across_grids():
    assert_close(harness.run(8, on_grids, [(2, 2, 2)], roundtrip_job, (1, 2, 2)), tol=1e-15)


def fused_linear_job(grid):
    """FusedLinear3D equals nn.Linear(in, groups·out) chunked into groups, for both input layouts,
    its output chunked and cut by ``forward_groups`` (each group in px blocks, views of the product;
    on one rank: one contiguous output per run of groups)."""
    errs = {}
    n, k, groups = 8, 12, 3
    for (layout, out_layout), split in itertools.product((("z", "y"), ("y", "z")), ("chunk", "groups")):
        torch.manual_seed(14)
        dense = torch.nn.Linear(n, groups * k).to(F64)
        mod = FusedLinear3D(n, k, groups, input_layout=layout, grid=grid, dtype=F64)
        mod.load_dense_state_dict(dense.state_dict())
        torch.manual_seed(seed_for(grid, 15))
        x_full = torch.randn(B, 3, n, dtype=F64).requires_grad_()
        y_ref = dense(x_full).unflatten(-1, (groups, k)).movedim(-2, 0)  # [groups, B, 3, k]
        w = torch.randn_like(y_ref)
        (y_ref * w).sum().backward()
        x = local(x_full.detach(), layout, grid).clone().requires_grad_()
        if split == "chunk":
            outputs = mod(x).chunk(groups, -1)
        else:  # runs of 2 groups and 1: the first cut in two
            errs["runs_checked"] = float(
                "sum to 2, not to the 3 groups" not in value_error(partial(mod.forward_groups, x, (1, 1)))
            )
            first, last = mod.forward_groups(x, (2, 1))  # [..., P, run, k/P]
            blocks = 1 if grid.cube_size == 1 else grid.size("x")
            errs["runs_shaped"] = float(first.shape[-3:-1] != (blocks, 2) or last.shape[-3:-1] != (blocks, 1))
            if grid.cube_size == 1:  # a product each
                errs["runs_contiguous"] = float(not (first.is_contiguous() and last.is_contiguous()))
            else:  # views of one product, not a copy in the packed order
                errs["runs_views"] = float(first._base is None or first._base is not last._base)
            outputs = tuple(t.select(-2, g).flatten(-2) for t in (first, last) for g in range(t.shape[-2]))
        y = torch.stack(outputs)
        (y * torch.stack([local(wg, out_layout, grid) for wg in w])).sum().backward()
        errs[f"{layout}_{split}_out"] = rel(
            y.detach(), torch.stack([local(yg, out_layout, grid) for yg in y_ref.detach()])
        )
        errs[f"{layout}_{split}_dx"] = rel(x.grad, local(x_full.grad, layout, grid))
        grads = grads_as_dense(mod)
        errs.update(
            {f"{layout}_{split}_d{name}": rel(grads[name], p.grad) for name, p in dense.named_parameters()}
        )
    return errs


def test_fused_linear3d():
    assert_close(harness.run(8, on_grids, GRIDS_8, fused_linear_job))
