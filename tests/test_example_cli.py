"""The examples' command lines: every option shows its default; the DeepSpeed one names the install command when DeepSpeed is missing."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
EXAMPLES = ["train_gpt.py", "train_gpt_deepspeed.py", "quickstart_lightning.py", "finetune_hf.py"]


def _run(args, **env):
    import os

    path = os.pathsep.join(filter(None, [env.pop("PREPEND", None), str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": path, **env})


@pytest.mark.parametrize("example", EXAMPLES)
def test_help_shows_every_default(example):
    run = _run([f"examples/{example}", "--help"])
    assert run.returncode == 0, run.stderr[-2000:]
    blocks = [b for b in re.split(r"\n  (?=-)", run.stdout.split("options:")[1]) if b.strip()]  # one per option, wrapped lines included
    options = [b.split()[0].rstrip(",") for b in blocks]
    undocumented = [o for o, b in zip(options, blocks) if o != "-h" and "(default:" not in " ".join(b.split())]
    assert options and not undocumented, f"{example}: no default shown for {undocumented}"


def test_deepspeed_example_names_the_extra_when_deepspeed_is_missing(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None  # as if not installed\n")
    run = _run(["examples/train_gpt_deepspeed.py", "--help"], PREPEND=str(tmp_path))
    assert run.returncode != 0
    assert 'pip install -e ".[deepspeed]"' in run.stderr, run.stderr[-2000:]
