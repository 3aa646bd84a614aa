"""Hugging Face causal LMs through ``parallelize`` with their built-in plans, against the unmodified model.

One world of 8 sweeps the grids 1×1×1, 2×1×1, 1×2×1, 1×2×2, 2×2×1 (dp 2) and 2×2×2 (the rest of
the world is dp, each replica on its own batch): tiny random ``LlamaForCausalLM`` (GQA: 4 heads,
2 key/value heads; tied head with a padding mask, untied with per-sequence position ids and a
``pad_token_id``, hence an embedding ``padding_idx``) and ``GPT2LMHeadModel`` (padding mask and
per-sequence position ids), in float64. A world of 4 runs Mistral and Qwen2 on Llama's plan and
the refusals (1×2×1, dp 2); ``save_pretrained``, a sharded checkpoint through
``checkpoint_to_pretrained``, ``lightning_3d.hf.from_pretrained``, a bf16-autocast step and
activation checkpointing, also compiled (2×2×1); one step through ``deepspeed_3d.initialize``
(1×2×1, dp 2).
A launched world of 4 trains three AdamW steps under ``Trainer(strategy="tensor3d")``.

The reference is the unmodified model, with two float64 adjustments that leave the model the same:
``LlamaRMSNorm`` computes in float32 by design, so the reference's norms are swapped for
``nn.RMSNorm`` (same weight and eps); and transformers' loss upcasts logits to float32, so the
reference loss is the float64 cross-entropy of the reference logits with transformers' shift.
transformers' own loss is then checked to float32 precision. The reference runs with
``use_cache=False``, as the parallelized model does (with a cache, transformers does not read
packed sequences from position ids).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch
import torch.nn.functional as F
from checks import assert_close, on_grids, rel, seed_for
from torch import nn

from lightning_3d.hf.plans import LLAMA_NORMS
from lightning_3d.layout import gather_activation

B, S, V = 4, 8, 60  # V pads to 64 on grids with px·py = 4
GRIDS = [
    (1, 1, 1),
    (2, 1, 1),
    (1, 2, 1),
    (1, 2, 2),
    (2, 2, 1),
    (2, 2, 2),
]  # in a world of 8: dp = 8, 4, 4, 2, 2, 1
F64 = torch.float64
HF_F32_TOL = 1e-6  # transformers computes its loss (and Llama's norms) in float32


def llama(tied: bool, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(LlamaConfig(**{**sizes, **kw}, tie_word_embeddings=tied))


def gpt2(tied: bool = True, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = dict(
        vocab_size=V,
        n_embd=16,
        n_layer=2,
        n_head=4,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(GPT2Config(**{**sizes, **kw}, tie_word_embeddings=tied))


def mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(
        MistralConfig(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            **kw,
        )
    )


def qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            **kw,
        )
    )


PAD = 0  # the untied Llama's pad_token_id: its embedding's padding_idx
MODELS = {
    "llama_tied": lambda: llama(True),
    "llama_untied": lambda: llama(False, pad_token_id=PAD),
    "gpt2": gpt2,
    "mistral": lambda: mistral(sliding_window=None),
    "qwen2": lambda: qwen2(),
}
SWEPT, LLAMA_LIKE = ("llama_tied", "llama_untied", "gpt2"), ("mistral", "qwen2")
# (padding mask, per-sequence position ids) of each model's batch
INPUTS = {
    "llama_tied": (True, False),
    "llama_untied": (False, True),
    "gpt2": (True, True),
    "mistral": (True, False),
    "qwen2": (False, True),
}


def perturbed(make, seed: int, dtype: torch.dtype = F64) -> nn.Module:
    """The model in ``dtype`` with every parameter moved off its init (no unit norms, no zero biases)."""
    torch.manual_seed(seed)
    model = make().to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def float64_reference(model: nn.Module) -> nn.Module:
    """A copy whose RMSNorms compute in float64 (``LlamaRMSNorm`` and its copies cast to float32 first)."""
    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if type(module).__name__ in LLAMA_NORMS:
            norm = nn.RMSNorm(module.weight.shape[0], eps=module.variance_epsilon, dtype=F64)
            norm.weight = module.weight
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, norm)
    return ref


def batch(grid, seed: int, padded: bool, positions: bool, replica: int | None = None) -> dict:
    """Fresh ids per dp replica (this rank's, or ``replica``'s), labels with ignored tokens, optionally left and
    right padding and shuffled positions."""
    torch.manual_seed(seed_for(grid, seed) if replica is None else seed * 1009 + replica)
    ids = torch.randint(0, V, (B, S))
    ids[1, 4] = PAD  # looked up, passing no gradient to its row where the embedding has padding_idx = PAD
    labels = ids.clone()
    labels[0, 2] = labels[3, 5] = -100
    call = {"input_ids": ids, "labels": labels}
    if padded:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, :3] = 0  # left padding
        mask[2, 6:] = 0  # right padding
        labels[mask == 0] = -100
        call["attention_mask"] = mask
    if positions:
        call["position_ids"] = torch.stack([torch.randperm(16)[:S].sort().values for _ in range(B)])
    return call


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss in float64: position t predicts label t+1."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def equivalence(grid, name: str) -> dict:
    from lightning_3d import dense_state_dict
    from lightning_3d.parallel import parallelize

    dense = perturbed(MODELS[name], 1)
    ref = float64_reference(dense)
    call = batch(grid, 2, *INPUTS[name])
    hf_loss = dense(**call, use_cache=False).loss.detach()  # the parallelized model runs without a KV cache
    ref_logits = ref(**{k: v for k, v in call.items() if k != "labels"}, use_cache=False).logits
    ref_loss = shifted_loss(ref_logits, call["labels"])
    ref_loss.backward()

    model = parallelize(dense, grid=grid)  # in place: ``dense`` is the parallelized model from here on
    out = model(**call)
    out.loss.backward()
    logits = gather_activation(out.logits.detach(), "y", grid)
    errs = {
        "loss": rel(out.loss.detach(), ref_loss.detach()),
        "logits": rel(logits[..., :V], ref_logits.detach()),
        "padded_logits_lowest": float(not (logits[..., V:] == torch.finfo(F64).min).all()),
        "f32_hf_loss": rel(out.loss.detach(), hf_loss),
    }
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    grads = dense_state_dict(model)
    errs.update({"d" + k: rel(grads[k], p.grad) for k, p in ref.named_parameters()})
    return {f"{name}_{k}": e for k, e in errs.items()}


def equivalence_job(grid) -> dict:
    return {k: e for name in SWEPT for k, e in equivalence(grid, name).items()}


# Tolerances by the error name's tag (the first that matches): float64 untagged; a float32 model's gradients
# (through its float32 attention, norms and loss); a float64 model's results against transformers' float32
# computations; bf16 autocast.
TOLERANCES = {"ds_f32_": 1e-5, "f32_": HF_F32_TOL, "bf16_": 3e-2}


def assert_within_tolerances(results: list) -> None:
    """Per-rank {grid: {name: err}} → every error below the tolerance of its tag (float64's 1e-10 untagged)."""

    def tag_of(name: str) -> str:
        return next((t for t in TOLERANCES if t in name), "")

    for tag, tol in (*TOLERANCES.items(), ("", 1e-10)):
        assert_close(
            [
                {g: {k: e for k, e in errs.items() if tag_of(k) == tag} for g, errs in r.items()}
                for r in results
            ],
            tol,
        )


def test_hf_models_equal_dense_on_grids():
    assert_within_tolerances(harness.run(8, on_grids, GRIDS, equivalence_job))


def refused(grid) -> dict:
    """Each unsupported case raises a ValueError naming its numbers or its fix (0: raised as expected)."""
    from lightning_3d.parallel import parallelize

    def message(build, call=None) -> str:
        try:
            model = build()
            if call is not None:
                call(model)
        except ValueError as e:
            return str(e)
        return ""

    def plain():
        return parallelize(perturbed(MODELS["llama_tied"], 3), grid=grid)

    ids = torch.randint(0, V, (B, S))
    expected = {
        "kv_heads": (
            lambda: parallelize(llama(True, num_key_value_heads=1), grid=grid),
            None,
            "1 key/value heads do not split over py = 2",
        ),
        "sliding_window": (
            lambda: parallelize(mistral(sliding_window=4), grid=grid),
            None,
            "sliding_window=4",
        ),
        "attention": (
            lambda: parallelize(llama(True, attn_implementation="flex_attention"), grid=grid),
            None,
            "'flex_attention'",
        ),
        "use_cache": (plain, lambda m: m(ids, use_cache=True), "use_cache=False"),
        "inputs_embeds": (
            plain,
            lambda m: m(inputs_embeds=torch.randn(B, S, 16, dtype=F64)),
            "not inputs_embeds",
        ),
        "batch": (
            plain,
            lambda m: m(ids[:3, :7]),
            "multiple of lcm(2·px·pz, px·py) = 2 (pad each sequence to 8 tokens",
        ),
    }
    errs = {k: float(needle not in message(build, call)) for k, (build, call, needle) in expected.items()}
    untouched = llama(True)
    untouched.extra = torch.nn.Linear(
        2, 2
    )  # no rule maps it: refused after validate, before anything changes
    errs["unmapped"] = float("extra (Linear)" not in message(lambda: parallelize(untouched, grid=grid)))
    attention = untouched.model.layers[0].self_attn
    errs["refused_model_untouched"] = float(
        "loss_function" in vars(untouched)
        or bool(attention._forward_pre_hooks)
        or type(untouched.model.embed_tokens) is not torch.nn.Embedding
    )
    return errs


def llama_like_and_refusals_job(grid) -> dict:
    errs = {k: e for name in LLAMA_LIKE for k, e in equivalence(grid, name).items()}
    errs.update({f"refused_{k}": e for k, e in refused(grid).items()})
    return errs


def test_refusals_and_llama_like_models():
    """Mistral (no sliding window) and Qwen2 (q/k/v biases) run on Llama's plan; unsupported cases are refused."""
    assert_within_tolerances(harness.run(4, on_grids, [(1, 2, 1)], llama_like_and_refusals_job))


def export(grid, folder: str) -> dict:
    """``save_pretrained`` on the grid, and a sharded checkpoint converted by ``checkpoint_to_pretrained`` in one
    process: transformers' ``from_pretrained`` of either folder holds the model's tensors and gives its logits,
    and ``lightning_3d.hf.from_pretrained`` reads the folder back onto the grid as the same model."""
    from transformers import AutoModelForCausalLM

    from lightning_3d import checkpoint as ckpt
    from lightning_3d import dense_state_dict
    from lightning_3d.hf import checkpoint_to_pretrained, from_pretrained, save_pretrained
    from lightning_3d.parallel import parallelize

    errs = {}
    for name in ("llama_tied", "gpt2"):
        model = parallelize(perturbed(MODELS[name], 4), grid=grid)
        save_pretrained(model, f"{folder}/{name}")
        ckpt.save(f"{folder}/{name}.ckpt", {"state_dict": ckpt.model_state(model, grid)}, grid, model)
        ids = batch(grid, 5, False, False)["input_ids"]
        with torch.no_grad():
            logits = gather_activation(model(ids).logits, "y", grid)[..., :V]
        state = dense_state_dict(model)
        streamed = from_pretrained(
            f"{folder}/{name}", grid=grid, dtype=F64
        )  # back onto the grid, a tensor at a time
        with torch.no_grad():
            errs[f"{name}_from_pretrained_logits"] = rel(
                gather_activation(streamed(ids).logits, "y", grid)[..., :V], logits
            )
        errs.update(
            {f"{name}_from_pretrained_{k}": rel(t, state[k]) for k, t in dense_state_dict(streamed).items()}
        )
        if torch.distributed.get_rank() == 0:
            checkpoint_to_pretrained(f"{folder}/{name}.ckpt", f"{folder}/{name}_from_ckpt")
            for route in ("", "_from_ckpt"):
                loaded = AutoModelForCausalLM.from_pretrained(f"{folder}/{name}{route}", dtype=F64)
                with torch.no_grad():
                    ref = loaded(ids, use_cache=False).logits
                tag = (
                    "f32_" if name.startswith("llama") else ""
                )  # the loaded Llama's norms compute in float32
                errs[f"{name}{route}_{tag}logits"] = rel(logits, ref)
                errs[f"{name}{route}_same_class"] = float(type(loaded).__name__ != type(model).__name__)
                errs.update({f"{name}{route}_{k}": rel(state[k], t) for k, t in loaded.state_dict().items()})
    return errs


def bf16_step(grid) -> dict:
    """A float32 model runs a step under bf16 autocast: finite gradients in float32, the loss near float32's."""
    from lightning_3d.parallel import parallelize

    torch.manual_seed(6)
    model = parallelize(llama(False), grid=grid)
    call = batch(grid, 7, True, False)
    with torch.no_grad():
        loss32 = model(**call).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**call).loss
    loss.backward()
    grads_ok = all(
        p.grad.dtype == torch.float32 and p.grad.isfinite().all() and p.grad.abs().sum() > 0
        for p in model.parameters()
    )
    return {"bf16_loss": rel(loss.detach(), loss32), "grads_float32_finite_nonzero": float(not grads_ok)}


