"""docs/training.md's commands work as written: each ``pipeexec`` line parses with the flags
the commands have, and (slow) the sections' lines run in order in a scratch directory and
leave what the text says they leave."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import run_pipeexec

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "training.md"
SECTIONS = ("## Validation and logging", "## Export to Hugging Face")


def lines() -> list[str]:
    """The bash lines of the sections, in order."""
    text = DOC.read_text()
    out = []
    for title in SECTIONS:
        start = text.index(title)
        end = text.find("\n## ", start + len(title))
        section = text[start:end if end != -1 else len(text)]
        for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
            out += [line.strip() for line in block.splitlines() if line.strip()]
    return out


def pipeexec_argvs() -> list[list[str]]:
    return [shlex.split(line)[3:] for line in lines() if line.startswith("python3 -m pipeexec ")]


def test_the_sections_have_lines_and_every_pipeexec_line_parses():
    from pipeexec.cli.main import _parser
    from pipeexec.cli.train import train_parser

    argvs = pipeexec_argvs()
    assert sum(a[0] == "train" for a in argvs) >= 5
    assert sum(a[0] == "checkpoint" for a in argvs) >= 2
    for argv in argvs:
        if argv[0] == "train":
            train_parser().parse_args(argv[1:])
        else:
            _parser().parse_args(argv)


@pytest.mark.slow
def test_the_sections_run_in_order(tmp_path, monkeypatch, capfd):
    """The ``python3 -m pipeexec`` lines run in this process (`run_pipeexec`), the others in
    bash, in the scratch directory."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    monkeypatch.chdir(tmp_path)
    for line in lines():
        if line.startswith("python3 -m pipeexec "):
            out = run_pipeexec(shlex.split(line)[3:], capfd)
        else:
            if line.startswith("python3 "):
                line = line.replace("python3 ", f"{sys.executable} ", 1)
            out = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{line}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        if "--eval-only" in line:
            assert "validation iteration 4 loss" in out.stdout and "step " not in out.stdout
        if "from_pretrained" in line:
            assert "torch.Size([1, 3, 256])" in out.stdout
    assert list((tmp_path / "runs" / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "llama-hf" / "model.safetensors").is_file()
    assert (tmp_path / "gpt-hf" / "model.safetensors.index.json").is_file()
