"""The cost model: consistent counts, sensible choices, clear errors, and agreement with the
points measured on 4× H200 (every file under benchmarks/results/: runs 2, 3, 5, 6, 7 and the two
calls before run 5; the last five with collective matmuls)."""

import glob
import os
import sys

from dataclasses import replace

import pytest

from lightning_3d import planner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = sorted(path for run in ("2026-11-26-h200x4", "2026-11-26-h200x4-run3", "2026-11-26-h200x4-calls-b7b8312-c397bc0",
                                  "2026-11-26-h200x4-run5", "2026-11-26-h200x4-run6", "2026-11-26-h200x4-run7")
                 for path in glob.glob(os.path.join(ROOT, "benchmarks", "results", run, "bench_w*.json")))
A = planner.ModelShape(4096, 32, 2048, 8, 4)
B = planner.ModelShape(8192, 64, 2048, 4, 2)


def test_one_rank_3d_equals_plain_model():
    p3, p1 = planner.predict_3d(A, (1, 1, 1)), planner.predict_1d(A, 1)
    assert p3.exposed_comm_ms == p1.exposed_comm_ms == 0.0
    assert p3.step_ms == pytest.approx(p1.step_ms, rel=0.02)
    assert p3.memory_GiB == pytest.approx(p1.memory_GiB, rel=0.1)


def test_more_gpus_cost_less_time_and_memory_per_gpu():
    one, four = planner.predict_3d(A, (1, 1, 1)), planner.predict_3d(A, (2, 2, 1))
    assert four.step_ms < one.step_ms / 2 and four.memory_GiB < one.memory_GiB / 2
    assert four.exposed_comm_ms > 0


def test_regathering_trades_memory_for_communication():
    saved, regathered = planner.predict_3d(B, (2, 2, 1)), planner.predict_3d(B, (2, 2, 1), save_gathered=False)
    assert regathered.memory_GiB < saved.memory_GiB and regathered.comm_ms > saved.comm_ms


def test_grid_error_names_the_broken_rule():
    assert planner.grid_error(A, (2, 2, 1), 1) is None
    assert planner.grid_error(planner.ModelShape(4096, 6, 2048, 8, 4), (1, 4, 1), 1) == "heads % py"
    assert planner.grid_error(planner.ModelShape(4096, 32, 2048, 2, 4), (2, 2, 1), 1) == "batch/dp % px·py"


def test_best_grid_is_the_fastest_feasible_candidate():
    grid = planner.best_grid(4096, 32, 2048, 8, 4, world=4)
    options = planner.candidates(A, 4, include_1d=False)
    assert grid == options[0].grid and sum(options[0].grid) >= 3 and options[0].dp == 4 // (grid[0] * grid[1] * grid[2])
    assert {p.method for p in planner.candidates(A, 4)} == {"3d", "1d"}


def test_best_grid_errors():
    with pytest.raises(ValueError, match="divides"):
        planner.best_grid(4096, 32, 2048, 3, 4, world=4)
    tiny = planner.Machine.from_bench({"matmul_tflops": 700.0, "copy_GBps": 4000.0}, memory_GiB=0.5)
    with pytest.raises(ValueError, match="fits 0 GiB|fits 1 GiB|needs"):
        planner.best_grid(4096, 32, 2048, 8, 4, world=4, machine=tiny)


def test_nodes_slow_groups_that_span_them():
    m = planner.DEFAULT_MACHINE
    inside, across = planner.predict_3d(A, (8, 1, 1), 1, m), planner.predict_3d(A, (8, 1, 1), 1, planner.Machine.from_bench(
        {"matmul_tflops": m.matmul_tflops, "copy_GBps": m.hbm_GBps}, gpus_per_node=4))
    assert across.comm_ms > 2 * inside.comm_ms


