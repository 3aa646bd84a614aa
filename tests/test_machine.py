"""The machine's rates measured on real gloo process groups: positive, per group size, and a
round trip through the JSON the benchmarks record; the groups measured in are destroyed."""

import os

import harness
from checks import gloo_threads

from lightning_3d import cost

COUNTS_THREADS = os.path.isdir("/proc/self/task")


def measure_job(gpus_per_node):
    import torch

    from lightning_3d.cost import CPU, measure_machine

    before = gloo_threads()
    rates = measure_machine(torch.device("cpu"), gpus_per_node, CPU).rates()
    assert not COUNTS_THREADS or gloo_threads() == before, (
        f"measure_machine left {gloo_threads() - before} gloo groups"
    )
    return rates


def test_two_ranks_on_one_node_measure_links_of_size_2():
    ranks = harness.run(2, measure_job, None)
    rates = ranks[0]
    assert rates["matmul_tflops"] > 0 and rates["hbm_GBps"] > 0 and rates["gpus_per_node"] == 2
    for op in cost.OPS:
        link = rates["intra"][op]["2"]
        assert link["busbw_GBps"] > 0 and link["latency_us"] > 0
    assert all(r["intra"] == rates["intra"] for r in ranks)  # the slowest rank's times, the same everywhere
    machine = cost.Machine.from_rates(rates)
    assert (
        machine.rates() == rates
        and machine.link("all_reduce", 2, False).busbw_GBps == rates["intra"]["all_reduce"]["2"]["busbw_GBps"]
    )


def test_one_rank_per_node_measures_the_links_between_nodes():
    rates = harness.run(2, measure_job, 1)[0]
    assert rates["gpus_per_node"] == 1
    assert all(rates["inter"][op]["busbw_GBps"] > 0 for op in cost.OPS)
    assert (
        rates["intra"] == cost.DEFAULT_MACHINE.rates()["intra"]
    )  # no group inside a node: the defaults stay
