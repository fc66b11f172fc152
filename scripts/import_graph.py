"""The import graph of pipesim and pipeexec, read with `ast`: its circles and its lazy imports.

    python3 scripts/import_graph.py            # circles (none expected) and lazy-import counts
    python3 scripts/import_graph.py --lazy     # every import inside a function, with its line
    python3 scripts/import_graph.py --rooms    # imports between rooms, with counts, and
                                               # any circle of rooms (exit 1)
    python3 scripts/import_graph.py --rooms --package pipeexec     # one package's rooms

Every import counts, at module level or inside a function: a function-level import that closes
a circle is still a circle, only hidden. ``from .pkg import name`` imports ``pkg.name`` when that
is a module, else ``pkg`` (its ``__init__``). A package's ``__init__`` re-exporting its own
submodules is not a circle of the code, so edges from a package ``__init__`` to a module inside
that package are left out. Exits 1 when there is a circle (tests/test_import_graph.py runs it).

A room is a folder of a package (with the folders inside it: ``pipesim.schedule.builders`` is
part of ``pipesim.schedule``) or a module at the package's top (``pipeexec.config``); the
package's ``__init__`` is a room of its own (its re-exports). Rooms stand on each other as
floors: with ``--rooms`` any circle of rooms, two rooms importing each other the smallest, is
an error, and the floors are printed top first.
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipesim", "pipeexec")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool              # inside a function (or method)
    guarded: bool           # under `if TYPE_CHECKING:` (types only, never run)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom | ast.Import,
             known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    out = []
    for alias in node.names:
        full = f"{prefix}.{alias.name}"
        out.append(full if full in known else prefix)
    return out


class _Walker(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: dict[str, Path]) -> None:
        self.module, self.is_package, self.known = module, is_package, known
        self.depth = 0
        self.guard = 0
        self.edges: list[Edge] = []

    def _visit_function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        guarded = test in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        self.guard += guarded
        for child in node.body:
            self.visit(child)
        self.guard -= guarded
        for child in node.orelse:
            self.visit(child)

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        for target in _resolve(self.module, self.is_package, node, self.known):
            while target and target not in self.known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in self.known and target != self.module:
                self.edges.append(Edge(self.module, target, node.lineno, self.depth > 0,
                                       self.guard > 0))

    visit_Import = visit_ImportFrom = _import


def edges(root: Path = ROOT) -> list[Edge]:
    known = modules(root)
    out = []
    for name, path in known.items():
        walker = _Walker(name, path.name == "__init__.py", known)
        walker.visit(ast.parse(path.read_text(), str(path)))
        for e in walker.edges:
            if path.name == "__init__.py" and e.target.startswith(name + "."):
                continue                  # a package re-exporting its own modules
            out.append(e)
    return out


def circles(graph_edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in graph_edges:
        if not e.guarded:
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def room(module: str, known: dict[str, Path] | None = None) -> str:
    """A module's room: ``pipeexec.training.train`` -> ``pipeexec.training``,
    ``pipesim.schedule.builders.zbv`` -> ``pipesim.schedule``, ``pipeexec.config`` ->
    ``pipeexec.config``, the package ``pipeexec`` -> ``pipeexec``."""
    known = modules() if known is None else known
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and known[module].name != "__init__.py"):
        return module
    return ".".join(parts[:2])


def room_edges(graph_edges: list[Edge], known: dict[str, Path] | None = None) -> list[Edge]:
    """The imports between rooms (those run: not under TYPE_CHECKING), as edges of rooms."""
    known = modules() if known is None else known
    out = []
    for e in graph_edges:
        a, b = room(e.source, known), room(e.target, known)
        if a != b and not e.guarded:
            out.append(Edge(a, b, e.line, e.lazy, False))
    return out


def floors(rooms: list[Edge]) -> list[list[str]]:
    """Rooms by floor, top first: a room stands one floor above the highest room it imports
    (rooms without a circle only)."""
    below: dict[str, set[str]] = defaultdict(set)
    for e in rooms:
        below[e.source].add(e.target)
        below.setdefault(e.target, set())
    level: dict[str, int] = {}

    def height(r: str) -> int:
        if r not in level:
            level[r] = 1 + max((height(t) for t in below[r]), default=-1)
        return level[r]

    for r in below:
        height(r)
    out: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for r, n in level.items():
        out[n].append(r)
    return [sorted(f) for f in reversed(out)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lazy", action="store_true", help="list every import inside a function")
    p.add_argument("--rooms", action="store_true",
                   help="imports between rooms, with counts; exit 1 on a circle of rooms")
    p.add_argument("--package", choices=PACKAGES, default=None,
                   help="with --rooms: the rooms of this package only")
    args = p.parse_args(argv)
    all_edges = edges()
    found = circles(all_edges)
    for comp in found:
        members = set(comp)
        print(f"circle of {len(comp)} modules: {', '.join(comp)}")
        for e in all_edges:
            if e.source in members and e.target in members and not e.guarded:
                kind = "lazy " if e.lazy else ""
                print(f"    {e.source}:{e.line} -> {e.target} ({kind}import)")
    lazy = [e for e in all_edges if e.lazy]
    by_package = Counter(e.source.split(".")[0] for e in lazy)
    print(f"{len(modules())} modules, {len(all_edges)} imports between them, "
          f"{len(found)} circle(s); imports inside functions: "
          + ", ".join(f"{k} {v}" for k, v in sorted(by_package.items())))
    if args.lazy:
        for e in sorted(lazy, key=lambda e: (e.source, e.line)):
            print(f"  {e.source}:{e.line} -> {e.target}")
    if args.rooms:
        rooms = [e for e in room_edges(all_edges)
                 if args.package is None or e.source.split(".")[0] == args.package]
        for (a, b), n in sorted(Counter((e.source, e.target) for e in rooms).items()):
            print(f"  {a} -> {b}: {n}")
        room_circles = circles(rooms)
        for comp in room_circles:
            members = set(comp)
            print(f"circle of {len(comp)} rooms: {', '.join(comp)}")
            for e in sorted({(e.source, e.target) for e in rooms
                             if e.source in members and e.target in members}):
                print(f"    {e[0]} -> {e[1]}")
        if room_circles:
            return 1
        print("floors, top first (each room imports only rooms on floors below it):")
        inside = [e for e in rooms if e.target.split(".")[0] == e.source.split(".")[0]]
        for n, floor in enumerate(floors(inside)):
            print(f"  {n}: {', '.join(floor)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
