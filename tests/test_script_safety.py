"""scripts/run_notebooks.py saves a notebook that failed in a private folder of its own: never
at a fixed, guessable path under the temporary directory, where another user of the machine
could have planted a symlink to one of our files (the write would follow it)."""
from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parent.parent


def _runner():
    spec = importlib.util.spec_from_file_location("run_notebooks_safety",
                                                  ROOT / "scripts" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_notebook_goes_to_a_private_folder(tmp_path, monkeypatch, capsys):
    import tempfile

    runner = _runner()
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "99_broken.py").write_text("# %%\nraise SystemExit('boom')\n")
    monkeypatch.setattr(runner, "SOURCES", sources)
    monkeypatch.setattr(runner, "NOTEBOOKS", tmp_path)

    def fail(nb, cwd, timeout=600):
        raise RuntimeError("cell failed")

    monkeypatch.setattr(runner, "execute", fail)
    # another user's trap: the old fixed name, a symlink to a file of ours
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    (shared_tmp / "99_broken.failed.ipynb").symlink_to(victim)

    assert runner.main([]) == 1
    assert victim.read_text() == "keep me"
    err = capsys.readouterr().err
    saved = Path(err.split("the notebook as far as it ran: ", 1)[1].split("\n", 1)[0])
    assert saved.is_file() and not saved.is_symlink()
    assert saved.parent.parent == shared_tmp and saved.parent != shared_tmp
    assert stat.S_IMODE(saved.parent.stat().st_mode) == 0o700
    assert nbformat.read(str(saved), as_version=4).cells[0].source == "raise SystemExit('boom')"
