"""The notebooks run clean: each is executed afresh with nbclient and fails on any cell error.

The notebooks assert their own key facts (e.g. the simulated 1F1B bubble equals (p-1)/m), so a
notebook whose story stops being true fails here too. Those with real multi-process training
are marked ``slow``. The committed notebooks are built from ``notebooks/src/*.py`` by
``scripts/run_notebooks.py``; a cheap test checks the two agree and that the committed ones
carry their outputs.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SLOW = {"03_real_training", "04_predicted_vs_measured"}   # real training with pipeexec


def _runner():
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _notebooks() -> list:
    params = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        marks = [pytest.mark.slow] if path.stem in SLOW else []
        params.append(pytest.param(path, id=path.stem, marks=marks))
    return params


def test_every_source_has_a_notebook():
    sources = {p.stem for p in (NOTEBOOKS / "src").glob("*.py")}
    built = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    assert sources and sources == built, (
        f"sources without a notebook: {sorted(sources - built)}; notebooks without a source: "
        f"{sorted(built - sources)} (run python3 scripts/run_notebooks.py)")


@pytest.mark.parametrize("path", _notebooks())
def test_committed_notebook_matches_source_and_has_outputs(path):
    committed = nbformat.read(path, as_version=4)
    fresh = _runner().build(NOTEBOOKS / "src" / f"{path.stem}.py")
    assert [(c.cell_type, c.source) for c in committed.cells] == \
        [(c.cell_type, c.source) for c in fresh.cells], (
        f"{path.name} differs from notebooks/src/{path.stem}.py: run "
        f"python3 scripts/run_notebooks.py {path.stem}")
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), f"{path.name} is committed without its outputs"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} is committed with an error output: {errors[0].ename}"


@pytest.mark.parametrize("path", _notebooks())
def test_notebook_executes(path, tmp_path, monkeypatch):
    # A fresh copy in a temporary directory: whatever a notebook writes lands there.
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TMPDIR", str(tmp_path))      # the notebooks' scratch folders too
    nb = nbformat.read(copy, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()   # raises CellExecutionError naming the cell on any error
