"""The schedule room (pipesim/schedule/) never imports the simulator, its costs or the searches
over them, not even inside a function: the dependency runs one way (pipesim/zb_auto -> schedule),
read from the source with ast. And zb-auto is still built by name."""
import ast
from pathlib import Path

import pipesim

ROOM = Path(pipesim.__file__).parent / "schedule"
OUTSIDE = ("pipesim.sim.engine", "pipesim.sim.dataflow", "pipesim.plan.costs", "pipesim.zb_auto",
           "pipesim.api", "pipesim.sim.result", "pipesim.sim.memory", "pipesim.sim.spans")


def imported(path: Path) -> set[str]:
    """Every module an import in ``path`` names, relative imports resolved."""
    package = ".".join(path.relative_to(ROOM.parent.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return out


def test_the_schedule_room_imports_nothing_of_the_simulator():
    files = sorted(ROOM.rglob("*.py"))
    assert len(files) > 10
    bad = {str(f.relative_to(ROOM)): sorted(m for m in imported(f) if m.startswith(OUTSIDE))
           for f in files}
    assert not {f: m for f, m in bad.items() if m}
    # the check sees relative imports: the search module itself does import the engine
    assert "pipesim.sim.engine" in imported(ROOM.parent / "zb_auto" / "search.py")


def test_zb_auto_is_built_by_name():
    s = pipesim.build_schedule("zb-auto", pp=2, microbatches=4)
    assert s.name == "zb-auto" and "zb-auto" in pipesim.schedule_names()
    assert pipesim.schedule_names()[-1] == "zb-auto"     # registered after the hand-made ones
