"""The layers of funcpipe, read from the source with :mod:`ast` (nothing is imported).

1. The schedule package never imports the runtime (nor the pipeline, the profiler or
   ``torch.distributed``): a schedule can be generated, checked, simulated and drawn without
   them (docs/ARCHITECTURE: ``funcpipe/schedule/`` may use nothing from runtime).
2. No module of funcpipe imports itself back through others: the import graph has no cycle.
3. Every room (a folder of the package, or one of the top-level modules) imports only its own
   modules and rooms of lower layers (:data:`LAYERS`, docs/design.md "The tree"); the package's
   face (``funcpipe/__init__.py``, ``__main__.py``) may import anything.
4. The top level holds only the face and the ground (:data:`TOP_LEVEL`).

Every import statement counts, wherever it is (module level, inside a function, under
``TYPE_CHECKING``), and so does ``importlib.import_module("...")`` / ``__import__("...")`` with
a literal name: an import hidden in a function body is still a dependency between the layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest

import funcpipe

PACKAGE = Path(funcpipe.__file__).resolve().parent

SCHEDULE = "funcpipe.schedule"
ABOVE_SCHEDULE = ("funcpipe.runtime", "funcpipe.pipeline", "funcpipe.measure", "torch.distributed")
"""What no module of the schedule package may import (each name or anything under it)."""

LAYERS = {
    "funcpipe.errors": 0,
    "funcpipe.tree": 1,
    "funcpipe.testing": 2,
    "funcpipe.schedule": 2,
    "funcpipe.planner": 3,
    "funcpipe.stages": 3,
    "funcpipe.runtime": 4,
    "funcpipe.distributed": 5,
    "funcpipe.parallel": 6,
    "funcpipe.pipeline": 6,
    "funcpipe.train": 7,
    "funcpipe.measure": 7,
    "funcpipe.models": 7,
    "funcpipe.cli": 8,
}
"""Each room's layer, bottom (0) to top: a room imports only itself and lower layers, so two rooms
of one layer import nothing of each other."""

FACE = ("funcpipe", "funcpipe.__main__")
TOP_LEVEL = {"__init__.py", "__main__.py", "errors.py", "tree.py", "testing.py", "py.typed"}


@dataclass(frozen=True)
class Import:
    """One import in ``module`` at ``line``: the dotted names it may bind (``from a import b``
    binds ``a.b`` if that is a module, else the name ``b`` of module ``a``: both are listed)."""

    module: str
    line: int
    names: tuple[str, ...]


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """``funcpipe/schedule/ir.py`` -> ``funcpipe.schedule.ir``; a package's ``__init__.py`` is the
    package itself."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module under ``root`` by dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


_DYNAMIC = ("import_module", "__import__")


def imports(module: str, source: str, *, is_package: bool = False) -> Iterator[Import]:
    """Every import in ``source`` (the text of ``module``), relative ones made absolute."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, node.lineno, (alias.name,))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                if keep < 1:
                    raise ValueError(
                        f"{module}, line {node.lineno}: a relative import goes above the package"
                    )
                base = ".".join([*parts[:keep], *([base] if base else [])])
            yield Import(
                module, node.lineno, (base, *(f"{base}.{alias.name}" for alias in node.names))
            )
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0] if node.args else None
            if (
                called in _DYNAMIC
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                yield Import(module, node.lineno, (first.value,))


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer_violations(
    known: dict[str, Path], *, package: str = SCHEDULE, forbidden: tuple[str, ...] = ABOVE_SCHEDULE
) -> list[str]:
    """``path:line: module imports name`` for each import of ``forbidden`` inside ``package``."""
    out = []
    for name, path in known.items():
        if not _under(name, (package,)):
            continue
        source = path.read_text(encoding="utf-8")
        for imp in imports(name, source, is_package=path.name == "__init__.py"):
            bad = sorted({n for n in imp.names if _under(n, forbidden)})
            if bad:
                out.append(f"{path}:{imp.line}: {name} imports {', '.join(bad)}")
    return out


Graph = dict[str, dict[str, int]]  # module -> {imported module: the line of the first import}


def import_graph(known: dict[str, Path]) -> Graph:
    """Module -> the modules of ``known`` it imports. ``from a.b import c`` is an edge to the
    module ``a.b.c`` when that is one, else to ``a.b``; ``import a.b.c`` to ``a.b.c``. The
    parent packages a dotted import also runs are not edges (every module would then import
    ``funcpipe/__init__.py``, which imports nearly everything)."""
    graph: Graph = {}
    for name, path in known.items():
        edges: dict[str, int] = {}
        source = path.read_text(encoding="utf-8")
        for imp in imports(name, source, is_package=path.name == "__init__.py"):
            base, *members = imp.names
            targets = [m if m in known else base for m in members] if members else [base]
            for target in targets:
                if target in known and target != name:
                    edges.setdefault(target, imp.line)
        graph[name] = edges
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """One shortest cycle (first module repeated at the end) per strongly connected component
    of ``graph`` that has one, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph has ~100 modules, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in sorted(components):
        start, members = component[0], set(component)
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:  # breadth first back to start
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in members and w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        back = []  # the cycle's members before start, last first
        v = parent[start]
        while v != start:
            back.append(v)
            v = parent[v]
        out.append([start, *reversed(back), start])
    return out


