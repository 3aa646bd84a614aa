"""A whole training step on token rows against whole-sequence rows, on one device.

``GPT3D`` at Llama-7B shapes (``--layers`` of them) on a 1×1×1 grid trains one sequence of
``--seq`` tokens a step, compiled per block, bf16 autocast, fused AdamW, twice from the same weights:
with ``RuntimeOptions(rows="sequences")`` and with ``rows="tokens"`` (each sequence cut into
chunk rows and arranged as on a larger grid; on one rank attention still sees the whole sequence).
Each case runs in a process of its own, the order alternating over ``--repeats``; tokens/s (median
step after ``--warmup`` steps) and peak memory per run, their medians and the ratio tokens /
sequences go to ``OUT/token_rows_step.json``. ``--cpu``: tiny shapes, eager, a smoke run.

    PYTHONPATH=. python benchmarks/micro/token_rows_step.py --seq 32768 --out OUT   # one GPU
    PYTHONPATH=. python benchmarks/micro/token_rows_step.py --cpu --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

CASES = ("sequences", "tokens")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny shapes on CPU, eager (smoke)")
    p.add_argument(
        "--seq", type=int, default=None, help="tokens of the one sequence (default 32768; --cpu 64)"
    )
    p.add_argument("--layers", type=int, default=None, help="Llama-7B blocks (default 4; --cpu 2)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one run, in a process of its own
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_case(args) -> dict:
    """One case in this process: a world of one, the model, the timed steps."""
    from lightning_3d import RuntimeOptions, init_grid
    from lightning_3d.models import GPT3D, GPTConfig

    cpu = args.cpu
    device = torch.device("cpu" if cpu else "cuda")
    dist.init_process_group(
        "gloo" if cpu else "nccl", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1
    )
    if not cpu:
        torch.cuda.set_device(0)
    seq, layers = args.seq or (64 if cpu else 32768), args.layers or (2 if cpu else 4)
    sizes = (  # tiny on CPU; Llama-7B's width, heads and MLP on a GPU
        dict(vocab_size=128, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=128)
        if cpu
        else dict(vocab_size=32000, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=11008)
    )
    config = GPTConfig(block_size=seq, n_layer=layers, style="llama", tie_embeddings=False, **sizes)
    grid = init_grid((1, 1, 1), device_type=device.type)
    torch.manual_seed(0)
    model = GPT3D(config, grid, device=device, options=RuntimeOptions(rows=args.case, compile=not cpu))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not cpu)
    ids = torch.randint(
        0, config.vocab_size, (1, seq + 1), device=device, generator=torch.Generator(device).manual_seed(1)
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not cpu)
    sync = (lambda: None) if cpu else torch.cuda.synchronize

    def step() -> float:
        with autocast:
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step() for _ in range(args.warmup)]
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        losses.append(step())
        sync()
        times.append(time.perf_counter() - start)
    result = {
        "case": args.case,
        "token_rows": model.token_rows(1, seq, device) is not None,
        "tokens_per_s": seq / statistics.median(times),
        "peak_gib": None if cpu else torch.cuda.max_memory_allocated() / 2**30,
        "losses": losses,
        "torch": torch.__version__,
        "device": "cpu" if cpu else torch.cuda.get_device_name(),
    }
    dist.destroy_process_group()
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case:
        Path(args.result).write_text(json.dumps(run_case(args)))
        return
    runs = []
    for r in range(args.repeats):
        for case in CASES if r % 2 == 0 else CASES[::-1]:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                result = f.name
            cmd = [sys.executable, __file__, "--case", case, "--result", result, "--warmup", str(args.warmup)]
            cmd += ["--steps", str(args.steps)] + ["--cpu"] * args.cpu
            cmd += [
                f"--{name}={value}" for name, value in (("seq", args.seq), ("layers", args.layers)) if value
            ]
            subprocess.run(
                cmd, check=True, env=dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", "."))
            )
            runs.append(json.loads(Path(result).read_text()))
            print(
                f"repeat {r} {case:9s} {runs[-1]['tokens_per_s']:,.0f} tok/s  peak {runs[-1]['peak_gib']}",
                flush=True,
            )
    median = {c: statistics.median(x["tokens_per_s"] for x in runs if x["case"] == c) for c in CASES}
    report = {
        "args": vars(args),
        "runs": runs,
        "median_tokens_per_s": median,
        "tokens_over_sequences": median["tokens"] / median["sequences"],
    }
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "token_rows_step.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({"tokens_over_sequences": report["tokens_over_sequences"]}))


if __name__ == "__main__":
    main()
