"""The examples' command lines: every option shows its default; the DeepSpeed one names the install command when DeepSpeed is missing.

Each command is an interpreter importing Lightning: they run side by side, started once for the module.
"""

import os
import re
import sys
from pathlib import Path

import pytest
from side_by_side import Finished, run_side_by_side

ROOT = Path(__file__).parent.parent
EXAMPLES = ["train_gpt.py", "train_gpt_deepspeed.py", "quickstart_lightning.py", "finetune_hf.py"]
NO_DEEPSPEED = "train_gpt_deepspeed.py without deepspeed"


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[str, Finished]:
    """``--help`` of every example, and of the DeepSpeed one as if DeepSpeed were not installed."""
    hide = tmp_path_factory.mktemp("no_deepspeed")
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None  # as if not installed\n")
    runs = {example: (example, None) for example in EXAMPLES} | {NO_DEEPSPEED: ("train_gpt_deepspeed.py", hide)}
    commands = {}
    for name, (example, prepend) in runs.items():
        path = os.pathsep.join(filter(None, [prepend and str(prepend), str(ROOT), os.environ.get("PYTHONPATH")]))
        commands[name] = dict(args=[sys.executable, f"examples/{example}", "--help"], cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    return run_side_by_side(commands, timeout=180)


@pytest.mark.parametrize("example", EXAMPLES)
def test_help_shows_every_default(helps, example):
    run = helps[example]
    assert run.returncode == 0, run.stderr[-2000:]
    blocks = [b for b in re.split(r"\n  (?=-)", run.stdout.split("options:")[1]) if b.strip()]  # one per option, wrapped lines included
    options = [b.split()[0].rstrip(",") for b in blocks]
    undocumented = [o for o, b in zip(options, blocks) if o != "-h" and "(default:" not in " ".join(b.split())]
    assert options and not undocumented, f"{example}: no default shown for {undocumented}"


def test_deepspeed_example_names_the_extra_when_deepspeed_is_missing(helps):
    run = helps[NO_DEEPSPEED]
    assert run.returncode != 0
    assert 'pip install -e ".[deepspeed]"' in run.stderr, run.stderr[-2000:]
