"""The GPU benchmarks' scripts run on CPU (gloo, tiny shapes). Block stacks: every case is timed,
the 3-D correctness check passes on every grid, and the report prints its tables. The whole
training job: every 3-D grid and every peer that runs on CPU train the same model to the same
losses in float32."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(tmp_path, world: int, model: str, cases: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           os.path.join(ROOT, "benchmarks", "train_job.py"), "--cpu", "--model", model, "--cases", cases, "--out", str(tmp_path), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _train_job(tmp_path, world: int, model: str, cases: str, *extra: str) -> dict:
    proc = _launch(tmp_path, world, model, cases, *extra)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(tmp_path / f"job_w{world}_{model}_nvlink.json") as f:
        return json.load(f)


def _check_same_job(data: dict, labels: list[str]) -> None:
    """Every case ran its steps and, on the same weights and data in float32, had the same losses."""
    cases = data["cases"]
    assert [c["case"] for c in cases] == labels
    reference = cases[0]["losses"]
    assert len(reference) == 3 and all(2 < v < 10 for v in reference)
    for c in cases:
        assert "error" not in c, c
        assert c["step_ms"] > 0 and c["tokens_per_s"] > 0 and len(c["step_ms_each"]) == 4, c
        assert abs(c["losses"][0] - reference[0]) < 1e-5 * reference[0], (c["case"], c["losses"], reference)
        assert all(abs(a - b) < 1e-4 * b for a, b in zip(c["losses"], reference)), (c["case"], c["losses"], reference)
    assert len(set(round(v, 3) for v in reference)) > 1  # the optimizer steps change the loss


@pytest.mark.parametrize("processes,rows", [(2, 15), (1, 9)])
def test_host_calls_micro_benchmark_on_cpu(tmp_path, processes, rows):
    """Every call of a 3-D product the host-cost benchmark times runs on 2 gloo ranks and is timed;
    on one process, the products and the trivial op only."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
           os.path.join(ROOT, "benchmarks", "host_calls.py"), "--width", "16", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(tmp_path / "host_calls.json") as f:
        timed = json.load(f)["us_per_call"]
    assert len(timed) == rows and all(us > 0 for us in timed.values()), timed


def test_group_order_micro_benchmark_on_cpu():
    """Both orders of putting heads in order and rotating give the same q, k, v; every case is timed."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_group_order.py"), "--cpu", "--iters", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(re.findall(r"forward \d+\.\d+ ms   forward \+ backward \d+\.\d+ ms", proc.stdout)) == 4, proc.stdout
    assert "largest difference between the two orders: 0" in proc.stdout, proc.stdout


def test_packed_elementwise_micro_benchmark_on_cpu(tmp_path):
    """Every case of the packed SwiGLU and RoPE benchmark is compiled and timed, forward + backward."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "packed_elementwise.py"), "--cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(tmp_path / "packed_elementwise.json") as f:
        timed = json.load(f)["us"]
    assert len(timed) == 6 and all(t["wall_us"] > 0 and t["gpu_us"] is None for t in timed.values()), timed


def test_train_job_smoke_on_cpu(tmp_path):
    """The whole-job benchmark on 2 ranks: every 3-D grid (auto, async) and each eager peer train the same model alike."""
    labels = ["3d 2x1x1", "3d 2x1x1 ahead2 together1 early", "3d 1x2x1 async", "3d 1x1x2", "3d 1x1x1 dp2", "3d auto", "tp-sp", "tp", "fsdp2", "ddp",
              "3d 1x2x1 ckpt", "fsdp2 ckpt", "3d 1x1x1 dp2 bf16grad", "ddp bf16grad"]
    data = _train_job(tmp_path, 2, "tiny-gpt2", ";".join(labels), "--profile", "3d 2x1x1", "--host-profile", "3d 2x1x1")
    _check_same_job(data, labels)
    python = data["cases"][0]["host_python_rank0"]  # cProfile of rank 0: [name, calls a step, own ms, cumulative ms]
    assert python and all(calls > 0 and 0 <= own <= cum for _, calls, own, cum in python)
    assert "host_python_rank0" not in data["cases"][1]
    profile = data["cases"][0]["profile_rank0_2_steps"]  # on CPU no GPU kernels: the plumbing, with zero time
    assert profile["kernels"] == 0 and profile["peer_waits"] == {"waited_ms": [0.0, 0.0], "moving_ms": [0.0, 0.0], "collectives": 0}
    assert [rank["busy_ms"] for rank in profile["by_rank"]] == [0.0, 0.0]
    assert profile["host_top_self_ms"] and all(ms >= 0 and calls >= 1 for _, ms, calls in profile["host_top_self_ms"])
    assert data["cases"][labels.index("3d auto")]["picks"].startswith("3d ")
    assert data["meta"]["tokens_per_step"] == 8 * 16 and data["meta"]["flops_per_step"] > 0
    assert isinstance(data["meta"]["alloc_conf"], str)  # the caching allocator's settings are recorded
    assert all(link["busbw_GBps"] > 0 for link in data["meta"]["machine"]["intra"]["all_reduce"].values())  # measured links
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import job_report

    text = job_report.table(str(tmp_path / "job_w2_tiny-gpt2_nvlink.json"))
    assert "| 3d 1x2x1 async |" in text and "| **" in text and "vs best peer" in text


