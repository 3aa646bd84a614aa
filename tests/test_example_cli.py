"""The examples' command lines: every option shows its default; the DeepSpeed one names the install command
when DeepSpeed is missing.

``--help`` runs each example in this process (its imports are this process's: no interpreter to
start); DeepSpeed missing needs an interpreter of its own.
"""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
EXAMPLES = [
    "train_gpt.py",
    "train_gpt_deepspeed.py",
    "train_gpt_deepspeed_pipeline.py",
    "quickstart_lightning.py",
    "finetune_hf.py",
    "fabric_litgpt.py",
]


@pytest.mark.parametrize("example", EXAMPLES)
def test_help_shows_every_default(example, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [example, "--help"])
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # as a script's own folder is
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "examples" / example), run_name="__main__")
    out = capsys.readouterr().out
    assert done.value.code == 0, out[-2000:]
    blocks = [
        b for b in re.split(r"\n  (?=-)", out.split("options:")[1]) if b.strip()
    ]  # one per option, wrapped lines included
    options = [b.split()[0].rstrip(",") for b in blocks]
    undocumented = [
        o for o, b in zip(options, blocks) if o != "-h" and "(default:" not in " ".join(b.split())
    ]
    assert options and not undocumented, f"{example}: no default shown for {undocumented}"


def test_deepspeed_example_names_the_extra_when_deepspeed_is_missing(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['deepspeed'] = None  # as if not installed\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "examples/train_gpt_deepspeed.py", "--help"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert run.returncode != 0
    assert 'pip install -e ".[deepspeed]"' in run.stderr, run.stderr[-2000:]