def deepspeed_step(grid) -> dict:
    """One step through ``deepspeed_3d.initialize`` (ZeRO-1 over dp, clipping by the global norm): the loss, and
    each weight's update, equal the dense model's clipped SGD step on the same replica batches (float32: Llama's
    norms and transformers' loss compute in float32 on both sides, so the tolerance is float32's)."""
    import deepspeed_3d
    from lightning_3d import dense_state_dict
    from lightning_3d.parallel import parallelize

    os.environ.setdefault(
        "LOCAL_RANK", str(torch.distributed.get_rank())
    )  # DeepSpeed reads it; harness workers are not launched
    dp, lr, clip = grid.data_parallel_size, 0.5, 1.0
    dense = perturbed(MODELS["llama_untied"], 8, torch.float32)
    before = {k: t.clone() for k, t in dense.state_dict().items()}
    model = parallelize(copy.deepcopy(dense), grid=grid)
    config = {
        "train_batch_size": B * dp,
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "tensor3d": {"grid": list(grid.shape)},
    }
    engine, *_ = deepspeed_3d.initialize(
        model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=lr)
    )
    loss = engine(**batch(grid, 9, True, False)).loss
    engine.backward(loss)
    engine.step()
    losses = [dense(**batch(grid, 9, True, False, replica=d), use_cache=False).loss for d in range(dp)]
    torch.stack(losses).mean().backward()
    assert (
        torch.nn.utils.clip_grad_norm_(dense.parameters(), clip) > clip
    )  # the clipping reads the global norm
    with torch.no_grad():
        for p in dense.parameters():
            p -= lr * p.grad
    trained = dense_state_dict(engine.module)
    errs = {"ds_f32_loss": rel(loss.detach(), losses[grid.coord("dp")].detach())}
    errs.update(
        {
            f"ds_f32_update_{k}": rel(trained[k] - before[k], t - before[k])
            for k, t in dense.state_dict().items()
        }
    )
    return errs


