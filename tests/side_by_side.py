"""Start several commands at once and wait for all: interpreters that import Lightning take seconds
of CPU each, which a 2-core machine spends on two of them at a time."""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    ended: float  # time.monotonic() when the process was seen to exit (within 50 ms)


def run_side_by_side(commands: dict[str, dict], timeout: float) -> dict[str, Finished]:
    """``{name: Popen keyword arguments (args, env, cwd, ...)}`` → ``{name: Finished}``, output as text;
    every process still running at ``timeout`` is killed and the call raises ``TimeoutError``."""
    outs = {name: (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for name in commands}
    procs = {
        name: subprocess.Popen(text=True, stdout=outs[name][0], stderr=outs[name][1], **kw)
        for name, kw in commands.items()
    }
    deadline, ended = time.monotonic() + timeout, {}
    try:
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for name, proc in procs.items():
                if name not in ended and proc.poll() is not None:
                    ended[name] = time.monotonic()
            time.sleep(0.05)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if len(ended) < len(procs):
        raise TimeoutError(f"{sorted(set(procs) - set(ended))} still running after {timeout:.0f} s")

    def text(f) -> str:
        with f:
            f.seek(0)
            return f.read()

    return {
        name: Finished(proc.returncode, text(outs[name][0]), text(outs[name][1]), ended[name])
        for name, proc in procs.items()
    }
