"""The GPU benchmark's script runs on CPU (gloo, tiny shapes): every case is timed, the 3-D
correctness check passes on every grid, and the report prints its tables."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_gpt_smoke_on_cpu(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "benchmarks", "bench_gpt.py"), "--cpu", "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(tmp_path / "bench_w2.json") as f:
        data = json.load(f)
    checks = data["checks"]
    assert {tuple(c["grid"]) + (c["dp"],) for c in checks} == {(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)}
    assert all(c["ok"] and 0 < c["max_rel_err"] < 1e-4 for c in checks), checks
    assert sum("[async-tp]" in c["case"] for c in checks) == 4
    (block,) = data["results"].values()
    cases = block["cases"]
    kinds = {c["kind"] for c in cases}
    assert kinds == {"dense", "tp1d", "3d"}
    assert {c["variant"] for c in cases} >= {"", "no-prefetch", "regather", "split-qkv", "normal-priority", "async-tp"}
    for c in cases:
        assert c["step_ms"] > 0 and c["fwd_ms"] > 0 and c["bwd_ms"] > 0, c
        # float32 on the same weights: every model computes the dense model's function
        assert c["out_rel_err_vs_dense"] < 1e-5 and c["loss_rel_diff_vs_dense"] < 1e-5, c
    assert "| 3d 2x1x1 |" in proc.stdout and "Strong scaling" in proc.stdout
