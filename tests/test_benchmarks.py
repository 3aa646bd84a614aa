"""The benchmark (``benchmarks/train_job.py``, ``peers.py``, ``launch.py``, ``report.py``) on CPU:
every 3-D grid and every peer train the same tiny model to the same losses in float32; the bytes
each rank sends, counted from the collectives a step calls, are the cost model's
(``lightning_3d.cost.sent_bytes``) on worlds of 2, 4 and 8; the launcher runs each case in a
process of its own, the order rotated between repeats; the report's tables, planner check and plot
read what the runs wrote."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from lightning_3d.models import GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCHMARKS)

import report  # noqa: E402
import train_job  # noqa: E402


def _launch(tmp_path, world: int, model: str, cases: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world),
        os.path.join(BENCHMARKS, "train_job.py"),
        "--cpu",
        "--model",
        model,
        "--cases",
        cases,
        "--out",
        str(tmp_path),
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _train_job(tmp_path, world: int, model: str, cases: str, *extra: str) -> dict:
    proc = _launch(tmp_path, world, model, cases, *extra)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(tmp_path / f"job_w{world}_{model}_nvlink.json") as f:
        return json.load(f)


def _check_same_job(data: dict, labels: list[str], steps: int) -> None:
    """Every case ran its steps and, on the same weights and data in float32, had the same losses."""
    cases = data["cases"]
    assert [c["case"] for c in cases] == labels
    reference = cases[0]["losses"]
    assert len(reference) == 3 and all(2 < v < 10 for v in reference)
    for c in cases:
        assert "error" not in c, c
        assert c["step_ms"] > 0 and c["tokens_per_s"] > 0 and len(c["step_ms_each"]) == steps, c
        assert all(abs(a - b) < 1e-4 * b for a, b in zip(c["losses"], reference)), (
            c["case"],
            c["losses"],
            reference,
        )
    assert len(set(round(v, 3) for v in reference)) > 1  # the optimizer steps change the loss


def _check_bytes(case: dict) -> None:
    """Every rank's counted bytes against the cost model's: all-gathers and reduce-scatters exactly; the
    all-reduces at least the predicted dp reduction, the rest (norm statistics, the replicated vectors'
    gradients, the loss's sums) a few percent of the step's bytes."""
    predicted = case["predicted_sent_bytes"]
    for rank in case["sent_bytes_by_rank"]:
        counted = {
            op: sum(b for k, b in rank["by_kind"].items() if k.startswith(op + "/")) for op in predicted
        }
        # a collective matmul on gloo scatters its product's rows as one all-to-all: a reduce-scatter's bytes
        counted["reduce_scatter"] += sum(b for k, b in rank["by_kind"].items() if k.startswith("all_to_all/"))
        assert counted["all_gather"] == pytest.approx(predicted["all_gather"], rel=1e-9), (
            case["case"],
            counted,
            predicted,
        )
        assert counted["reduce_scatter"] == pytest.approx(predicted["reduce_scatter"], rel=1e-9), (
            case["case"],
            counted,
            predicted,
        )
        small = counted["all_reduce"] - predicted["all_reduce"]
        assert 0 <= small <= 0.06 * rank["total"], (case["case"], counted, predicted)
        assert rank["total"] == pytest.approx(sum(counted.values()))  # nothing but these three kinds


def test_benchmark_smoke_and_sent_bytes_on_two_ranks(tmp_path):
    """On 2 ranks 3-D grids (auto, async, recomputed blocks) and every peer train the same model alike; the
    bytes each 3-D case's ranks send are the cost model's; FSDP2 without resharding sends less than
    with it (no gather in backward) and as much as 3-D 2×1×1 (FSDP's algorithm), give or take the
    vectors FSDP2 also shards; the report reads the file."""
    labels = [
        "3d 2x1x1",
        "3d 1x2x1 async",
        "3d auto",
        "3d 1x1x2 ckpt",
        "tp-sp",
        "tp",
        "fsdp2",
        "fsdp2 noreshard",
        "ddp",
    ]
    data = _train_job(
        tmp_path,
        2,
        "tiny-gpt2",
        ";".join(labels),
        "--count-bytes",
        "--warmup",
        "1",
        "--profile",
        "3d 2x1x1",
        "--host-profile",
        "3d 2x1x1",
    )
    _check_same_job(data, labels, steps=3)
    by_label = {c["case"]: c for c in data["cases"]}
    for label in labels:
        if label.startswith("3d") and "ckpt" not in label:  # a recomputed block's collectives are not priced
            _check_bytes(by_label[label])
    assert "predicted_sent_bytes" not in by_label["3d 1x1x2 ckpt"]
    peers = {
        label: max(r["total"] for r in by_label[label]["sent_bytes_by_rank"])
        for label in labels
        if not label.startswith("3d")
    }
    assert all(b > 0 for b in peers.values()), peers
    ours = max(r["total"] for r in by_label["3d 2x1x1"]["sent_bytes_by_rank"])
    assert peers["fsdp2 noreshard"] < peers["fsdp2"] and abs(peers["fsdp2 noreshard"] / ours - 1) < 0.1, (
        peers,
        ours,
    )
    assert by_label["3d auto"]["picks"].startswith("3d ") and data["meta"]["warm_run_steps"] == 1
    python = by_label["3d 2x1x1"][
        "host_python_rank0"
    ]  # cProfile of rank 0: [name, calls a step, own ms, cumulative ms]
    assert python and all(calls > 0 and 0 <= own <= cum for _, calls, own, cum in python)
    profile = by_label["3d 2x1x1"][
        "profile_rank0_2_steps"
    ]  # on CPU no GPU kernels: the plumbing, with zero time
    assert profile["kernels"] == 0 and [rank["busy_ms"] for rank in profile["by_rank"]] == [0.0, 0.0]
    assert all(
        link["busbw_GBps"] > 0 for link in data["meta"]["machine"]["intra"]["all_reduce"].values()
    )  # measured links
    path = str(tmp_path / "job_w2_tiny-gpt2_nvlink.json")
    text = report.table(path)
    assert all(label in text for label in labels) and "| **" in text and "vs best peer" in text
    table = {row.split(" | ")[1]: row.split(" | ") for row in report.sent_bytes([path]).splitlines()[2:]}
    for peer in (
        "fsdp2 noreshard",
        "ddp",
    ):  # against the 3-D grid that runs their algorithm: within the vectors' bytes
        assert 1.0 <= float(table[peer][-1].rstrip(" |")) < 1.1, table[peer]
    assert table["tp-sp"][-2:] == ["–", "– |"]
    text, _ = report.planner(
        [path]
    )  # CPU steps against an H200-calibrated model: the plumbing, not the error
    assert "| 3d 2x1x1 |" in text and "points: worst step-time error" in text
    standings = report.standings([path])
    assert (
        "tiny-gpt2, 2 GPUs, nvlink" in standings
        and "| 1.000× |" in standings
        and "| 3d auto (= 3d " in standings
    )
    svg = report.plot_svg([path], "smoke")
    assert (
        svg.startswith("<svg")
        and svg.count("<rect") >= 6
        and "3-D (best grid)" in svg
        and "FSDP2 no resharding" in svg
    )


@pytest.mark.parametrize(
    "world, model, labels",
    [
        (4, "tiny-llama", ["3d 2x2x1", "3d 1x2x1 dp2", "fsdp2-tp 2x2 noreshard"]),
        (8, "tiny-llama", ["3d 2x2x2"]),
    ],
)
def test_sent_bytes_are_the_cost_models_on_larger_worlds(tmp_path, world, model, labels):
    """On 4 and 8 ranks (Llama-style blocks: grouped-query attention, SwiGLU, no biases) the bytes each
    rank sends are the cost model's, and FSDP2 × TP+SP trains the same model to the same losses."""
    data = _train_job(tmp_path, world, model, ";".join(labels), "--count-bytes", "--warmup", "1")
    _check_same_job(data, labels, steps=3)
    for case in data["cases"]:
        if case["case"].startswith("3d"):
            _check_bytes(case)


def test_launcher_runs_each_case_alone_in_rotated_order(tmp_path):
    """``launch.py``: one process per case, repeat ``r`` starting at case ``r``, every run appended to its
    repeat's file; the medians over the repeats printed. A process of another job is refused by the
    file it would append to, with the fields that differ."""
    cmd = [
        sys.executable,
        os.path.join(BENCHMARKS, "launch.py"),
        "--nproc",
        "1",
        "--repeats",
        "2",
        "--out",
        str(tmp_path),
        "--cases",
        "3d 1x1x1;ddp",
        "--",
        "--cpu",
        "--model",
        "tiny-gpt2",
        "--warmup",
        "1",
        "--steps",
        "1",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    orders = []
    for r in range(2):
        path = tmp_path / f"repeat{r}" / "job_w1_tiny-gpt2_nvlink.json"
        with open(path) as f:
            data = json.load(f)
        orders.append([c["case"] for c in data["cases"]])
        assert len(data["meta"]["appended"]) == 1  # two processes, one file
    assert orders == [["3d 1x1x1", "ddp"], ["ddp", "3d 1x1x1"]]
    assert (
        re.search(r"\| 3d 1x1x1 \| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", proc.stdout)
        and "best 3-D 3d 1x1x1 against best peer ddp" in proc.stdout
    )
    other = dict(data["meta"], steps=3, date="", commit="", argv=[], matmul_tflops=1.0)
    with pytest.raises(ValueError, match=re.escape("steps: 1 in the file, 3 here")):
        train_job.earlier_job(str(path), other)
    assert train_job.earlier_job(str(path), dict(other, steps=1))[1] == data["cases"]


def test_planner_check_prices_each_file_with_its_machine(tmp_path):
    """``report.py --planner``: a 3-D case measured at exactly the predicted time and memory has no
    error; the model's pick among two measured grids is compared with the measured fastest."""
    from lightning_3d import cost

    config = dataclasses.asdict(
        GPTConfig(
            vocab_size=32000,
            block_size=2048,
            n_layer=8,
            n_head=32,
            n_kv_head=8,
            n_embd=4096,
            style="llama",
            ffn_hidden=11008,
        )
    )
    meta = {
        "config": config,
        "seq": 2048,
        "batch": 8,
        "world": 4,
        "links": "nvlink",
        "model": "llama-7b",
        "matmul_tflops": 700.0,
        "machine": cost.DEFAULT_MACHINE.rates(),
    }
    shape = report.shape_of(meta)
    cases = []
    for grid in ((4, 1, 1), (2, 2, 1)):
        p = cost.predict_job(shape, grid, 1, cost.DEFAULT_MACHINE, compiled=True, grads_at_end=True)
        method = {
            "kind": "3d",
            "grid": list(grid),
            "dp": 1,
            "async_tp": False,
            "compile": True,
            "grads_at_end": True,
        }
        step = p.step_ms if grid == (4, 1, 1) else 1.0  # 2×2×1 measured fastest, whatever the model predicts
        cases.append(
            {
                "case": f"3d {'x'.join(map(str, grid))} compile",
                "method": method,
                "step_ms": step,
                "peak_GiB": p.memory_GiB,
            }
        )
    (tmp_path / "job.json").write_text(json.dumps({"meta": meta, "cases": cases}))
    points, skipped = report.planner_points([str(tmp_path / "job.json")])
    assert (
        not skipped
        and len(points) == 2
        and points[0]["step_err"] == pytest.approx(0)
        and points[0]["mem_err"] == pytest.approx(0)
    )
    (choice,) = report.choices(points)
    assert choice["best"] == "3d 2x2x1 compile" and choice["loss"] == pytest.approx(
        choice["pick_ms"] / 1.0 - 1
    )


def test_train_job_cases_parse_and_refuse_bad_input():
    """Case names parse to methods and back; a case that does not fit the world is refused with its
    numbers; a profiled case is found whatever the order of its words, and one that is no case is refused."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import train_job

    for text in (
        "3d 1x2x1 dp2 async",
        "3d 4x1x1 compile regather ahead1 early",
        "3d auto",
        "tp-sp compile async",
        "fsdp2-tp 2x2 compile",
        "ddp",
        "fsdp2 compile noreshard bf16grad",
    ):
        assert train_job.Method.parse(text, 4).label == text
    assert (
        not train_job.Method.parse("fsdp2 noreshard", 4).reshard
        and train_job.Method.parse("fsdp2", 4).reshard
    )
    for text, words in (
        ("3d 2x2x2", "dp·px·py·pz = 8"),
        ("fsdp2-tp 2x4", "dp·tp = 8"),
        ("megatron", "first word"),
        ("tp fast", "'fast'"),
        ("3d 4x1x1 noreshard", "FSDP2's setting"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            train_job.Method.parse(text, 4)
    methods = [
        train_job.Method.parse(text, 4) for text in ("3d 4x1x1 compile", "fsdp2 compile noreshard bf16grad")
    ]
    assert train_job.profiled_labels("--profile", "fsdp2 compile bf16grad noreshard;", methods, 4) == {
        "fsdp2 compile noreshard bf16grad"
    }
    with pytest.raises(SystemExit, match=re.escape("--host-profile names ['3d 2x2x1'], not among the cases")):
        train_job.profiled_labels("--host-profile", "3d 4x1x1 compile;3d 2x2x1", methods, 4)


def test_largest_model_extrapolates_peak_memory_per_layer(tmp_path):
    """``report.py --largest``: a line through each case's peaks, the most layers under the usable memory."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import report

    for layers, peaks in ((8, {"3d 1x4x1": 10.0, "fsdp2": 20.0}), (16, {"3d 1x4x1": 14.0, "fsdp2": 36.0})):
        cases = [{"case": k, "peak_GiB": v} for k, v in peaks.items()] + [
            {"case": "ddp", "error": "OutOfMemoryError"}
        ]
        (tmp_path / f"L{layers}.json").write_text(
            json.dumps({"meta": {"config": {"n_layer": layers}, "gpu_GiB": 80.0}, "cases": cases})
        )
    text = report.largest([str(tmp_path / "L8.json"), str(tmp_path / "L16.json")])
    # 3d: 6 GiB + 0.5 GiB a layer under 0.92·80 = 73.6 GiB → 135 layers; fsdp2: 4 + 2 a layer → 34
    assert "| 3d 1x4x1 | 8: 10.00, 16: 14.00 | 0.50 | 135 |" in text, text
    assert "| fsdp2 | 8: 20.00, 16: 36.00 | 2.00 | 34 |" in text, text
    assert "| ddp | 8: failed, 16: failed | – | fewer than 8 |" in text, text


def test_repeats_take_each_cases_median_over_processes(tmp_path):
    """``report.py --repeats``: every case's median, least and most step over the files, and the
    best 3-D median against the best peer's."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import report

    runs = (
        {"3d 4x1x1 compile": 100.0, "fsdp2 compile": 108.0},
        {"3d 4x1x1 compile": 110.0, "fsdp2 compile": 101.0},
        {"fsdp2 compile": 102.0, "3d 4x1x1 compile": 104.0, "ddp": None},
    )
    for n, steps in enumerate(runs):
        cases = [
            {"case": k, "step_ms": v, "tokens_per_s": 1e6 / v, "mfu": 50 / v, "peak_GiB": 10.0 + n}
            if v
            else {"case": k, "error": "OutOfMemoryError"}
            for k, v in steps.items()
        ]
        (tmp_path / f"p{n}.json").write_text(json.dumps({"meta": {}, "cases": cases}))
    text = report.repeats([str(tmp_path / f"p{n}.json") for n in range(3)])
    assert "| 3d 4x1x1 compile | 3 | 104.0 | 100.0 | 110.0 | 9,615 | 48.1% | 11.00 (10.00–12.00) |" in text, (
        text
    )
    assert "| fsdp2 compile | 3 | 102.0 | 101.0 | 108.0 |" in text, text
    assert (
        "ddp" not in text
        and "best 3-D 3d 4x1x1 compile against best peer fsdp2 compile, medians: 0.98×" in text
    ), text


def test_profile_timelines_from_traces(tmp_path):
    """``kernel_timeline`` splits a trace's GPU time by kind and exposure (also by collective); ``peer_waits``
    aligns two ranks' traces on the wall clock (different bases) and splits each collective into the wait for
    the last rank and the time after it; a kernel name whose count differs between ranks is left out."""
    import gzip

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import measure

    def trace(path, base_ns, kernels):
        events = [
            {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur} for name, ts, dur in kernels
        ]
        with gzip.open(path, "wt") as f:
            json.dump({"baseTimeNanoseconds": base_ns, "traceEvents": events}, f)
        return str(path)

    gather, reduce = "ncclDevKernel_AllGather_RING_LL", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    # rank 0's clock base is 1000 µs earlier: its ts are 1000 larger for the same instants
    r0 = trace(
        tmp_path / "r0.json.gz",
        0,
        [(gather, 1100, 50), ("nvjet_gemm", 1120, 60), (gather, 1300, 20), (reduce, 1400, 5)],
    )
    r1 = trace(tmp_path / "r1.json.gz", 1_000_000, [(gather, 130, 20), (gather, 290, 30)])
    timeline = measure.kernel_timeline(r0)
    assert timeline["by_kind_ms_count"]["communication"] == [0.075, 3] and timeline["by_kind_ms_count"][
        "matmul"
    ] == [0.06, 1]
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