@pytest.mark.parametrize("grid, dp, gpus, axes", [
    ((2, 2, 2), 2, 8, ("dp",)),  # a cube per node, dp across
    ((2, 2, 2), 2, 4, ("dp", "x")),  # a cube on two nodes of 4: x (weights) across, y and z (activations) inside
    ((1, 4, 2), 1, 4, ("y",)),
    ((2, 2, 2), 2, 16, ()),
    ((4, 1, 1), 4, 8, ("dp",)),
])
def test_node_axes_follow_the_rank_order(grid, dp, gpus, axes):
    assert planner.node_axes(grid, dp, replace(planner.DEFAULT_MACHINE, gpus_per_node=gpus)) == axes


def test_inter_node_links_price_exactly_the_groups_that_span_nodes():
    m = planner.DEFAULT_MACHINE
    nodes_of = {g: replace(m, gpus_per_node=g) for g in (4, 8, 16)}
    one_node, dp_across, x_across = (planner.predict_3d(A, (2, 2, 2), 2, nodes_of[g]) for g in (16, 8, 4))
    # dp across nodes: only the gradient all-reduce moves to the slower link
    assert dp_across.detail["dp_sync_ms"] > 5 * one_node.detail["dp_sync_ms"]
    assert dp_across.comm_ms - dp_across.detail["dp_sync_ms"] == pytest.approx(one_node.comm_ms - one_node.detail["dp_sync_ms"])
    # x across nodes too: the weight gathers slow down
    assert x_across.comm_ms > dp_across.comm_ms and x_across.detail["dp_sync_ms"] == pytest.approx(dp_across.detail["dp_sync_ms"])
    # a faster network narrows the gap
    fast = replace(nodes_of[4], inter={op: planner.Link(360.0, 40.0) for op in planner.OPS})
    assert planner.predict_3d(A, (2, 2, 2), 2, fast).comm_ms < x_across.comm_ms


def test_collective_matmuls_only_on_cubes_inside_a_node():
    two_nodes = replace(planner.DEFAULT_MACHINE, gpus_per_node=8)
    shape = planner.ModelShape(8192, 64, 2048, 16, 48)
    assert all(8 % (p.grid[0] * p.grid[1] * p.grid[2]) == 0 for p in planner.candidates(shape, 16, two_nodes, False, async_tp=True))
    assert max(p.grid[0] * p.grid[1] * p.grid[2] for p in planner.candidates(shape, 16, two_nodes, False)) == 16


def test_collective_matmuls_hide_the_activation_collectives():
    """At h=8192 on 1×4×1 each block's product outlasts its copy: only the pipelines' barriers stay exposed."""
    plain, fused = planner.predict_3d(B, (1, 4, 1)), planner.predict_3d(B, (1, 4, 1), async_tp=True)
    assert fused.exposed_comm_ms < 0.7 * plain.exposed_comm_ms and fused.step_ms < plain.step_ms
    assert planner.predict_3d(B, (4, 1, 1), async_tp=True).step_ms == planner.predict_3d(B, (4, 1, 1)).step_ms  # no activation axis


def test_predictions_within_15_percent_of_every_measured_point():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_planner

    assert len(RESULTS) == 15  # runs 2, 3, 5, 6, 7 and the two calls before run 5
    points = check_planner.rows(RESULTS)
    assert len(points) >= 240 and sum("[async-tp]" in p["case"] for p in points) >= 36
    assert max(abs(p["step_err"]) for p in points) < 0.15
    assert max(abs(p["mem_err"]) for p in points) < 0.15