def test_deepspeed_initialize_step():
    assert_within_tolerances(harness.run(4, on_grids, [(1, 2, 1)], deepspeed_step))


# Hugging Face's "sdpa" attention in float64 on CPU calls the CPU flash kernel, whose compiled
# backward fails in float64 on torch 2.11 and 2.12: the compiled run needs a later torch
COMPILES_FLOAT64_SDPA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def checkpointing(grid) -> dict:
    """With activation checkpointing on (the plan's decoder layers recomputed), and with them compiled
    (``RuntimeOptions.compile``; from torch 2.13), the same loss and gradients."""
    from lightning_3d.parallel import parallelize, set_options

    model = parallelize(perturbed(MODELS["gpt2"], 10), grid=grid)
    call = batch(grid, 11, True, True)
    calls = []
    model.transformer.h[0].ln_1.register_forward_pre_hook(
        lambda *_: calls.append(1)
    )  # inside the unit: run again in recomputation
    runs = []
    for recompute, compiled in ((False, False), (True, False), (False, True))[
        : 3 if COMPILES_FLOAT64_SDPA else 2
    ]:
        set_options(model, activation_checkpointing=recompute, compile=compiled)
        model.zero_grad()
        calls.clear()
        loss = model(**call).loss
        loss.backward()
        runs.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        runs[-1].append(len(calls))
    *tensors, counts = zip(*runs)
    errs = {
        f"{what}_{i}": rel(t[k], t[0])
        for k, what in ((1, "checkpointing"), (2, "compiled"))[: len(runs) - 1]
        for i, t in enumerate(tensors)
        if t[0].norm() > 0
    }
    return {**errs, "checkpointing_recomputed": float(counts[:2] != (1, 2))}


