"""docs/training.md's data section runs as written: its shell commands (preprocess two
corpora, train a blend at pp 2 and save, resume at dp 2) and its Python example, in a folder
holding a tiny corpus, a second one as text, and a tokenizer made here."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import run_pipeexec
from data_helpers import make_corpus, make_tokenizer

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "training.md"
SECTION = "## Data: tokenizer, preprocessing, indexed datasets"


def blocks(language: str) -> list[str]:
    text = PAGE.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else None]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_the_section_has_its_commands():
    commands = [c for b in blocks("bash") for c in b.splitlines() if c.strip()]
    assert [shlex.split(c)[:2] for c in commands] == [["pipeexec", "preprocess-data"]] * 2 + [
        ["pipeexec", "train"]] * 2
    assert len(blocks("python")) == 1


@pytest.mark.slow
def test_the_data_section_runs_as_written(tmp_path, monkeypatch, capfd):
    """The ``pipeexec`` lines run in this process (`cli_helpers.run_pipeexec`), the Python
    example as a script, in a folder holding the corpora and the tokenizer."""
    make_tokenizer(tmp_path / "tokenizer", make_corpus(tmp_path), 300)
    make_corpus(tmp_path, documents=40, seed=1, name="other.txt")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    monkeypatch.chdir(tmp_path)
    for block in blocks("bash"):
        for line in filter(str.strip, block.splitlines()):
            argv = shlex.split(line)
            assert argv[0] == "pipeexec"
            p = run_pipeexec(argv[1:], capfd)
            assert p.returncode == 0, f"{line}\n{p.stdout}\n{p.stderr}"
    assert (tmp_path / "corpus.idx").is_file() and (tmp_path / "other.bin").is_file()
    (tmp_path / "example.py").write_text(blocks("python")[0] + "\nassert len(sample) == 33\n")
    p = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