@pytest.mark.parametrize("nodes, hidden, heads, layers, batch, auto, across, with_async_tp", [
    (2, 2048, 16, 24, 16, ((8, 1, 1), 2), ("dp",), ((8, 1, 1), 2)),
    (2, 4096, 32, 32, 8, ((2, 4, 2), 1), ("x",), ((1, 4, 2), 2)),
    (2, 8192, 64, 48, 4, ((1, 4, 4), 1), ("y",), None),
    (16, 2048, 16, 24, 128, ((8, 1, 1), 16), ("dp",), ((8, 1, 1), 16)),
    (16, 4096, 32, 32, 64, ((4, 4, 2), 4), ("dp", "x"), ((1, 4, 2), 16)),
    (16, 8192, 64, 48, 32, ((4, 4, 4), 2), ("dp", "x", "y"), None),
])
def test_auto_grids_on_nodes_of_8_as_docs_cluster_states(nodes, hidden, heads, layers, batch, auto, across, with_async_tp):
    from lightning_3d.strategy import grid_rules

    shape, world = planner.ModelShape(hidden, heads, 2048, batch, layers), 8 * nodes
    assert grid_rules.resolve("auto", "auto", world, 8, shape) == auto
    assert planner.node_axes(*auto, replace(planner.DEFAULT_MACHINE, gpus_per_node=8)) == across
    if with_async_tp is None:
        with pytest.raises(ValueError, match="no px·py·pz grid"):
            grid_rules.resolve("auto", "auto", world, 8, shape, async_tp=True)
    else:
        assert grid_rules.resolve("auto", "auto", world, 8, shape, async_tp=True) == with_async_tp


# ------------------------------------------------------------------ the whole training job

LLAMA_7B = planner.ModelShape(4096, 32, 2048, 8, 32, 11008, kv_heads=8, gated=True, vocab=32000)
SLOW = replace(planner.DEFAULT_MACHINE, intra={op: {g: planner.Link(15.0, 50.0) for g in table}
                                               for op, table in planner.DEFAULT_MACHINE.intra.items()})


def test_the_whole_job_costs_more_than_its_blocks_and_needs_the_vocabulary():
    job, blocks = planner.predict_job(LLAMA_7B, (2, 2, 1)), planner.predict_3d(LLAMA_7B, (2, 2, 1))
    assert job.step_ms > blocks.step_ms and job.memory_GiB > blocks.memory_GiB
    assert job.detail["head_ms"] > 0 and job.detail["loss_ms"] > 0 and job.detail["optimizer_ms"] > 0
    with pytest.raises(ValueError, match="vocab=V"):
        planner.predict_job(A, (1, 1, 1))


def test_whole_job_time_grows_with_layers_batch_and_slower_links():
    deeper, bigger = replace(LLAMA_7B, layers=40), replace(LLAMA_7B, batch=16)
    for grid, dp in ((1, 1, 1), 4), ((2, 2, 1), 1), ((1, 4, 1), 1), ((4, 1, 1), 1):
        base = planner.predict_job(LLAMA_7B, grid, dp)
        assert planner.predict_job(deeper, grid, dp).step_ms > base.step_ms
        assert planner.predict_job(bigger, grid, dp).step_ms > base.step_ms
        assert planner.predict_job(LLAMA_7B, grid, dp, SLOW).step_ms > base.step_ms
    one = planner.predict_job(LLAMA_7B, (1, 1, 1), 1)
    assert planner.predict_job(LLAMA_7B, (1, 1, 1), 1, SLOW).step_ms == one.step_ms  # nothing to communicate
    # the grid that moves more bytes loses more to the slow links
    grids = ((1, 4, 1), (2, 2, 1), (4, 1, 1))
    comm = {g: planner.predict_job(LLAMA_7B, g, 1, SLOW).comm_ms for g in grids}
    slowdown = {g: planner.predict_job(LLAMA_7B, g, 1, SLOW).step_ms - planner.predict_job(LLAMA_7B, g, 1).step_ms for g in grids}
    assert sorted(grids, key=comm.get) == sorted(grids, key=slowdown.get)


