"""What the token-range check costs: one model, training steps with ``RuntimeOptions.check_inputs`` on and off in turn.

The check (``lightning_3d.runtime.token_checks``) compares the ids with the vocabulary and reads one flag
back to the host, once in the embedding and once in the loss. Its cost is the pause that read
makes: the host waits for the device to finish everything queued, and the device then waits for
the host to queue the next kernels. This script trains one model of ``train_job.py``
(``--model``, ``--case``, e.g. ``"3d 1x4x1 async compile"``) for ``--rounds`` rounds, each
``--steps`` steps with the check on then ``--steps`` with it off, so that drift of the device
affects both alike, and reports the median step time of each setting, their difference, and the
spread of the per-round differences. Launch one process per GPU; ``--cpu`` runs a tiny model on gloo.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [BENCHMARKS, os.path.dirname(BENCHMARKS)]  # the whole-job tool, the project

import measure  # noqa: E402
import train_job  # noqa: E402

from lightning_3d.models import DenseGPT, GPTConfig  # noqa: E402
from lightning_3d.parallel import set_options  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU, a tiny model")
    parser.add_argument(
        "--model",
        default=None,
        help=f"one of {sorted(train_job.MODELS)} (default gpt2-1.3b; tiny-gpt2 with --cpu)",
    )
    parser.add_argument(
        "--case", default="3d 1x1x1", help="a 3d case of train_job.py whose grid fits the world"
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="steps per setting per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    dist.init_process_group("gloo" if args.cpu else "nccl", timeout=datetime.timedelta(seconds=600))
    run = train_job.Run(args.cpu)
    if not args.cpu:
        torch.cuda.set_device(run.device)
    method = train_job.Method.parse(args.case, run.world)
    if method.kind != "3d" or method.grid is None:
        raise SystemExit(f"--case must be a 3d case with a grid, got {args.case!r}")
    name = args.model or ("tiny-gpt2" if args.cpu else "gpt2-1.3b")
    fields, batch, seq = train_job.MODELS[name]
    config = GPTConfig(block_size=seq, dropout=0.0, tie_embeddings=False, **fields)
    torch.manual_seed(0)
    dense = DenseGPT(config, device=run.device).state_dict()
    job = train_job.build_3d(run, method, config, dense, batch)
    del dense
    model = job.info["model"]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(config.vocab_size, (batch, seq + 1), generator=gen).to(run.device)
    ids, targets = ids[job.rows, :-1].contiguous(), ids[job.rows, 1:].contiguous()
    timer = measure.Timer(run.device)
    times: dict[bool, list[list[float]]] = {True: [], False: []}
    gc.collect()
    gc.disable()
    for _ in range(args.warmup):
        job.step(ids, targets)
    for _ in range(args.rounds):
        for check in (True, False):
            set_options(model, check_inputs=check)
            steps = []
            for _ in range(args.steps):
                timer.mark()
                job.step(ids, targets)
                timer.mark()
                steps += timer.split()
            times[check].append(steps)
    gc.enable()
    # the step time of the slowest rank, step by step
    flat = {
        c: torch.tensor([t for r in times[c] for t in r], dtype=torch.float64, device=run.device)
        for c in times
    }
    for t in flat.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    per_round = {
        c: [
            statistics.median(flat[c][i * args.steps : (i + 1) * args.steps].tolist())
            for i in range(args.rounds)
        ]
        for c in flat
    }
    on, off = statistics.median(flat[True].tolist()), statistics.median(flat[False].tolist())
    diffs = [a - b for a, b in zip(per_round[True], per_round[False])]
    result = {
        "model": name,
        "case": method.label,
        "world": run.world,
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": os.environ.get("BENCH_COMMIT", ""),
        "argv": sys.argv,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "check_on_ms": on,
        "check_off_ms": off,
        "cost_ms": on - off,
        "cost_pct": 100 * (on - off) / off,
        "round_diffs_ms": diffs,
        "round_medians_ms": per_round,
    }
    if run.rank == 0:
        print(
            f"{name} {method.label}: check on {on:.2f} ms, off {off:.2f} ms, cost {on - off:+.2f} ms "
            f"({result['cost_pct']:+.2f}%); "
            f"per-round differences {min(diffs):+.2f} .. {max(diffs):+.2f} ms",
            flush=True,
        )
        os.makedirs(args.out, exist_ok=True)
        tag = method.label.replace(" ", "_")
        with open(os.path.join(args.out, f"check_w{run.world}_{name}_{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
