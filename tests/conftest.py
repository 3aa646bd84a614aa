import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import harness  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    harness.close_all()
