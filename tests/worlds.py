"""Driver scripts run as worlds of real processes: one process per rank, started with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, so that Lightning (Trainer or
Fabric) creates no processes itself and one world serves several runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent


def env(**extra) -> dict:
    """The environment of a driver process: the repository importable, one thread."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


def start(
    script: Path, world: int, out: Path, args: tuple, port: int | None = None
) -> tuple[list[subprocess.Popen], list[Path]]:
    """Start ``script *args`` on ``world`` ranks, each logging to ``out/<args[0]>.log<rank>``."""
    port = str(port or free_port())
    procs, logs = [], []
    for rank in range(world):
        logs.append(out / f"{args[0]}.log{rank}")
        rank_env = env(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
        )
        with open(logs[-1], "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args], env=rank_env, stdout=log, stderr=subprocess.STDOUT
                )
            )
    return procs, logs


def wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every process (killing those still running at ``timeout``); the ranks that were still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return hung


def launch(script: Path, world: int, out: Path, *args: str, timeout: float = 240, tries: int = 3) -> None:
    """Run ``script *args`` on ``world`` ranks; fail with every failed rank's log tail on an error or a hang.

    A rendezvous port taken between choosing and binding it (other jobs on the machine) is retried.
    """
    for attempt in range(tries):
        procs, logs = start(script, world, out, args)
        hung = wait(procs, timeout)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if not failed:
            return
        report = "\n".join(f"--- rank {r} ---\n{tail(logs[r])}" for r in failed)
        if "EADDRINUSE" not in report or attempt == tries - 1:
            raise AssertionError(
                f"{script.name} {args[0]}: ranks {failed} failed"
                + (f" (hung past {timeout:.0f}s: {hung})" if hung else "")
                + f"\n{report}"
            )
