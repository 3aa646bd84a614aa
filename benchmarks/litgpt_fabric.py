"""LitGPT's model under ``Fabric(strategy="tensor3d")`` on 1×1×1 against Fabric's single-device strategy, both compiled.

Each case trains LitGPT's own ``litgpt.model.GPT`` (``--model``, a ``litgpt.Config`` name) on random
tokens with AdamW, as LitGPT's pretraining loop does, in a fresh process of its own:

- ``single``: ``Fabric(devices=1)`` (its single-device strategy), the model built on the device,
  ``torch.compile(model)`` before ``fabric.setup`` (as LitGPT's scripts compile), LitGPT's
  ``chunked_cross_entropy``;
- ``tensor3d``: ``Fabric(strategy=Tensor3DFabricStrategy(grid=(1, 1, 1)))``, the model built on
  ``meta`` (``fabric.init_module(empty_init=True)``) and put on the grid by ``fabric.setup`` with
  its built-in plan, each block compiled (``RuntimeOptions(compile=True)``), the loss
  ``lightning_3d.litgpt.cross_entropy``.

Both start from the same weights (the same seed; the grid draws them in the same order). Warm-up
steps (compilation included) are excluded; the cases alternate over ``--repeats`` runs. Tokens/s
and peak memory (``torch.cuda.max_memory_allocated`` over the timed steps) per run, their medians and
the ratios tensor3d / single go to ``OUT/litgpt_fabric.json`` (rewritten after each run). ``--cpu``: a
tiny smoke run on CPU.

    python benchmarks/litgpt_fabric.py                       # one GPU
    python benchmarks/litgpt_fabric.py --cpu --no-compile    # smoke
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

CASES = ("single", "tensor3d")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default="benchmarks/results", help="the JSON report goes here")
    p.add_argument(
        "--cpu", action="store_true", help="tiny smoke run on CPU (pythia-14m shapes, float32, few steps)"
    )
    p.add_argument(
        "--model", default=None, help="litgpt.Config name (default: tiny-llama-1.1b; --cpu: pythia-14m)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="sequences a step (default 8; --cpu 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default 2048; --cpu 32)")
    p.add_argument(
        "--precision", default=None, help="Fabric's precision flag (default bf16-mixed; --cpu 32-true)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps first, compilation included (default 10; --cpu 1)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps a run (default 30; --cpu 2)")
    p.add_argument(
        "--repeats", type=int, default=None, help="runs of each case, alternating (default 3; --cpu 1)"
    )
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager instead of compiled")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one run, in a process of its own
    p.add_argument("--result", help=argparse.SUPPRESS)  # where that run writes its numbers
    args = p.parse_args(argv)
    defaults = (
        dict(model="pythia-14m", batch_size=2, seq_len=32, precision="32-true", warmup=1, steps=2, repeats=1)
        if args.cpu
        else dict(
            model="tiny-llama-1.1b",
            batch_size=8,
            seq_len=2048,
            precision="bf16-mixed",
            warmup=10,
            steps=30,
            repeats=3,
        )
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def make_fabric(case: str, args: argparse.Namespace):
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric
    import lightning_3d

    accelerator = "cpu" if args.cpu else "cuda"
    if case == "single":
        return Fabric(accelerator=accelerator, devices=1, precision=args.precision)
    strategy = lightning_3d.strategy.Tensor3DFabricStrategy(
        grid=(1, 1, 1), options=lightning_3d.RuntimeOptions(compile=args.compile)
    )
    return Fabric(accelerator=accelerator, devices=1, strategy=strategy, precision=args.precision)


def run_case(case: str, args: argparse.Namespace) -> dict:
    """One run of ``case``: tokens/s and peak memory over the timed steps, and the losses."""
    from litgpt import Config
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy

    from lightning_3d.litgpt import cross_entropy

    fabric = make_fabric(case, args)
    fabric.launch()
    fabric.seed_everything(1234)
    config = Config.from_name(args.model, block_size=args.seq_len)
    with fabric.init_module(empty_init=case == "tensor3d"):
        model = GPT(config)
    if case == "single" and args.compile:
        model = torch.compile(model)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    )
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator).to(
            fabric.device
        )
        for _ in range(4)
    ]

    def step(i: int) -> torch.Tensor:
        batch = batches[i % len(batches)]
        logits = model(batch[:, :-1])
        targets = batch[:, 1:]
        loss = (
            cross_entropy(model, logits, targets)
            if case == "tensor3d"
            else chunked_cross_entropy(logits, targets)
        )
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    cuda = fabric.device.type == "cuda"
    losses = [float(step(i)) for i in range(args.warmup)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    timed = [step(args.warmup + i) for i in range(args.steps)]
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {
        "case": case,
        "tokens_per_s": args.steps * args.batch_size * args.seq_len / elapsed,
        "step_ms": 1000 * elapsed / args.steps,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": losses + [float(t) for t in timed],
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
    }


def run_in_process(case: str, args: argparse.Namespace, argv: list[str]) -> dict:
    """``case`` in a fresh process (compiled graphs, allocator and peak memory of its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *argv, "--case", case, "--result", str(result)],
            env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(
                f"{case} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            )
        return json.loads(result.read_text())


def summary(runs: list[dict]) -> dict:
    by_case = {case: [r for r in runs if r["case"] == case] for case in CASES}
    med = {
        case: {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "peak_mem_gib": statistics.median(r["peak_mem_gib"] for r in rs)
            if rs[0]["peak_mem_gib"] is not None
            else None,
        }
        for case, rs in by_case.items()
    }
    single, grid = med["single"], med["tensor3d"]
    ratios = {"tokens_per_s": grid["tokens_per_s"] / single["tokens_per_s"]}
    if single["peak_mem_gib"]:
        ratios["peak_mem"] = grid["peak_mem_gib"] / single["peak_mem_gib"]
    return {"median": med, "tensor3d_over_single": ratios}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.case is not None:
        Path(args.result).write_text(json.dumps(run_case(args.case, args)))
        return
    out = Path(args.out) / "litgpt_fabric.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for repeat in range(args.repeats):
        for case in CASES if repeat % 2 == 0 else CASES[::-1]:
            run = run_in_process(case, args, argv)
            print(
                f"repeat {repeat} {case:8s} {run['tokens_per_s']:12,.0f} tok/s  {run['step_ms']:8.1f} ms/step  "
                f"peak {run['peak_mem_gib'] if run['peak_mem_gib'] is not None else float('nan'):.2f} GiB  "
                f"loss {run['losses'][0]:.4f} → {run['losses'][-1]:.4f}",
                flush=True,
            )
            runs.append(run)
            done = {r["case"] for r in runs} == set(
                CASES
            )  # the report so far, kept if a later run is cut short
            report = {
                "args": {k: v for k, v in vars(args).items() if k not in ("case", "result")},
                "runs": runs,
                **(summary(runs) if done else {}),
            }
            out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["tensor3d_over_single"]), f"→ {out}")


if __name__ == "__main__":
    main()