def test_train_job_2d_peer_and_llama_on_cpu(tmp_path):
    """On 4 ranks the Llama-style model: FSDP2 × TP+SP (resharding after forward or not) and 3-D grids
    with dp agree with plain TP+SP."""
    labels = ["tp-sp", "fsdp2-tp 2x2", "fsdp2-tp 2x2 noreshard", "3d 2x2x1 async", "3d 1x2x1 dp2"]
    _check_same_job(_train_job(tmp_path, 4, "tiny-llama", ";".join(labels)), labels)


def test_train_job_appends_one_process_per_case(tmp_path):
    """``--append``: cases of separate processes gather into one file of one job; another job's
    file is refused with the fields that differ (worlds of one process: the cases run above)."""
    _train_job(tmp_path, 1, "tiny-gpt2", "3d 1x1x1")
    data = _train_job(tmp_path, 1, "tiny-gpt2", "ddp", "--append")
    _check_same_job(data, ["3d 1x1x1", "ddp"])
    assert len(data["meta"]["appended"]) == 1 and "ddp" in data["meta"]["appended"][0]["argv"]
    refused = _launch(tmp_path, 1, "tiny-gpt2", "fsdp2", "--append", "--steps", "3")
    assert refused.returncode != 0 and "--append:" in refused.stderr and "steps: 2 in the file, 3 here" in refused.stderr
    with open(tmp_path / "job_w1_tiny-gpt2_nvlink.json") as f:
        assert [c["case"] for c in json.load(f)["cases"]] == ["3d 1x1x1", "ddp"]  # the file is left as it was


def test_train_job_cases_parse_and_refuse_bad_input():
    """Case names parse to methods and back; a case that does not fit the world is refused with its
    numbers; a profiled case is found whatever the order of its words, and one that is no case is refused."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import train_job

    for text in ("3d 1x2x1 dp2 async", "3d 4x1x1 compile regather ahead1 early", "3d auto", "tp-sp compile async", "fsdp2-tp 2x2 compile", "ddp",
                 "fsdp2 compile noreshard bf16grad"):
        assert train_job.Method.parse(text, 4).label == text
    assert not train_job.Method.parse("fsdp2 noreshard", 4).reshard and train_job.Method.parse("fsdp2", 4).reshard
    for text, words in (("3d 2x2x2", "dp·px·py·pz = 8"), ("fsdp2-tp 2x4", "dp·tp = 8"), ("megatron", "first word"), ("tp fast", "'fast'"),
                        ("3d 4x1x1 noreshard", "FSDP2's setting")):
        with pytest.raises(ValueError, match=re.escape(words)):
            train_job.Method.parse(text, 4)
    methods = [train_job.Method.parse(text, 4) for text in ("3d 4x1x1 compile", "fsdp2 compile noreshard bf16grad")]
    assert train_job.profiled_labels("--profile", "fsdp2 compile bf16grad noreshard;", methods, 4) == {"fsdp2 compile noreshard bf16grad"}
    with pytest.raises(SystemExit, match=re.escape("--host-profile names ['3d 2x2x1'], not among the cases")):
        train_job.profiled_labels("--host-profile", "3d 4x1x1 compile;3d 2x2x1", methods, 4)


def test_largest_model_extrapolates_peak_memory_per_layer(tmp_path):
    """``job_report --largest``: a line through each case's peaks, the most layers under the usable memory."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import job_report

    for layers, peaks in ((8, {"3d 1x4x1": 10.0, "fsdp2": 20.0}), (16, {"3d 1x4x1": 14.0, "fsdp2": 36.0})):
        cases = [{"case": k, "peak_GiB": v} for k, v in peaks.items()] + [{"case": "ddp", "error": "OutOfMemoryError"}]
        (tmp_path / f"L{layers}.json").write_text(json.dumps({"meta": {"config": {"n_layer": layers}, "gpu_GiB": 80.0}, "cases": cases}))
    text = job_report.largest([str(tmp_path / "L8.json"), str(tmp_path / "L16.json")])
    # 3d: 6 GiB + 0.5 GiB a layer under 0.92·80 = 73.6 GiB → 135 layers; fsdp2: 4 + 2 a layer → 34
    assert "| 3d 1x4x1 | 8: 10.00, 16: 14.00 | 0.50 | 135 |" in text, text
    assert "| fsdp2 | 8: 20.00, 16: 36.00 | 2.00 | 34 |" in text, text
    assert "| ddp | 8: failed, 16: failed | – | fewer than 8 |" in text, text


