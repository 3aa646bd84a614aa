"""SIGTERM to one rank of a Lightning run: every rank stops at the same step, saves, exits; resuming loses nothing.

Real processes launched by Lightning (2 ranks, gloo, collective timeout 60 s); the driver is
``lightning_scripts/preempt.py``. Without the agreed stop, the signalled rank would leave alone and
the others would wait in their next collective until the timeout. The vote itself runs in the
harness's world of 2: a signal to either rank, rank 0 included, stops both; no signal stops none.
"""

import signal
import subprocess
import sys
from pathlib import Path

import harness
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent / "lightning_scripts"))

import common
from side_by_side import run_side_by_side
from test_strategy import SCRIPTS, _env, assert_close, records

from lightning_3d import checkpoint as ckpt
from lightning_3d.strategy.preemption import Preempted, PreemptionWatch


def test_sigterm_on_one_rank_stops_every_rank_with_a_checkpoint_and_resume_is_exact(tmp_path):
    driver = [sys.executable, str(SCRIPTS / "preempt.py"), str(tmp_path)]
    run = subprocess.run(
        driver + ["preempt"], env=_env(), capture_output=True, text=True, timeout=240, check=False
    )
    log = run.stdout + run.stderr
    assert run.returncode == 128 + signal.SIGTERM, f"exit status {run.returncode}:\n{log[-3000:]}"
    saved = tmp_path / "preempted.ckpt"
    assert (
        f"tensor3d: rank 1 received SIGTERM; every rank stopped at global step 3 and saved a checkpoint to {saved}"
        in log
    ), log[-3000:]
    assert log.count("received SIGTERM; every rank stopped") == 1, (
        "the stop must be announced once, by rank 0"
    )
    signalled = float((tmp_path / "signalled_at").read_text())
    exits = [float((tmp_path / f"exit.rank{r}").read_text()) for r in range(2)]
    assert max(exits) - signalled < 30, (
        f"ranks exited {[round(e - signalled, 1) for e in exits]} s after the signal"
    )
    assert ckpt.read_record(saved) and (saved / "meta.pt").is_file()

    written = (saved / "manifest.json").stat().st_mtime_ns
    resumed = subprocess.run(
        driver + ["resume"], env=_env(), capture_output=True, text=True, timeout=240, check=False
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert (saved / "manifest.json").stat().st_mtime_ns == written, (
        "the resumed run rewrote the checkpoint it started from"
    )
    rec = records(tmp_path, "resumed")
    assert all(r["global_step"] == 9 for r in rec)
    assert_close(
        rec[0]["loss"],
        common.dense_reference(9)["loss"][3:9],
        "losses after resuming from the preemption checkpoint",
    )


def test_a_second_signal_or_a_stalled_stop_exits_at_once():
    """The deadline and the second signal end the process with 128 + signal and one line, whatever it was doing."""
    code = (
        "import datetime, os, signal, time\n"
        "from lightning_3d.strategy.preemption import PreemptionWatch\n"
        "w = PreemptionWatch(rank=3, grace=datetime.timedelta(seconds={grace}))\n"
        "w.take_signals()\n"
        "print(time.monotonic(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "{then}\n"
        "time.sleep(60)\n"
    )

    children = {"stalled": (1, "pass"), "again": (30, "os.kill(os.getpid(), signal.SIGINT)")}
    done = run_side_by_side(
        {
            name: dict(args=[sys.executable, "-c", code.format(grace=grace, then=then)])
            for name, (grace, then) in children.items()
        },
        timeout=120,
    )
    stalled, again = done["stalled"], done["again"]
    assert (
        stalled.returncode == 143
        and "rank 3 received SIGTERM but the ranks did not stop within 1 s" in stalled.stderr
    ), stalled.stderr
    assert again.returncode == 130 and "rank 3 received SIGINT again while stopping" in again.stderr, (
        again.stderr
    )
    waited = {
        name: run.ended - float(run.stdout.split()[0]) for name, run in done.items()
    }  # from the signal to the exit
    assert max(waited.values()) < 15, waited  # at once, not after the 30 s grace


def test_preempted_is_a_clean_exit_with_the_signal_status():
    stop = Preempted(signal.SIGINT, "why")
    assert isinstance(stop, SystemExit) and stop.code == 130 and str(stop) == "why"


def vote_job(signalled: int | None) -> list:
    """What three votes of a :class:`PreemptionWatch` returned on this rank, ``signalled`` (a rank, or None) sent
    SIGTERM after the first: a vote returns what the vote started a step earlier found."""
    rank = dist.get_rank()
    watch = PreemptionWatch(rank)
    watch.take_signals()  # the vote on the default group: install() would make a group of its own
    try:
        votes = [watch.agreed()]
        if rank == signalled:
            signal.raise_signal(signal.SIGTERM)
        votes += [watch.agreed(), watch.agreed()]
        watch.finish()
    finally:
        watch.uninstall()
    return votes


def test_a_signal_to_any_rank_stops_every_rank_and_none_stops_none():
    for signalled in (None, 0, 1):
        stop = None if signalled is None else (int(signal.SIGTERM), signalled)
        assert harness.run(2, vote_job, signalled, timeout=60) == [[None, None, stop]] * 2, signalled
