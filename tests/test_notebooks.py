"""The notebooks run clean: each is executed afresh with nbclient and fails on any cell error.

The notebooks assert their own key facts (e.g. the simulated 1F1B bubble equals (p-1)/m), so a
notebook whose story stops being true fails here too. Those with real multi-process training
are marked ``slow``. The notebooks a session checks run side by side, each in a process of its
own (tests/notebook_runner.py), started when the first of their tests asks: a notebook is
mostly one busy Python, so two keep both cores of a 2-core machine busy where one at a time
leaves one idle (their checks hold whatever the load: they assert no timing). The committed
notebooks are built from ``notebooks/src/*.py`` by ``scripts/run_notebooks.py``; a cheap test
checks the two agree and that the committed ones carry their outputs.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SLOW = {"03_real_training", "04_predicted_vs_measured"}   # real training with pipeexec
RUNNER = Path(__file__).resolve().parent / "notebook_runner.py"


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


@pytest.fixture(scope="module")
def notebook_runs(request, tmp_path_factory):
    """Every notebook this session checks (the selected parameters of `test_notebook_executes`)
    executing afresh, all started now, each in its own process and scratch folder
    (tests/notebook_runner.py: a copy, outputs cleared, nbclient); by notebook, the process
    and the file its errors go to. Any still running at the end are stopped."""
    here = Path(__file__).resolve()
    paths = [item.callspec.params["path"] for item in request.session.items
             if item.path == here and getattr(item, "originalname", "") == "test_notebook_executes"]
    runs = {}
    try:
        for path in paths:
            folder = tmp_path_factory.mktemp(path.stem)
            errors = folder / "errors.txt"
            with open(errors, "w") as err:
                proc = subprocess.Popen([sys.executable, str(RUNNER), str(path), str(folder)],
                                        stdout=subprocess.DEVNULL, stderr=err)
            runs[path] = (proc, errors)
        yield runs
    finally:
        for proc, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("path", _notebooks())
def test_notebook_executes(path, notebook_runs):
    proc, errors = notebook_runs[path]
    status = proc.wait(timeout=3600)
    # on a failing cell, the runner names it with nbclient's CellExecutionError
    assert status == 0, errors.read_text()[-6000:]
