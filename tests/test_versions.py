"""Supported versions: ``lightning_3d.versions.MINIMUMS`` against ``pyproject.toml``, the refusal and where it
is raised."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from lightning_3d.versions import MINIMUMS, require, unsupported

ROOT = Path(__file__).parent.parent


def declared_lower_bounds() -> dict[str, set[str]]:
    """{distribution: the ``>=`` bounds of every requirement on it} in pyproject.toml (dependencies and extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds: dict[str, set[str]] = {}
    for line in project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]:
        requirement = Requirement(line)
        bounds.setdefault(requirement.name, set()).update(
            s.version for s in requirement.specifier if s.operator == ">="
        )
    return bounds


def test_pyproject_lower_bounds_are_the_supported_minimums():
    bounds = declared_lower_bounds()
    assert {package: bounds.get(package) for package in MINIMUMS} == {
        package: {v} for package, v in MINIMUMS.items()
    }


def older_than(minimum: str) -> str:
    major, minor = (int(n) for n in minimum.split(".")[:2])
    return f"{major}.{minor - 1}.9" if minor else f"{major - 1}.99.0"


@pytest.mark.parametrize("package", MINIMUMS)
def test_an_older_version_is_refused_with_the_range_and_the_fix(package):
    minimum = MINIMUMS[package]
    older = older_than(minimum)
    message = unsupported(package, older)
    assert (
        f"{package} {older} is installed" in message and f'pip install "{package}>={minimum}"' in message
    ), message
    assert (
        unsupported(package, f"{minimum}.0rc1") is not None
    )  # a pre-release of the minimum is older than it
    major = int(minimum.split(".")[0])
    for supported in (minimum, f"{minimum}.0+cpu", f"{minimum}.1.post0", f"{major + 1}.0.0"):
        assert unsupported(package, supported) is None, supported


def test_the_installed_versions_are_supported_and_every_integration_imports():
    import deepspeed_3d  # noqa: F401
    from lightning_3d.strategy import FABRIC_NAMESPACES, NAMESPACES, register

    for package in MINIMUMS:
        require(package)
    for namespace in {**NAMESPACES, **FABRIC_NAMESPACES}:
        register(namespace)


# Each integration's entry point, run after its library is made to report an older version than supported: one
# ImportError naming the version, the range and the fix, before the library is used.
ENTRY_POINTS = {
    "transformers": (
        "import sys, lightning_3d, torch.distributed as dist\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), world_size=1, rank=0)\n"
        "model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2))\n"
        "sys.modules['transformers'].__version__ = '{version}'\n"
        "lightning_3d.parallelize(model, grid=lightning_3d.init_grid((1, 1, 1)))"
    ),
    "deepspeed": "import deepspeed\ndeepspeed.__version__ = '{version}'\nimport deepspeed_3d",
    # lightning is imported first, so the Trainer's and Fabric's strategies register (and check) as lightning_3d is
    "lightning": "import lightning\nlightning.__version__ = '{version}'\nimport lightning_3d",
}


@pytest.mark.parametrize("package", ENTRY_POINTS)
def test_an_integration_refuses_an_older_library_where_it_is_entered(package):
    version = older_than(MINIMUMS[package])
    code = ENTRY_POINTS[package].format(version=version)
    run = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert run.returncode == 1 and run.stderr.strip().endswith(
        f"ImportError: {unsupported(package, version)}"
    ), run.stderr[-2000:]
