"""The import graph stays a graph without circles (scripts/import_graph.py), the rooms of both
packages stand on each other as floors (no two rooms import each other, nor any longer circle),
and the light entry points stay light: `import pipesim` loads none of torch, numpy, pandas,
simpy or matplotlib (a Plan neither simpy nor numpy), `import pipeexec.analysis` and the
config no torch (pipeexec's torch-side names load on first use)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "import_graph.py"


def _graph():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", module)       # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _loaded(code: str) -> set[str]:
    """Top-level packages in sys.modules after running ``code`` in a fresh interpreter."""
    probe = (f"{code}\nimport json, sys\n"
             "print(json.dumps(sorted({m.split('.')[0] for m, v in sys.modules.items() "
             "if v is not None})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_packages_have_no_import_circle():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 circle(s)" in out.stdout


def test_the_circle_check_finds_one_when_there_is_one():
    g = _graph()
    edges = [g.Edge("a", "b", 1, False, False), g.Edge("b", "c", 2, True, False),
             g.Edge("c", "a", 3, True, False), g.Edge("c", "d", 4, False, False),
             g.Edge("d", "c", 5, False, True)]            # a TYPE_CHECKING import: not run
    assert g.circles(edges) == [["a", "b", "c"]]


def test_the_rooms_stand_as_floors_no_two_importing_each_other():
    out = subprocess.run([sys.executable, str(SCRIPT), "--rooms"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "circle of" not in out.stdout and "floors, top first" in out.stdout


def test_the_rooms_check_finds_a_pair_of_rooms_importing_each_other():
    g = _graph()
    known = {name: Path(*name.split(".")).with_suffix(".py")
             for name in ("p.a.x", "p.a.y", "p.b.z", "p.c", "p.d.w")}
    edges = [g.Edge("p.a.x", "p.b.z", 1, False, False),
             g.Edge("p.b.z", "p.a.y", 2, True, False),       # lazy: still a circle of rooms
             g.Edge("p.a.y", "p.a.x", 3, False, False),      # inside one room: none
             g.Edge("p.c", "p.d.w", 4, False, False),
             g.Edge("p.d.w", "p.c", 5, False, True)]         # under TYPE_CHECKING: not run
    rooms = g.room_edges(edges, known)
    assert g.circles(rooms) == [["p.a", "p.b"]]
    assert g.room("p.c", known) == "p.c" and g.room("p.d.w", known) == "p.d"
    assert g.floors([e for e in rooms if e.source == "p.c"]) == [["p.c"], ["p.d"]]


def test_import_pipesim_stays_cheap_and_a_plan_needs_no_simulator():
    heavy = {"torch", "numpy", "pandas", "simpy", "matplotlib"}
    assert not _loaded("import pipesim") & heavy
    assert not _loaded("import pipesim\npipesim.Plan") & {"torch", "numpy", "simpy"}


def test_the_torch_free_rooms_import_without_torch_where_it_is_installed():
    for module in ("pipeexec.analysis", "pipeexec.config",
                   "pipeexec.measuring.profile_options", "pipeexec.run.prepare",
                   "pipesim.planner"):
        assert "torch" not in _loaded(f"import {module}"), module
    assert "torch" in _loaded("from pipeexec import Trainer")    # the executor's names: on use