def describe(cycle: list[str], graph: Graph, known: dict[str, Path], root: Path) -> str:
    """The cycle, then each step as ``module (path:line) imports module``."""
    steps = [
        f"  {a} ({known[a].relative_to(root)}:{graph[a][b]}) imports {b}"
        for a, b in pairwise(cycle)
    ]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


# ---------------------------------------------------------------------------------- the rules


def test_the_schedule_package_imports_nothing_above_it() -> None:
    known = modules()
    assert any(_under(n, (SCHEDULE,)) for n in known), "found no funcpipe.schedule modules"
    bad = layer_violations(known)
    assert not bad, (
        "funcpipe.schedule must not import the runtime, the pipeline, the profiler or "
        "torch.distributed (a schedule is data, checked and simulated without them); move what "
        "runs stages above the schedule package (e.g. funcpipe/measure/), or the pure piece "
        "the runtime also needs into funcpipe/schedule/:\n" + "\n".join(bad)
    )


def test_funcpipe_has_no_import_cycles() -> None:
    known = modules()
    graph = import_graph(known)
    assert sum(len(e) for e in graph.values()) > len(known) // 2, "the import graph looks empty"
    found = cycles(graph)
    assert not found, (
        f"{len(found)} import cycle(s) in funcpipe; break each by moving the piece both modules "
        "need into a module below them (an import inside a function still counts):\n"
        + "\n".join(describe(c, graph, known, PACKAGE.parent) for c in found)
    )


def room(module: str) -> str:
    """``funcpipe.stages.ties`` -> ``funcpipe.stages``; a top-level module is its own room."""
    return ".".join(module.split(".")[:2])


def upward_imports(graph: Graph, layers: dict[str, int] = LAYERS) -> list[str]:
    """``a (layer) imports b (layer)`` for each edge that leaves its room sideways or upwards."""
    out = []
    for name, edges in sorted(graph.items()):
        if name in FACE:
            continue
        here = room(name)
        for target, line in sorted(edges.items()):
            there = room(target)
            if there == here or target in FACE:
                continue
            if layers[there] >= layers[here]:
                out.append(
                    f"{name}:{line} (layer {layers[here]}) imports {target} (layer {layers[there]})"
                )
    return out


def test_every_room_has_a_layer() -> None:
    rooms = {room(n) for n in modules()} - set(FACE)
    assert rooms == set(LAYERS), (
        f"rooms without a layer: {sorted(rooms - set(LAYERS))}; layers without a room: "
        f"{sorted(set(LAYERS) - rooms)}: give a new folder its layer in LAYERS and docs/design.md"
    )


def test_no_room_imports_sideways_or_upwards() -> None:
    graph = import_graph(modules())
    bad = upward_imports(graph)
    assert not bad, (
        "an import against the layers (docs/design.md, 'The tree'): move the piece both need "
        "into the lower room, or the importing code up:\n" + "\n".join(bad)
    )