def test_repeats_take_each_cases_median_over_processes(tmp_path):
    """``job_report --repeats``: every case's median, least and most step over the files, and the
    best 3-D median against the best peer's."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import job_report

    runs = ({"3d 4x1x1 compile": 100.0, "fsdp2 compile": 108.0}, {"3d 4x1x1 compile": 110.0, "fsdp2 compile": 101.0},
            {"fsdp2 compile": 102.0, "3d 4x1x1 compile": 104.0, "ddp": None})
    for n, steps in enumerate(runs):
        cases = [{"case": k, "step_ms": v} if v else {"case": k, "error": "OutOfMemoryError"} for k, v in steps.items()]
        (tmp_path / f"p{n}.json").write_text(json.dumps({"meta": {}, "cases": cases}))
    text = job_report.repeats([str(tmp_path / f"p{n}.json") for n in range(3)])
    assert "| 3d 4x1x1 compile | 3 | 104.0 | 100.0 | 110.0 |" in text and "| fsdp2 compile | 3 | 102.0 | 101.0 | 108.0 |" in text, text
    assert "ddp" not in text and "best 3-D 3d 4x1x1 compile against best peer fsdp2 compile, medians: 0.98×" in text, text


def test_profile_timelines_from_traces(tmp_path):
    """``kernel_timeline`` splits a trace's GPU time by kind and exposure (also by collective); ``peer_waits`` aligns two
    ranks' traces on the wall clock (different bases) and splits each collective into the wait for
    the last rank and the time after it; a kernel name whose count differs between ranks is left out."""
    import gzip

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import measure

    def trace(path, base_ns, kernels):
        events = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur} for name, ts, dur in kernels]
        with gzip.open(path, "wt") as f:
            json.dump({"baseTimeNanoseconds": base_ns, "traceEvents": events}, f)
        return str(path)

    gather, reduce = "ncclDevKernel_AllGather_RING_LL", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    # rank 0's clock base is 1000 µs earlier: its ts are 1000 larger for the same instants
    r0 = trace(tmp_path / "r0.json.gz", 0, [(gather, 1100, 50), ("nvjet_gemm", 1120, 60), (gather, 1300, 20), (reduce, 1400, 5)])
    r1 = trace(tmp_path / "r1.json.gz", 1_000_000, [(gather, 130, 20), (gather, 290, 30)])
    timeline = measure.kernel_timeline(r0)
    assert timeline["by_kind_ms_count"]["communication"] == [0.075, 3] and timeline["by_kind_ms_count"]["matmul"] == [0.06, 1]
    assert abs(timeline["exposed_comm_ms"] - 0.045) < 1e-9 and abs(timeline["busy_ms"] - 0.105) < 1e-9
    # nothing runs 1180–1300 and 1320–1400: idle 0.2 ms, the longest gap first, with its kernels
    assert abs(timeline["idle_ms"] - 0.2) < 1e-9
    assert timeline["longest_idle_ms"] == [[0.12, "nvjet_gemm", gather], [0.08, gather, reduce]]
    # gathers: 1100–1120 and 1300–1320 exposed, the GEMM covers the rest; the all-reduce all of its 5 µs
    assert timeline["exposed_by_collective_ms"] == {"AllGather": 0.04, "AllReduce_Sum_f32": 0.005}
    waits = measure.peer_waits([measure.nccl_kernels(r0), measure.nccl_kernels(r1)])
    # gather 1: rank 0 starts at 1100, rank 1 at 1130 → rank 0 waits 30 µs, both move 20 until 1150;
    # gather 2: rank 1 starts at 1290, rank 0 at 1300 → rank 1 waits 10, both move 20 until 1320;
    # the all-reduce (rank 0 only) is left out
    assert waits == {"waited_ms": [0.03, 0.01], "moving_ms": [0.04, 0.04], "collectives": 2}
