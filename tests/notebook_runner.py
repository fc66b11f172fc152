"""Execute one committed notebook afresh, as tests/test_notebooks.py checks it, in a process of
its own: ``python tests/notebook_runner.py NOTEBOOK.ipynb FOLDER``.

The notebook is copied into FOLDER (whatever it writes lands there, its scratch folders too:
TMPDIR), its outputs cleared, and run top to bottom by nbclient (kernel ``python3``,
``OMP_NUM_THREADS=1``, ``MPLBACKEND=Agg``). Exit status 0 when every cell ran; otherwise 1,
the failing cell's error on stderr.

Why a process: a notebook is mostly one busy Python (its kernel), so the test module runs the
notebooks it checks side by side, two kernels keeping both cores of a 2-core machine busy,
where one at a time leaves one core idle; and the tests' own process starts no thread (a
later test's launcher forks it).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def execute_copy(notebook: Path, folder: Path, timeout: int = 600) -> None:
    """Run a fresh copy of ``notebook`` in ``folder``; raise nbclient's CellExecutionError
    (naming the cell) on any error."""
    import nbclient
    import nbformat

    copy = folder / notebook.name
    shutil.copy(notebook, copy)
    os.environ.update(OMP_NUM_THREADS="1", MPLBACKEND="Agg", TMPDIR=str(folder))
    nb = nbformat.read(copy, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(folder)}}).execute()


def main(argv: list[str]) -> int:
    notebook, folder = Path(argv[0]), Path(argv[1])
    try:
        execute_copy(notebook, folder)
    except Exception as exc:        # noqa: BLE001  (reported, then a non-zero status)
        print(f"{notebook.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