def test_the_top_level_holds_only_the_face_and_the_ground() -> None:
    found = {p.name for p in PACKAGE.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert found <= TOP_LEVEL, f"modules at the top level: {sorted(found - TOP_LEVEL)}"


def test_an_upward_or_sideways_import_is_found() -> None:
    graph: Graph = {
        "funcpipe.stages.a": {"funcpipe.runtime.b": 3, "funcpipe.schedule.ir": 4},
        "funcpipe.train.c": {"funcpipe.measure.d": 7, "funcpipe.train.e": 8},
        "funcpipe.cli.f": {"funcpipe.errors": 1},
        "funcpipe": {"funcpipe.cli.f": 2},
    }
    assert upward_imports(graph) == [
        "funcpipe.stages.a:3 (layer 3) imports funcpipe.runtime.b (layer 4)",
        "funcpipe.train.c:7 (layer 7) imports funcpipe.measure.d (layer 7)",
    ]


# ------------------------------------------------------------- the readers, on made-up modules


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent != root and not (path.parent / "__init__.py").exists():
            (path.parent / "__init__.py").write_text("")
        path.write_text(text)
    return modules(root)


@pytest.mark.parametrize(
    "statement",
    [
        "import funcpipe.runtime.autodiff",
        "from funcpipe.runtime import autodiff",
        "from funcpipe import runtime",
        "from funcpipe import pipeline as p",
        "from funcpipe.measure.profile import measure_memory",
        "import torch.distributed as dist",
        "from torch import distributed",
        "from .. import runtime",
        "from ..runtime.autodiff import forward",
        "def f():\n    from funcpipe.runtime import interpreter",
        "if TYPE_CHECKING:\n    import funcpipe.runtime",
        "import importlib\nimportlib.import_module('funcpipe.runtime.transport')",
    ],
)
def test_every_way_of_importing_the_runtime_is_caught(statement: str) -> None:
    source = f"x = 1\n{statement}\n"
    found = [
        n
        for imp in imports("funcpipe.schedule.fake", source)
        for n in imp.names
        if _under(n, ABOVE_SCHEDULE)
    ]
    assert found, f"{statement!r} was not seen as an import of {ABOVE_SCHEDULE}"


@pytest.mark.parametrize(
    "statement",
    [
        "import torch",
        "from funcpipe.schedule import ir",
        "from . import ir",
        "import funcpipe.tree",
    ],
)
def test_imports_below_the_schedule_are_allowed(statement: str) -> None:
    names = [n for imp in imports("funcpipe.schedule.fake", statement) for n in imp.names]
    assert names and not any(_under(n, ABOVE_SCHEDULE) for n in names)


def test_relative_imports_resolve_from_the_module_or_the_package() -> None:
    def names(module: str, source: str, is_package: bool = False) -> list[tuple[str, ...]]:
        return [i.names for i in imports(module, source, is_package=is_package)]

    assert names("a.b.c", "from . import d") == [("a.b", "a.b.d")]
    assert names("a.b", "from . import d", is_package=True) == [("a.b", "a.b.d")]
    assert names("a.b.c", "from ..x import y") == [("a.x", "a.x.y")]
    with pytest.raises(ValueError, match="above the package"):
        names("a.b", "from ... import z")


def test_a_cycle_through_a_function_level_import_is_found_and_named(tmp_path: Path) -> None:
    known = _package(
        tmp_path,
        {
            "low.py": "X = 1\n",
            "a.py": "from pkg.low import X\nfrom pkg import b\n",
            "b.py": "import pkg.low\n\ndef f():\n    from pkg.c import g\n",
            "c.py": "from . import a\n",  # a -> b -> c -> a
            "d.py": "from pkg.a import something_not_a_module\n",  # an edge to pkg.a, no cycle
        },
    )
    graph = import_graph(known)
    assert graph["pkg.d"] == {"pkg.a": 1}
    assert graph["pkg.b"] == {"pkg.low": 1, "pkg.c": 4}
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    text = describe(found[0], graph, known, tmp_path)
    assert "  pkg.b (pkg/b.py:4) imports pkg.c" in text.splitlines()


def test_an_acyclic_graph_has_no_cycles(tmp_path: Path) -> None:
    known = _package(tmp_path, {"a.py": "import pkg.b\n", "b.py": "import os\n"})
    assert cycles(import_graph(known)) == []


# ------------------------------------------------------------------ room sizes (issue 40)
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 120
LONG_FUNCTIONS_ALLOWED = ("funcpipe.schedule.exact", "funcpipe.planner")
"""The exact solver's refinement and the planner's closed forms read best as one long piece."""


def test_no_module_over_600_lines_without_saying_why() -> None:
    """A longer module must say in its docstring, on a line starting "One concept:", why it is
    one concept and not several."""
    over = []
    for path in modules().values():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_FILE_LINES and "One concept:" not in doc:
            over.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert not over, "split these along their seams, or say why not:\n" + "\n".join(over)


def test_no_function_over_120_lines() -> None:
    over = []
    for name, path in modules().items():
        if _under(name, LONG_FUNCTIONS_ALLOWED):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    over.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {length}"
                    )
    assert not over, "functions over 120 lines:\n" + "\n".join(over)
