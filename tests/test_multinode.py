"""Two nodes on one host: two launchers of 2 processes each (gloo), under Lightning and torchrun.

Each launcher is one "node" (its own ``NODE_RANK`` / ``--node-rank``); both train ``common``'s tiny
GPT3D and must equal DenseGPT on the same global batches, with each cube where the rank order puts
it: inside a node when it fits one (dp across nodes), else split along x. Every collective has a
150 s timeout (the rendezvous waits for every process to start), and the test kills every process
it started when a launcher fails or hangs.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "lightning_scripts"))

import common

from lightning_3d.strategy import grid_rules

SCRIPT = Path(__file__).parent / "lightning_scripts" / "multinode.py"
ROOT = Path(__file__).parent.parent
DEADLINE = 270.0
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
    }
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def _end(procs: list, out: Path) -> None:
    """Terminate every launcher's process group and every process that wrote a pid file."""
    pids = [int(f.name.split(".")[1]) for f in out.glob("pid.*")]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


def run_two_nodes(commands: list[list[str]], envs: list[dict], out: Path) -> float:
    """Start one launcher per node, wait for both; fail, with their logs, on an error or past ``DEADLINE``."""
    start = time.monotonic()
    logs = [out / f"node{k}.log" for k in range(len(commands))]
    procs = [
        subprocess.Popen(
            cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        for cmd, env, log in zip(commands, envs, logs)
    ]
    try:
        while time.monotonic() - start < DEADLINE and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
    finally:
        _end(procs, out)
    if codes != [0] * len(procs):
        tails = "\n".join(
            f"--- node {k} (exit {c}) ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            for k, (c, log) in enumerate(zip(codes, logs))
        )
        raise AssertionError(f"two-node run failed or hung past {DEADLINE:.0f}s: exits {codes}\n{tails}")
    return time.monotonic() - start


def _records(out: Path, mode: str) -> list[dict]:
    files = sorted(out.glob(f"{mode}.rank*.json"), key=lambda f: int(f.suffixes[0][5:]))
    return [json.loads(f.read_text()) for f in files]


def assert_cube_placement(recs: list[dict], axes: list[str]) -> None:
    """The first half of the ranks on one node and the rest on the other; the axes across nodes are the
    expected ones."""
    nodes, half = [r["node"] for r in recs], len(recs) // 2
    assert len(set(nodes[:half])) == 1 and len(set(nodes[half:])) == 1 and nodes[0] != nodes[half], nodes
    assert all(r["axes_across_nodes"] == axes for r in recs), [r["axes_across_nodes"] for r in recs]
    px, py, pz = recs[0]["grid"]
    for r in recs:  # the rank order: ((d·px + x)·py + y)·pz + z
        d, x, y, z = r["coords"]
        assert r["rank"] == ((d * px + x) * py + y) * pz + z, r


def assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) and max(abs(a - b) / abs(b) for a, b in zip(got, want)) < TOL, (
        what,
        got,
        want,
    )


def test_auto_grid_keeps_each_cube_inside_a_node():
    assert grid_rules.resolve("auto", "auto", 4, 2) == ((2, 1, 1), 2)  # Trainer(num_nodes=2, devices=2)
    assert grid_rules.resolve("auto", "auto", 8, 4) == ((2, 2, 1), 2)  # Trainer(num_nodes=2, devices=4)
    assert grid_rules.resolve("auto", "auto", 128, 8) == ((2, 2, 2), 16)  # 16 nodes of 8


def test_lightning_num_nodes_2(tmp_path):
    port = str(_free_port())
    envs = [_env(NODE_RANK=str(k), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for k in range(2)]
    run_two_nodes([[sys.executable, str(SCRIPT), "lightning", str(tmp_path)]] * 2, envs, tmp_path)
    recs = _records(tmp_path, "lightning")
    assert len(recs) == 4
    assert all(r["grid"] == [2, 1, 1] and r["dp"] == 2 for r in recs)  # "auto": a cube of a node's 2 devices
    assert_cube_placement(recs, ["dp"])
    dense = common.dense_reference(3)
    for r in recs:
        assert_close(r["loss"], dense["loss"], f"rank {r['rank']}")


def test_torchrun_nnodes_2(tmp_path):
    port = str(_free_port())
    cmds = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--node-rank",
            str(k),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            str(SCRIPT),
            "torch",
            str(tmp_path),
        ]
        for k in range(2)
    ]
    run_two_nodes(cmds, [_env()] * 2, tmp_path)
    recs = _records(tmp_path, "torch")
    assert len(recs) == 4
    for grid, axes in (("2×1×1", ["dp"]), ("2×2×1", ["x"])):  # a cube per node; one cube split along x
        on_grid = [r[grid] for r in recs]
        assert_cube_placement(on_grid, axes)
        for r in on_grid:
            assert_close(r["loss"], r["dense_loss"], f"{grid} rank {r['rank']}")
