"""The house read with ast: backend/hsserve imports in no cycle; each tests/ file's line 1 says why.

Every import counts: module level, inside functions (lazy), and under `if TYPE_CHECKING:`, so the
house is one-way for a reader too, not only at run time. `from hsserve.x import y` is an arrow to
hsserve.x.y when y is a submodule, else to hsserve.x; relative imports are resolved. A module
does not point at the packages above it: Python runs their __init__ first whoever imports it, and
hsserve/__init__ re-exports the engine (counting those arrows, every module it names would sit
on a cycle).

Every .py under tests/ opens with a module docstring on line 1 whose first line is a summary of
its own (what the file proves, or for a helper what it provides), the rest after a blank line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BACKEND = Path(__file__).resolve().parents[2] / "backend"
TESTS = Path(__file__).resolve().parents[1]


def module_name(rel: str) -> tuple[str, bool]:
    """backend-relative path -> (dotted module name, is a package's __init__)."""
    parts = list(Path(rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """sources: backend-relative path -> source text. Module -> the package modules it imports."""
    mods = {module_name(rel): text for rel, text in sources.items()}
    known = {name for name, _ in mods}
    graph: dict[str, set[str]] = {}
    for (name, is_pkg), text in mods.items():
        here = name if is_pkg else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in known:
                        deps.add(sub)
                    elif base in known:
                        deps.add(base)
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) through each strongly connected set of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # NOTE: Tarjan's; the package has ~100 modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = {stack.pop()}
            while v not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                found.append(_cycle_in(graph, group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(BACKEND)): p.read_text() for p in (BACKEND / "hsserve").rglob("*.py")}


def test_no_import_cycles():
    found = cycles(import_graph(package_sources()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("imports", [
    "from hsserve.b import thing",  # module level
    "def f():\n    from hsserve import b",  # lazy, a submodule named through its package
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import thing",  # relative
])
def test_a_cycle_is_found_through_any_import(imports):
    sources = {"hsserve/__init__.py": "", "hsserve/a.py": "import hsserve.c\n",
               "hsserve/b.py": "from hsserve.a import x\n", "hsserve/c.py": imports + "\n"}
    assert cycles(import_graph(sources)) == [["hsserve.a", "hsserve.c", "hsserve.b", "hsserve.a"]]


def test_a_submodule_points_at_its_package_only_by_importing_it():
    sources = {"hsserve/__init__.py": "", "hsserve/k/__init__.py": "from . import m\n",
               "hsserve/k/m.py": "import os\n"}
    assert cycles(import_graph(sources)) == []
    sources["hsserve/k/m.py"] = "from hsserve.k import attend\n"
    assert cycles(import_graph(sources)) == [["hsserve.k", "hsserve.k.m", "hsserve.k"]]


def summary_problem(text: str) -> str | None:
    """Why a file's source does not open with a one-line summary docstring, or None."""
    body = ast.parse(text).body
    first = body[0] if body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str) and first.lineno == 1
            and text.startswith('"""')):
        return "line 1 is not a module docstring"
    lines = first.value.value.split("\n")
    if not lines[0].strip():
        return "the docstring's first line is empty"
    if len(lines) > 1 and lines[1].strip():
        return "the summary line runs on into line 2 (end it, then a blank line)"
    return None


def test_every_test_file_says_on_line_1_what_it_proves():
    problems = {str(p.relative_to(TESTS)): summary_problem(p.read_text())
                for p in sorted(TESTS.rglob("*.py"))}
    bad = {f: why for f, why in problems.items() if why}
    assert not bad, bad


@pytest.mark.parametrize("text", ["import os\n", '# comment\n"""Late."""\n',
                                  'from __future__ import annotations\n"""Late."""\n',
                                  '""""""\n', '"""Runs on\ninto line 2."""\n'])
def test_a_missing_or_late_summary_is_named(text):
    assert summary_problem(text) is not None
