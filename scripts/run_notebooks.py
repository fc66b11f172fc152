"""Build the notebooks from their sources and execute them, saving the outputs.

Each notebook is written as a plain Python file in ``notebooks/src/`` (cells separated by
``# %%`` lines, markdown cells by ``# %% [markdown]`` with every line a ``# `` comment: the
"percent" format of Jupytext and VS Code). This script turns ``notebooks/src/NAME.py`` into
``notebooks/NAME.ipynb``, runs it top to bottom with nbclient (kernel ``python3``, working
directory ``notebooks/``, ``OMP_NUM_THREADS=1``) and saves it with its outputs, so the
notebooks read well on the web. The test suite (tests/test_notebooks.py) executes the saved
notebooks afresh and checks that they still match their sources.

    python3 scripts/run_notebooks.py                 # all notebooks
    python3 scripts/run_notebooks.py 01 02           # the ones whose name starts so
    python3 scripts/run_notebooks.py --no-execute    # only rebuild the .ipynb (no outputs)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SOURCES = NOTEBOOKS / "src"
KERNEL = "python3"


def parse_cells(text: str) -> list[tuple[str, str]]:
    """``(kind, source)`` for every cell of a percent-format file; kind is code or markdown."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            kind = "markdown" if "[markdown]" in line else "code"
            cells.append((kind, []))
            continue
        if not cells:
            if line.strip():
                raise ValueError(f"text before the first '# %%' cell marker: {line!r}")
            continue
        kind, lines = cells[-1]
        if kind == "markdown":
            if line.strip() and not line.startswith("#"):
                raise ValueError(f"markdown cell line does not start with '#': {line!r}")
            line = line[2:] if line.startswith("# ") else line[1:]
        lines.append(line)
    out = []
    for kind, lines in cells:
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        out.append((kind, "\n".join(lines)))
    return out


def build(src: Path) -> nbformat.NotebookNode:
    """The notebook of one source file, without outputs."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for kind, source in parse_cells(src.read_text()):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(make(source))
    # Stable cell ids, so that rebuilding an unchanged source gives an unchanged file.
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    return nb


def execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 600) -> None:
    """Run ``nb`` in place with nbclient; raise nbclient's CellExecutionError on a failing cell."""
    from nbclient import NotebookClient

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MPLBACKEND", "Agg")
    NotebookClient(nb, timeout=timeout, kernel_name=KERNEL, record_timing=False,
                   resources={"metadata": {"path": str(cwd)}}).execute()


def write_failed(nb: nbformat.NotebookNode, stem: str) -> Path:
    """Save a notebook that failed, as far as it ran, in a private folder of its own
    (``tempfile.mkdtemp``: mode 0700, an unpredictable name), never at a fixed path under
    /tmp, where another user could have planted a symlink to a file of ours. Returns the file."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"notebook-{stem}-"))
    failed = folder / f"{stem}.failed.ipynb"
    nbformat.write(nb, str(failed))
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="notebook name prefixes (default: all)")
    p.add_argument("--no-execute", action="store_true", help="write the notebooks without outputs")
    args = p.parse_args(argv)
    sources = sorted(SOURCES.glob("*.py"))
    if args.names:
        sources = [s for s in sources if any(s.stem.startswith(n) for n in args.names)]
    if not sources:
        print("no notebook sources matched", file=sys.stderr)
        return 2
    for src in sources:
        nb = build(src)
        target = NOTEBOOKS / f"{src.stem}.ipynb"
        t0 = time.perf_counter()
        if not args.no_execute:
            try:
                execute(nb, NOTEBOOKS)
            except Exception as exc:
                failed = write_failed(nb, src.stem)
                print(f"{src.name}: {type(exc).__name__}; the notebook as far as it ran: {failed}",
                      file=sys.stderr)
                print(str(exc)[-3000:], file=sys.stderr)
                return 1
        nbformat.validate(nb)
        nbformat.write(nb, target)
        took = f" (executed in {time.perf_counter() - t0:.1f} s)" if not args.no_execute else ""
        print(f"wrote {target.relative_to(ROOT)}{took}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
