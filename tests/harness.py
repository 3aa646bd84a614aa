"""Real multi-process gloo workers, spawned once per world size and reused by every test.

``run(world_size, fn, *args)`` runs ``fn(*args)`` on every rank and returns the per-rank results.
``fn`` must be importable (a module-level function). Process groups a job leaves behind are
destroyed after it, but those of the grids :func:`grid` keeps: each gloo group keeps a thread that
wakes every 10 ms. Kept from every earlier job, they grew to 40–70 threads in each of the 14
workers of worlds 8, 4 and 2 by the end of the suite, and a worker holding 71 spent 11% of a core
on them: about half of a 2-core machine, doing nothing. Every collective is bounded by the process
group's timeout, and the driver waits at most ``JOB_TIMEOUT`` seconds: a hung or failed job kills
the pool (a fresh one is spawned for the next test) and fails the test with every rank's report.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
JOB_TIMEOUT = 240.0

KEPT_GRIDS = (
    2  # a job may use two grids at once (resharding); each kept gloo group's thread wakes every 10 ms
)

_grids: dict = {}  # (shape, dp) → Grid, least recently asked first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        before = _live_groups()
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report every failure to the driver, with its traceback
            results.put((rank, False, traceback.format_exc()))
        kept = {id(g) for grid in _grids.values() for g in grid._groups.values()}
        for group in (
            _live_groups() - before
        ):  # left by the job (its own grids, DeepSpeed's, ...): every rank alike
            if id(group) not in kept:
                dist.destroy_process_group(group)
        gc.collect()  # a destroyed group's backend, and its thread, go with its last reference, often in a cycle
    dist.destroy_process_group()


def _live_groups() -> set:
    """This process's live process groups. Private: torch lists them nowhere public."""
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


def grid(shape, dp=None):
    """The worker's grid of this shape, made current; group creation and destruction are collective,
    so every rank asks alike. The last ``KEPT_GRIDS`` grids asked for are kept and an older one is
    destroyed (its groups' threads: see above)."""
    import lightning_3d

    key = (tuple(shape), dp)
    if key not in _grids:
        while len(_grids) >= KEPT_GRIDS:
            lightning_3d.destroy_grid(_grids.pop(next(iter(_grids))))
        _grids[key] = lightning_3d.init_grid(shape, dp)
    _grids[key] = _grids.pop(key)  # the most recently asked for goes last
    lightning_3d.set_grid(_grids[key])
    return _grids[key]


class Pool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = JOB_TIMEOUT) -> list:
        for q in self.tasks:
            q.put((fn, args))
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(
                    f"{fn.__name__}: not every rank answered within {timeout:.0f}s (a hang); reports: {errors}"
                ) from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                if len(errors) == 1:
                    timeout = (
                        COLLECTIVE_TIMEOUT.total_seconds() + 30
                    )  # the others fail by their collective timeout
        if errors:
            self.close()
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        _pools.pop(self.world_size, None)


_pools: dict[int, Pool] = {}


def run(world_size: int, fn, *args, timeout: float = JOB_TIMEOUT) -> list:
    """Run ``fn(*args)`` on every rank of a (reused) gloo world of ``world_size`` processes."""
    if world_size not in _pools:
        _pools[world_size] = Pool(world_size)
    return _pools[world_size].run(fn, *args, timeout=timeout)


def close_all() -> None:
    for pool in list(_pools.values()):
        for q in pool.tasks:
            q.put(None)
        pool.close()


atexit.register(close_all)