def export_and_bf16_job(grid, folder: str) -> dict:
    return {**export(grid, folder), **bf16_step(grid), **checkpointing(grid)}


def test_save_pretrained_bf16_autocast_checkpointing_and_compile(tmp_path):
    assert_within_tolerances(harness.run(4, on_grids, [(2, 2, 1)], export_and_bf16_job, str(tmp_path)))


# ----- three AdamW steps under Trainer(strategy="tensor3d"), against the dense model on the same batches -----

SCRIPT = Path(__file__).parent / "lightning_scripts" / "hf_fit.py"
LIGHTNING_TOL = 1e-9


def run_ranks(script: Path, world: int, *args: str, timeout: float = 240) -> None:
    """``script *args`` on ``world`` local ranks (env set as a launcher would); fail with the failed ranks'
    log tails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    root = str(Path(__file__).parent.parent)
    logs, procs = [], []
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": str(world),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
        }
        logs.append(tempfile.TemporaryFile("w+"))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args], env=env, stdout=logs[-1], stderr=subprocess.STDOUT
            )
        )
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            break
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    tails = []
    for r in failed:
        logs[r].seek(0)
        tails.append(f"--- rank {r} ---\n" + "\n".join(logs[r].read().splitlines()[-30:]))
    assert not failed, f"{script.name}: ranks {failed} failed or hung\n" + "\n".join(tails)


def test_lightning_adamw_steps_equal_dense(tmp_path):
    """1×2×1 with dp 2: each step's loss (dp mean) and the weights after 3 steps, saved with ``save_pretrained``
    and converted from the strategy's checkpoint, equal the dense model's trained on the same two replica
    batches per step (the mean of the replicas' losses, as DDP averages)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import hf_fit
    from transformers import AutoModelForCausalLM

    from lightning_3d.hf import checkpoint_to_pretrained

    run_ranks(SCRIPT, 4, str(tmp_path))
    records = [json.loads((tmp_path / f"hf.rank{r}.json").read_text()) for r in range(4)]
    replicas = {rec["dp_rank"]: rec["batches"] for rec in records}
    assert sorted(replicas) == [0, 1] and all(rec["batches"] == replicas[rec["dp_rank"]] for rec in records)
    data, dense = hf_fit.Padded(), float64_reference(hf_fit.llama())
    opt = hf_fit.optimizer(dense.parameters())
    losses = []
    for step in range(hf_fit.STEPS):
        replica_losses = []
        for indices in (replicas[0][step], replicas[1][step]):
            batch = {
                k: torch.stack([data[i][k] for i in indices])
                for k in ("input_ids", "attention_mask", "labels")
            }
            logits = dense(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
            ).logits
            replica_losses.append(shifted_loss(logits, batch["labels"]))
        loss = torch.stack(replica_losses).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for rec in records:
        assert rel(torch.tensor(rec["loss"], dtype=F64), torch.tensor(losses, dtype=F64)) < LIGHTNING_TOL, (
            rec["loss"],
            losses,
        )
    checkpoint_to_pretrained(tmp_path / "last.ckpt", tmp_path / "from_ckpt")  # prefix "model." as recorded
    for folder in ("trained", "from_ckpt"):
        trained = AutoModelForCausalLM.from_pretrained(tmp_path / folder, dtype=F64).state_dict()
        errs = {k: rel(trained[k], t) for k, t in dense.state_dict().items()}
        assert max(errs.values()) < LIGHTNING_TOL, (folder, errs)
