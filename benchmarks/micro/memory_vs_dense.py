"""Memory of a model parallelized on a 1×1×1 grid against its dense twin, on one device.

Three cases, each trained by both models from the same weights with bf16 autocast, AdamW and
every Transformer block compiled (``torch.compile`` per block: the dense twin's blocks and its loss
as torchtitan compiles them, the parallelized model's by ``RuntimeOptions(compile=True)``, which
compiles its blocks and its loss's local passes):

- ``gpt2``: :class:`~lightning_3d.models.DenseGPT` GPT-2 1.4B (24 layers, h 2048) vs :class:`GPT3D`;
- ``llama``: DenseGPT at Llama-7B shapes, 8 layers, vs GPT3D;
- ``hf-llama``: a ``transformers`` ``LlamaForCausalLM`` (h 2048, 16 layers) vs ``parallelize`` of it.

Per model: the peak allocated memory over the measured steps (CUDA), the median step time, and the
bytes autograd keeps for backward after one forward, read from the autograd graph (each storage
once; parameters and views of them cost nothing and are counted apart), by category (the node that
saved it and the dtype). ``--snapshot`` adds, from one more (untimed) step recorded by
``torch.cuda.memory._record_memory_history``, the largest allocation sites live at its peak.
``--cpu``: tiny shapes, eager (``--compile`` to compile anyway), the peak of the bytes a step's
tensors hold instead of CUDA's peak (:class:`LiveBytes`), no timing worth reading; the saved bytes
are exact at any shape.

    PYTHONPATH=. python benchmarks/micro/memory_vs_dense.py --cases gpt2 --snapshot --out OUT   # one GPU
    PYTHONPATH=. python benchmarks/micro/memory_vs_dense.py --cpu --cases llama --out OUT
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
import weakref
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

GIB = 2**30
MIB = 2**20

CASES = {  # name: (model fields, batch, seq)
    "gpt2": ({"style": "gpt2", "vocab_size": 50304, "n_embd": 2048, "n_head": 16, "n_layer": 24}, 8, 2048),
    "llama": (
        {
            "style": "llama",
            "vocab_size": 32000,
            "n_embd": 4096,
            "n_head": 32,
            "n_kv_head": 8,
            "n_layer": 8,
            "ffn_hidden": 11008,
        },
        8,
        2048,
    ),
    "hf-llama": (
        {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "num_hidden_layers": 16,
            "vocab_size": 32000,
        },
        4,
        2048,
    ),
}
TINY = {
    "gpt2": ({"style": "gpt2", "vocab_size": 256, "n_embd": 64, "n_head": 4, "n_layer": 2}, 4, 32),
    "llama": (
        {
            "style": "llama",
            "vocab_size": 256,
            "n_embd": 64,
            "n_head": 4,
            "n_kv_head": 2,
            "n_layer": 2,
            "ffn_hidden": 96,
        },
        4,
        32,
    ),
    "hf-llama": (
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": 256,
        },
        4,
        32,
    ),
}


def init_single_process(cpu: bool) -> None:
    """A process group of one rank (the 1×1×1 grid's), gloo on CPU, NCCL on CUDA."""
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo" if cpu else "nccl", store=store, rank=0, world_size=1)


# ---------------------------------------------------------------- models


def gpt_pair(fields: dict, seq: int, device, compile_: bool):
    """(dense, twin, loss) for GPT ``fields``: DenseGPT with each block compiled, and ``twin(dense)``,
    which makes GPT3D with ``RuntimeOptions(compile=...)`` holding the dense model's weights."""
    import lightning_3d
    from lightning_3d.models import GPT3D, DenseGPT, GPTConfig

    config = GPTConfig(block_size=seq, **fields)
    torch.manual_seed(0)
    dense = DenseGPT(config, device=device)
    if compile_:
        for i, block in enumerate(dense.transformer.h):
            dense.transformer.h[i] = torch.compile(block)
        dense.loss = torch.compile(
            dense.loss
        )  # as torchtitan compiles its loss; GPT3D compiles its loss's local passes

    def twin(dense):
        model = GPT3D(config, device=device, options=lightning_3d.RuntimeOptions(compile=compile_))
        model.load_dense_state_dict({k.replace("_orig_mod.", ""): v for k, v in dense.state_dict().items()})
        return model

    return dense, twin, lambda model, ids: model(ids[:, :-1], ids[:, 1:])


def hf_pair(fields: dict, seq: int, device, compile_: bool):
    """(dense, twin, loss) for ``LlamaForCausalLM`` ``fields``: each decoder layer compiled, and
    ``twin(dense)``, its ``parallelize``d copy with ``RuntimeOptions(compile=...)``; the loss is
    transformers' (labels)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import lightning_3d
    from lightning_3d.parallel import parallelize

    torch.manual_seed(0)
    config = LlamaConfig(**fields, max_position_embeddings=seq, tie_word_embeddings=False, use_cache=False)
    base = LlamaForCausalLM(config)  # on the host until the twin is made: the dense model is measured alone
    dense = copy.deepcopy(base).to(device)
    if compile_:
        for i, layer in enumerate(dense.model.layers):
            dense.model.layers[i] = torch.compile(layer)
        dense.loss_function = torch.compile(dense.loss_function)

    def twin(_dense):
        return parallelize(base.to(device), options=lightning_3d.RuntimeOptions(compile=compile_))

    return dense, twin, lambda model, ids: model(input_ids=ids, labels=ids, use_cache=False).loss


# ---------------------------------------------------------------- saved tensors


def _saved_of(node) -> list[torch.Tensor]:
    """The tensors autograd ``node`` keeps for backward (a custom Function's ``saved_tensors``, a
    built-in node's ``_saved_*`` fields)."""
    out = []
    try:
        saved = getattr(node, "saved_tensors", None)
    except RuntimeError:
        saved = None
    if saved is not None:
        return [t for t in saved if isinstance(t, torch.Tensor)]
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:
            continue
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def saved_for_backward(loss: torch.Tensor, params: list[torch.Tensor]) -> dict:
    """Bytes autograd holds for ``loss``'s backward, each storage once, by category.

    A category is ``node: dtype``, the first node (breadth first from the loss) that saves the
    storage; a storage that is a parameter's goes to ``parameters`` (it lives anyway).
    """
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen, by_cat, tensors = set(), Counter(), []
    queue, visited = [loss.grad_fn], set()
    while queue:
        node = queue.pop(0)
        if node is None or node in visited:
            continue
        visited.add(node)
        for t in _saved_of(node):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            name = type(node).__name__
            cat = "parameters" if key in param_storages else f"{name}: {str(t.dtype).replace('torch.', '')}"
            by_cat[cat] += storage.nbytes()
            tensors.append(
                {
                    "node": name,
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).replace("torch.", ""),
                    "bytes": storage.nbytes(),
                    "parameter": key in param_storages,
                }
            )
        queue.extend(n for n, _ in node.next_functions)
    total = sum(v for k, v in by_cat.items() if k != "parameters")
    return {"total": total, "by_category": dict(by_cat.most_common()), "tensors": tensors}


# ---------------------------------------------------------------- live bytes on CPU


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes that tensors made under this mode hold (each storage once, until
    freed; ``kept``'s storages, the parameters and optimizer state, left out), and what was live
    at the peak: the CPU's stand-in for CUDA's peak allocated memory. Compiled code allocates
    outside the dispatcher, so the step it tracks runs eagerly (Dynamo does not trace under it)."""

    def __init__(self, kept: list[torch.Tensor]):
        super().__init__()
        self.live, self.now, self.peak, self.at_peak = {}, 0, 0, []
        self.kept = {t.untyped_storage().data_ptr() for t in kept}  # the persistent state, not counted

    def _freed(self, key: int) -> None:
        nbytes, _ = self.live.pop(key)
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or key in self.kept or storage.nbytes() == 0:
                continue
            self.live[key] = (
                storage.nbytes(),
                f"{func.__name__} {list(t.shape)} {str(t.dtype).replace('torch.', '')}",
            )
            weakref.finalize(storage, self._freed, key)
            self.now += storage.nbytes()
            if self.now > self.peak:
                self.peak = self.now
                self.at_peak = list(self.live.values())
        return out

    def top_at_peak(self, top: int = 12) -> list[dict]:
        sites = Counter()
        for nbytes, what in self.at_peak:
            sites[what] += nbytes
        return [{"site": k, "mib": round(v / MIB, 3)} for k, v in sites.most_common(top)]


# ---------------------------------------------------------------- training


def measure(model, loss_of, ids, *, cpu: bool, warmup: int, steps: int, snapshot: bool) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    autocast = torch.autocast("cpu" if cpu else "cuda", dtype=torch.bfloat16)
    sync = (lambda: None) if cpu else torch.cuda.synchronize

    def step():
        with autocast:
            loss = loss_of(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    with autocast:  # a forward to read the graph: what the measured steps save
        loss = loss_of(model, ids)
    saved = saved_for_backward(loss, params)
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    del loss
    gc.collect()
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    row = {
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_each": [round(1e3 * t, 2) for t in times],
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "saved_bytes": saved["total"],
        "saved_by_category": saved["by_category"],
    }
    if cpu:
        state = [t for per in optimizer.state.values() for t in per.values() if isinstance(t, torch.Tensor)]
        with LiveBytes(params + state) as live:
            step()
        row["peak_live_bytes"], row["peak_sites"] = live.peak, live.top_at_peak()
    else:
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        if snapshot:  # one more step, untimed, its allocations recorded
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=500_000)
            step()
            sync()
            row["peak_sites"] = peak_sites(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
    row["_tensors"] = saved["tensors"]
    return row


def peak_sites(snap: dict, top: int = 15) -> list[dict]:
    """What the recorded step allocated and still held at its peak, by allocation site (the
    innermost frame in the project, ``transformers`` or Inductor's generated code), largest first:
    the trace's allocations and frees replayed to the peak (memory allocated before the step, the
    parameters and optimizer state, is not in it)."""
    trace = [e for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_requested")]
    now = peak = peak_at = 0
    for i, event in enumerate(trace):
        now += event["size"] if event["action"] == "alloc" else -event["size"]
        if now > peak:
            peak, peak_at = now, i
    live = {}
    for event in trace[: peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        else:
            live.pop(event["addr"], None)
    sites = Counter()
    for event in live.values():
        frames = event.get("frames") or []
        ours = (
            f
            for f in frames
            if any(k in f["filename"] for k in ("lightning_3d", "transformers", "torchinductor", "micro"))
        )
        where = next(ours, frames[0] if frames else None)
        sites[
            "?" if where is None else f"{where['filename'].split('/')[-1]}:{where['line']} {where['name']}"
        ] += event["size"]
    return [{"site": k, "mib": round(v / MIB, 1)} for k, v in sites.most_common(top)]


def free(cpu: bool) -> None:
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()


def run_case(name: str, args) -> dict:
    cpu = args.cpu
    device = torch.device("cpu" if cpu else "cuda")
    fields, batch, seq = (TINY if cpu else CASES)[name]
    batch = args.batch or batch
    seq = args.seq or seq
    if args.layers:
        fields = {**fields, ("num_hidden_layers" if name == "hf-llama" else "n_layer"): args.layers}
    compile_ = args.compile if args.compile is not None else not cpu
    make = hf_pair if name == "hf-llama" else gpt_pair
    torch.manual_seed(1)
    vocab = fields["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq + (name != "hf-llama")), device=device)
    result = {"case": name, "fields": fields, "batch": batch, "seq": seq, "compiled": compile_}
    dense, twin, loss_of = make(fields, seq, device, compile_)
    kw = {"cpu": cpu, "warmup": args.warmup, "steps": args.steps, "snapshot": args.snapshot}
    result["dense"] = measure(dense, loss_of, ids, **kw)
    model = twin(dense)  # the dense model is an argument, held by nothing once deleted here
    del dense
    free(cpu)
    torch.compiler.reset()
    result["3d"] = measure(model, loss_of, ids, **kw)
    del model
    free(cpu)
    torch.compiler.reset()
    d, p = result["dense"], result["3d"]
    result["extra_saved_by_category"] = extra_by_category(d["saved_by_category"], p["saved_by_category"])
    result["ratio"] = {
        "saved": p["saved_bytes"] / max(d["saved_bytes"], 1),
        "step_time": p["step_ms_median"] / d["step_ms_median"],
    }
    peak = "peak_live_bytes" if cpu else "peak_allocated_bytes"
    result["ratio"]["peak"] = p[peak] / d[peak]
    return result


def extra_by_category(dense: dict, parallel: dict) -> dict:
    """Saved bytes by dtype: the parallelized model's minus the dense model's (node names differ)."""

    def by_dtype(cats):
        out = Counter()
        for k, v in cats.items():
            out[k.rsplit(": ", 1)[-1]] += v
        return out

    d, p = by_dtype(dense), by_dtype(parallel)
    return {k: p[k] - d[k] for k in sorted(set(d) | set(p)) if p[k] != d[k]}


def report(result: dict) -> None:
    d, p = result["dense"], result["3d"]
    print(f"\n== {result['case']}: batch {result['batch']} x {result['seq']}, compiled {result['compiled']}")
    for label, row in (("dense", d), ("3d 1x1x1", p)):
        peak = (
            f"peak {row['peak_allocated_bytes'] / GIB:.2f} GiB, "
            if "peak_allocated_bytes" in row
            else f"peak live in a step {row['peak_live_bytes'] / MIB:.2f} MiB, "
        )
        print(
            f"  {label:9s} {peak}saved {row['saved_bytes'] / MIB:.2f} MiB, step {row['step_ms_median']:.1f} ms"
        )
    print("  ratio 3d/dense:", {k: round(v, 4) for k, v in result["ratio"].items()})
    print(
        "  extra saved bytes by dtype (MiB):",
        {k: round(v / MIB, 3) for k, v in result["extra_saved_by_category"].items()},
    )
    for label, row in (("dense", d), ("3d", p)):
        print(
            f"  {label} saved by category (MiB):",
            {k: round(v / MIB, 3) for k, v in row["saved_by_category"].items()},
        )
        print(f"  {label} live at the peak:", row.get("peak_sites"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases", default="gpt2,llama,hf-llama", help="comma-separated, of " + ", ".join(CASES)
    )
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU, eager unless --compile")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="the largest allocation sites live at the peak of one more, recorded step (CUDA)",
    )
    parser.add_argument("--tensors", action="store_true", help="list every saved tensor in the JSON")
    parser.add_argument("--out", help="a folder for memory_vs_dense.json")
    args = parser.parse_args()
    if args.cpu:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    else:
        torch.cuda.set_device(0)
    init_single_process(args.cpu)
    import lightning_3d

    lightning_3d.init_grid((1, 1, 1))
    results = []
    for name in args.cases.split(","):
        result = run_case(name.strip(), args)
        report(result)
        if not args.tensors:
            for side in ("dense", "3d"):
                result[side].pop("_tensors")
        results.append(result)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"torch": torch.__version__, "device": "cpu" if args.cpu else torch.cuda.get_device_name()}
        with open(os.path.join(args.out, "memory_vs_dense.json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
