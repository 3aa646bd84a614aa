r"""Runs a comparison the way its numbers can be trusted: every case in a process of its own, the
order rotated between repeats, then each case's median and range over the repeats.

    python benchmarks/launch.py --nproc 4 --repeats 3 --out DIR \
        --cases "3d 4x1x1 compile;fsdp2 compile noreshard" -- --model llama-7b

starts, for repeat ``r``, one ``torchrun --nproc_per_node 4 train_job.py`` per case (the arguments
after ``--`` passed on), the cases in the given order rotated by ``r`` (so each case in turn runs
first), all of repeat ``r``'s cases appended to ``DIR/repeat{r}/``; then prints ``report.py``'s
medians and ranges over the repeats. ``--one-process`` runs a repeat's cases in one process instead
(cheaper; cases then move each other). Environment variables pass through, e.g.
``NCCL_P2P_DISABLE=1`` with ``-- --links p2p-off``.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report  # noqa: E402


def rotated(cases: list[str], r: int) -> list[str]:
    """``cases`` starting at case ``r`` (mod their number)."""
    k = r % len(cases)
    return cases[k:] + cases[:k]


def torchrun(nproc: int, cases: list[str], out: str, extra: list[str], timeout_s: float) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        os.path.join(HERE, "train_job.py"),
        "--cases",
        ";".join(cases),
        "--append",
        "--out",
        out,
        *extra,
    ]
    return subprocess.run(cmd, timeout=timeout_s).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, required=True, help="processes (GPUs) per case")
    parser.add_argument("--cases", required=True, help="';'-separated cases of train_job.py")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--one-process", action="store_true", help="a repeat's cases in one process, not one each"
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="the most one process may take")
    args = parser.parse_args(own)
    cases = [c.strip() for c in args.cases.split(";") if c.strip()]
    failed = 0
    for r in range(args.repeats):
        out = os.path.join(args.out, f"repeat{r}")
        order = rotated(cases, r)
        runs = [order] if args.one_process else [[c] for c in order]
        for run in runs:
            failed += torchrun(args.nproc, run, out, extra, args.timeout_s) != 0
    files = sorted(glob.glob(os.path.join(args.out, "repeat*", "job_*.json")))
    print(report.repeats(files))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