def test_slow_links_make_auto_pick_a_grid_that_communicates_less():
    fields = {k: getattr(LLAMA_7B, k) for k in ("hidden", "heads", "seq", "batch", "layers", "ffn", "kv_heads", "gated", "vocab")}
    for world in (4, 8):
        fast, slow = planner.best_grid(**fields, world=world), planner.best_grid(**fields, world=world, machine=SLOW)
        assert fast != slow
        comm = {g: planner.predict_job(LLAMA_7B, g, world // (g[0] * g[1] * g[2]), SLOW).comm_ms for g in (fast, slow)}
        assert comm[slow] < comm[fast]


def test_auto_resolves_with_a_given_machine():
    from lightning_3d.strategy import grid_rules

    fast = grid_rules.resolve("auto", "auto", 4, 4, LLAMA_7B)
    slow = grid_rules.resolve("auto", "auto", 4, 4, LLAMA_7B, machine=SLOW)
    assert fast[1] == slow[1] == 1 and fast[0] != slow[0]


def test_whole_job_predictions_on_the_measured_jobs():
    """Every 3d case of the whole-job runs the calibration was fitted on: H100s with NVLink that
    recorded no links (priced with DEFAULT_MACHINE at each file's matmul rate; their compiled cases
    ran the compiled block before it was fixed, and neither their steps nor their memory are
    priced), and the 2-GPU runs with their host's measured links, NVLink and P2P off;
    docs/benchmarks.md names the points off by more than 15%."""
    import json

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_job_planner

    results = os.path.join(ROOT, "benchmarks", "results")
    measured_dir = os.path.join(results, "2026-11-26-h100x2-measured-links")
    calibration = ("2026-11-26-h100x4-compile", "2026-11-26-h100x4-job", "2026-11-26-h100x2-saved-weights")
    files = sorted(f for d in calibration for f in glob.glob(os.path.join(results, d, "**", "job_*.json"), recursive=True))
    points, skipped = check_job_planner.rows(files)
    assert len(points) == 79 and len(skipped) == 7  # the P2P-off files: no measured links
    eager = [p for p in points if "compile" not in p["case"]]
    assert len(eager) == 49 and sum(abs(p["step_err"]) <= 0.15 for p in eager) >= 43  # the misses: GPT-2's cube grids
    assert max(abs(p["step_err"]) for p in eager if p["model"].startswith("llama")) < 0.15
    assert sum(abs(p["mem_err"]) <= 0.15 for p in eager) >= 48
    measured = {}
    for links in ("nvlink", "p2p-off"):
        with open(os.path.join(measured_dir, f"machine_{links}.json")) as f:
            measured[links] = json.load(f)
    points, skipped = check_job_planner.rows(sorted(glob.glob(os.path.join(measured_dir, "job_*.json"))), measured=measured)
    assert len(points) == 16 and not skipped and sum(p["links"] == "p2p-off" for p in points) == 8
    assert max(abs(p["step_err"]) for p in points) < 0.15 and max(abs(p["mem_err"]) for p in points) < 0.15
    assert all(c["loss"] == 0.0 for c in check_job_planner.choices(points))  # the measured fastest grid, both link types


def test_compiled_peak_memory_on_the_latest_runs():
    """The peaks of compiled blocks (which keep about 0.7 of what eager blocks keep for backward,
    ``Machine.compiled_activation_fraction``) in the runs on the current compiled block: within 15%
    except 4×1×1 re-gathering its weights (over-priced by up to 22%) and GPT-2 1×1×1 dp2 (under by 16%)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_job_planner

    results = os.path.join(ROOT, "benchmarks", "results")
    runs = ("h100x4-regather", "h100x4-regather-z", "h100x2-qkv-runs", "h100x2-qkv-apart", "h200x4-ahead-ad", "h200x4-ahead-ae",
            "h100x4-ahead-af", "h100x4-bf16-peers-ag", "h100x4-exposed-ah", "h200x4-late-ai")
    files = sorted(f for d in runs for f in glob.glob(os.path.join(results, f"2026-11-27-{d}", "**", "job_*.json"), recursive=True))
    points, _ = check_job_planner.rows(files)
    compiled = [p for p in points if "compile" in p["case"]]
    misses = [p for p in compiled if abs(p["mem_err"]) > 0.15]
    assert len(compiled) == 69 and len(misses) <= 6, [(p["case"], p["mem_err"]) for p in misses]
    assert all(("4x1x1" in p["case"] and "regather" in p["case"]) or "1x1x1 dp2" in p["case"] for p in misses), misses
    assert max(abs(p["mem_err"]) for p in compiled) < 0.22


def test_whole_job_predictions_and_picks_on_the_latest_runs():
    """The runs with the current compiled block and once-per-step replica sums (4× H200, 4× H100; 1, 2
    and 4 GPUs), each priced with the machine it measured: the model's pick among the measured grids
    within 3% of the measured fastest in every file, and the step times within 15% except GPT-2
    steps on 4 GPUs, which moved by up to 30% between processes of the same code."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_job_planner

    results = os.path.join(ROOT, "benchmarks", "results")
    runs = ("2026-11-27-h200x4-deferred-checks/*", "2026-11-27-h100x4-deferred-checks/*", "2026-11-26-h200x4-replica-sum/run-O")
    files = sorted(f for d in runs for f in glob.glob(os.path.join(results, d, "job_*.json")))
    points, skipped = check_job_planner.rows(files)
    assert len(points) == 43 and not skipped
    misses = [p for p in points if abs(p["step_err"]) > 0.15]
    assert len(misses) <= 4 and all(p["model"].startswith("gpt2") and p["world"] == 4 for p in misses)
    choices = check_job_planner.choices(points)
    assert len(choices) == 11 and all(c["loss"] <= 0.03 for c in choices), choices


def test_whole_job_predictions_on_the_one_graph_compiled_runs():
    """The runs whose compiled blocks are one graph each (4× H100, 2 and 4 GPUs, NVLink and P2P
    off), each priced with the machine it measured: the model's pick the measured fastest in every
    file; Llama-shaped steps within 15% (with ``compiled_job_gemm_efficiency``); the misses are
    GPT-2's cube grids on 4 GPUs with NVLink, whose steps moved by 15–25% between processes."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_job_planner

    run = os.path.join(ROOT, "benchmarks", "results", "2026-11-27-h100x4-one-graph")
    files = sorted(glob.glob(os.path.join(run, "*new*", "job_*.json")) + glob.glob(os.path.join(run, "llama_w2", "job_*.json")))
    points, skipped = check_job_planner.rows(files)
    assert len(points) == 16 and not skipped
    assert max(abs(p["step_err"]) for p in points if p["model"].startswith("llama")) < 0.15
    misses = [p for p in points if abs(p["step_err"]) > 0.15]
    assert all(p["model"].startswith("gpt2") and p["links"] == "nvlink" and p["world"] == 4 for p in misses) and len(misses) <= 4
    assert max(abs(p["mem_err"]) for p in points) < 0.15
    choices = check_job_planner.choices(points)
    assert len(choices) == 5 and all(c["loss"] == 0.0 for c in choices), choices


def test_whole_job_predictions_with_p2p_off_on_four_gpus():
    """The 4-GPU runs with P2P off, each priced with the links measured on its host: every step
    time and peak within 15%, and the model's pick among the measured grids the fastest."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_job_planner

    run = os.path.join(ROOT, "benchmarks", "results", "2026-11-26-h200x4-replica-sum", "run-P")
    points, skipped = check_job_planner.rows(sorted(glob.glob(os.path.join(run, "job_w4_*_p2p-off.json"))))
    assert len(points) == 7 and not skipped and all(p["links"] == "p2p-off" for p in points)
    assert max(abs(p["step_err"]) for p in points) < 0.15 and max(abs(p["mem_err"]) for p in points) < 0.15
    assert all(c["loss"] == 0.0 for c in check_job_planner.choices(points))


def test_whole_job_predictions_on_the_regather_and_one_rank_runs():
    """Runs Y–AC (4× and 2× H100): 3-D 4×1×1 compiled with and without re-gathered weights at Llama
    shapes, GPT-2 with P2P off, and the one-rank cube on 1 and 2 GPUs, each priced with the machine
    it measured: every step time within 15% (the prefetched re-gathers priced as hidden behind the
    previous product's backward)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_job_planner

    results = os.path.join(ROOT, "benchmarks", "results")
    runs = ("2026-11-27-h100x4-regather/*", "2026-11-27-h100x4-regather-z/llama_[cd]", "2026-11-27-h100x4-regather-z/gpt2*",
            "2026-11-27-h100x4-regather-bisect/llama_4l_z", "2026-11-27-h100x2-qkv-runs/*")
    files = sorted(f for d in runs for f in glob.glob(os.path.join(results, d, "job_*.json")))
    points, skipped = check_job_planner.rows(files)
    assert len(points) == 23 and not skipped
    assert max(abs(p["step_err"]) for p in points) < 0.15
    regathered = [p for p in points if "regather" in p["case"]]
    assert len(regathered) == 6 and max(abs(p["step_err"]) for p in regathered) < 0.08  # priced exposed: +10%



def test_whole_job_predictions_on_the_two_gpu_runs():
    """Runs AJ–AP and BH (2× H200, Llama shapes and GPT-2 1.4B on 2 GPUs, Llama shapes on 1; the
    packed outputs read in place; BH with the default options), each priced with the machine it measured: the step times within 15%
    except Llama 2×1×1 in run AP (over-priced by up to 15.9%; by 8–13% in the others), the peaks
    within 15% except Llama 2×1×1 (over by up to 15.5%) and GPT-2 1×1×1 dp2 (under by 15.8%)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_job_planner

    runs = ("groups-aj", "late-ak", "ranks-al", "kernels-am", "rope-ao", "rope-ap", "bh-auto-2gpu")
    points, skipped = check_job_planner.rows(sorted(f for run in runs for f in glob.glob(
        os.path.join(ROOT, "benchmarks", "results", f"2026-11-27-h200x2-{run}", "*", "job_*.json"))))
    assert len(points) == 36 and not skipped
    over = [p for p in points if abs(p["step_err"]) > 0.15]
    assert all("rope-ap" in p["file"] and "2x1x1" in p["case"] and p["step_err"] < 0.16 for p in over), over
    misses = [p for p in points if abs(p["mem_err"]) > 0.15]
    assert all(("2x1x1" in p["case"] and p["mem_err"] < 0.16) or ("1x1x1 dp2" in p["case"] and p["mem_err"] > -0.16)
               for p in misses), [(p["case"], p["mem_err"]) for p in misses]


def test_grads_at_end_takes_a_share_of_the_weight_scatters_off():
    """``grads_at_end`` takes ``late_scatter_fraction`` of the reduce-scatters of the weights gathered
    over x off the step: nothing where px = 1, more where the weights' reduce-scatters are slower;
    with dp > 1 the dp reduction of those gradients starts after backward, hidden behind none of it."""
    none = replace(planner.DEFAULT_MACHINE, late_scatter_fraction=0.0)
    for grid, dp in (((4, 1, 1), 1), ((2, 2, 1), 1), ((2, 1, 1), 2)):
        plain, late = planner.predict_job(LLAMA_7B, grid, dp), planner.predict_job(LLAMA_7B, grid, dp, grads_at_end=True)
        dp_later = late.detail["dp_exposed_ms"] - plain.detail["dp_exposed_ms"]
        assert dp_later == (0 if dp == 1 else pytest.approx(late.detail["dp_sync_ms"] - plain.detail["dp_exposed_ms"]))
        assert 0 < plain.step_ms - late.step_ms + dp_later < plain.detail["blocks_ms"] * 0.1
        assert plain.exposed_comm_ms - late.exposed_comm_ms == pytest.approx(plain.step_ms - late.step_ms)
        assert planner.predict_job(LLAMA_7B, grid, dp, none, grads_at_end=True).step_ms == pytest.approx(plain.step_ms + dp_later)
    for dp in (1, 4):
        grid = (1, 4 // dp, 1)
        assert planner.predict_job(LLAMA_7B, grid, dp, grads_at_end=True).step_ms == planner.predict_job(LLAMA_7B, grid, dp).step_ms
    fast, slow = (planner.predict_job(LLAMA_7B, (4, 1, 1), 1, m).step_ms - planner.predict_job(LLAMA_7B, (4, 1, 1), 1, m, grads_at_end=True).step_ms
                  for m in (planner.DEFAULT_MACHINE, SLOW))
    assert slow > fast


def test_whole_job_predictions_on_the_block_gathered_at_once_runs():
    """Runs AQ–BC (4× H200; 2 and 4 GPUs, NVLink and P2P off; with and without ``grads_at_end``),
    each priced with the machine it measured: every step time within 15% except GPT-2 4×1×1 on 4
    GPUs (host-bound: its steps moved by up to 44% within a case) and 2×2×1 with P2P off without
    the options (+18.6%); every ``grads_at_end`` case at Llama shapes within 15%."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_job_planner

    runs = ("aq-packed-4gpu", "ar-alloc", "as-together", "at-first-alone", "au-repeat", "av-gpt2", "aw-scatter-runs",
            "ax-priority", "ay-host", "az-host-profile", "ba-p2p-layouts", "bb-p2p-peers", "bc-p2p-auto")
    files = sorted(f for run in runs for f in glob.glob(os.path.join(ROOT, "benchmarks", "results", f"2026-11-27-h200x4-{run}", "*", "job_*.json")))
    points, skipped = check_job_planner.rows(files)
    assert len(points) == 85 and not skipped
    misses = [p for p in points if abs(p["step_err"]) > 0.15]
    assert all((p["model"].startswith("gpt2") and p["world"] == 4 and "4x1x1" in p["case"])
               or (p["links"] == "p2p-off" and "late" not in p["case"]) for p in misses), [(p["case"], p["step_err"]) for p in misses]
    late = [p for p in points if "late" in p["case"].split() and p["model"].startswith("llama")]
    assert len(late) >= 20 and max(abs(p["step_err"]) for p in late) < 0.15


def test_whole_job_predictions_on_the_default_options_runs():
    """Runs BD–BH (4× H100, 4× and 2× H200; the options that became the defaults, NVLink and P2P
    off), each priced with the machine it measured: every step time within 15% except GPT-2 on 4
    GPUs, whose host sets the pace."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_job_planner

    runs = ("h100x4-bd-async-nccl", "h100x4-be-options", "h200x4-bf-defaults", "h100x4-bg-auto-p2p", "h200x2-bh-auto-2gpu")
    files = sorted(f for run in runs for f in glob.glob(os.path.join(ROOT, "benchmarks", "results", f"2026-11-27-{run}", "*", "job_*.json")))
    points, skipped = check_job_planner.rows(files)
    assert len(points) == 38 and not skipped
    misses = [p for p in points if abs(p["step_err"]) > 0.15]
    assert all(p["model"].startswith("gpt2") and p["world"] == 4 for p in misses), [(p["case"], p["step_err"]) for p in misses]


def test_half_precision_reductions_move_the_pick_with_p2p_off():
    """Priced with the links run BC measured with P2P off, ``grid="auto"`` picks 2×2×1 for Llama
    shapes; told the dp reduction runs in bf16 (``half_grads``), 1×2×1 with dp 2, the fastest
    layout measured there (249.1 ms against 269.3 for 2×2×1)."""
    import json

    from lightning_3d.strategy import grid_rules

    path = os.path.join(ROOT, "benchmarks", "results", "2026-11-27-h200x4-bc-p2p-auto", "bc_p2p", "job_w4_llama-7b_p2p-off.json")
    with open(path) as f:
        meta = json.load(f)["meta"]
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import check_job_planner

    shape, machine = check_job_planner.shape_of(meta), planner.Machine.from_rates(meta["machine"])
    assert grid_rules.resolve("auto", "auto", 4, 4, shape, machine=machine) == ((2, 2, 1), 1)
    assert grid_rules.resolve("auto", "auto", 4, 4, shape, machine=machine, half_grads=True) == ((1, 2, 1), 2)

