"""The micro-benchmarks (``benchmarks/micro/``) run on CPU: every case they time is timed, and where
they compare two ways of computing the same thing, both give the same result."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("processes,rows", [(2, 15), (1, 9)])
def test_host_calls_micro_benchmark_on_cpu(tmp_path, processes, rows):
    """Every call of a 3-D product the host-cost benchmark times runs on 2 gloo ranks and is timed;
    on one process, the products and the trivial op only."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        os.path.join(ROOT, "benchmarks", "micro", "host_calls.py"),
        "--width",
        "16",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(tmp_path / "host_calls.json") as f:
        timed = json.load(f)["us_per_call"]
    assert len(timed) == rows and all(us > 0 for us in timed.values()), timed


def test_group_order_micro_benchmark_on_cpu():
    """Both orders of putting heads in order and rotating give the same q, k, v; every case is timed."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "micro", "bench_group_order.py"),
        "--cpu",
        "--iters",
        "1",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(re.findall(r"forward \d+\.\d+ ms   forward \+ backward \d+\.\d+ ms", proc.stdout)) == 4, (
        proc.stdout
    )
    assert "largest difference between the two orders: 0" in proc.stdout, proc.stdout


def test_packed_elementwise_micro_benchmark_on_cpu(tmp_path):
    """Every case of the packed SwiGLU and RoPE benchmark is compiled and timed, forward + backward."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "micro", "packed_elementwise.py"),
        "--cpu",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(tmp_path / "packed_elementwise.json") as f:
        timed = json.load(f)["us"]
    assert len(timed) == 6 and all(t["wall_us"] > 0 and t["gpu_us"] is None for t in timed.values()), timed


def test_token_rows_counts_match_the_cost_model(tmp_path):
    """Batch 1 on 8 gloo ranks: the all-gathers and reduce-scatters each rank calls are the cost model's
    bytes (the first call's shape agreements add a few hundred), and the bytes kept for backward fall
    close to 1/P of one rank's plus the gathered keys and values (the products' gathered inputs,
    kept on every grid, add the rest)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "8",
        os.path.join(ROOT, "benchmarks", "micro", "token_rows_counts.py"),
        "--seq",
        "1024",
        "--grids",
        "1x1x1,2x2x2",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(tmp_path / "token_rows_counts.json") as f:
        ranks = json.load(f)["ranks"]
    for rank in ranks:
        assert [r["token_rows"] for r in rank] == [False, True]
        for r in rank:
            for kind, sent in r["sent_bytes"].items():
                assert r["sent_predicted"][kind] <= sent <= r["sent_predicted"][kind] + 4096, (
                    r["grid"],
                    kind,
                )
            assert 0.95 < r["saved_ratio"] < 1.3, (r["grid"], r["saved_ratio"])


def test_token_rows_step_on_cpu(tmp_path):
    """Both cases of the whole-step benchmark run, each in a process of its own, from the same weights:
    token rows and whole sequences give the same losses."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "micro", "token_rows_step.py"),
        "--cpu",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--out",
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(tmp_path / "token_rows_step.json") as f:
        runs = {r["case"]: r for r in json.load(f)["runs"]}
    assert runs["tokens"]["token_rows"] and not runs["sequences"]["token_rows"]
    assert runs["tokens"]["losses"] == pytest.approx(runs["sequences"]["losses"], rel=1e-5)
