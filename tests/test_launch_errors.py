"""Configuration errors: refused at construction or in the launching process, before any other process starts;
one raised inside the world is printed once (rank 0's traceback), the other ranks saying one line each."""

import datetime
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "lightning_scripts"))

from test_strategy import SCRIPTS, _env

from lightning_3d import Tensor3DStrategy
from lightning_3d.cost import ModelShape
from lightning_3d.strategy.failures import ConfigurationError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"options": {"async_tp": True}}, "options must be a lightning_3d.RuntimeOptions or None"),
        ({"options": True}, "got True (a bool): e.g. options=RuntimeOptions(async_tp=True)"),
        ({"async_tp": True}, "pass options=lightning_3d.RuntimeOptions(async_tp=...)"),
        ({"timeout": datetime.timedelta(0)}, "timeout must be positive, got datetime.timedelta(0)"),
        ({"timeout": float("inf")}, "timeout must be a positive, finite number of seconds, got inf"),
        ({"timeout": -5}, "got -5"),
        ({"grid": (2.7, 1, 1)}, "(2.7, 1, 1)"),
        ({"grid": (2, 0, 1)}, "(2, 0, 1)"),
        ({"grid": "221"}, "'221'"),
        ({"zero_stage": True}, "zero_stage must be 0 or 1"),
        ({"bucket_cap": 5}, "['bucket_cap'] are not DistributedDataParallel arguments"),
        ({"process_group": None}, "device_ids and process_group are the strategy's"),
    ],
)
def test_constructor_refuses_wrong_types_and_values(kwargs, message):
    with pytest.raises(ValueError) as error:
        Tensor3DStrategy(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"grid": (3, 1, 1)}, "the world size 4 is not divisible by px·py·pz = 3"),
        (
            {"grid": (2, 2, 1), "data_parallel_size": 2},
            "world size 4 != data_parallel_size·px·py·pz = 2·4 = 8",
        ),
        (
            {"grid": (2, 2, 1), "model_shape": ModelShape(hidden=30, heads=4, seq=8, batch=4, layers=1)},
            "does not split on the 2×2×1 grid with data_parallel_size=1: hidden % px·py != 0",
        ),
    ],
)
def test_grid_against_devices_is_refused_in_the_launching_process(kwargs, message):
    """``Trainer(...)`` raises at once, in this process: Lightning starts no other process."""
    import lightning.pytorch as pl

    with pytest.raises(ConfigurationError) as error:
        pl.Trainer(accelerator="cpu", devices=4, strategy=Tensor3DStrategy(**kwargs), logger=False)
    assert message in str(error.value)


def test_an_error_inside_the_world_is_printed_once():
    """Timed from rank 0's ``configure_model`` to the exit (one machine-wide monotonic clock), not
    from the start: interpreters importing Lightning can take a minute on a loaded 2-core machine."""
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bad_config.py")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    log = run.stdout + run.stderr
    started = re.search(r"configure_model at ([0-9.]+)", log)
    assert started, log[-4000:]
    took = time.monotonic() - float(started.group(1))
    assert run.returncode != 0
    assert log.count("Traceback (most recent call last)") == 1, log[-4000:]
    assert "ConfigurationError" in log, log[-4000:]
    # the other rank says at most one line (still starting, it may be ended by rank 0's exit first)
    quiet = re.findall(r"tensor3d: rank (\d+): ConfigurationError", log)
    assert quiet in ([], ["1"]), quiet
    assert took < 60, f"the error took {took:.0f} s to surface (the collective timeout is 60 s)"
