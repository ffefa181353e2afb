"""The package's shape: the architecture's import arrows hold and files and functions stay small.

The import arrows of the architecture (adapter -> engine -> scheduler -> executor -> model, never
back); files and functions a reader can take in (STYLE.md: files under ~350 lines, functions
under ~60); every bench/README.md anchor cited in the code is a heading there. No import
cycles: test_import_graph.py.
"""

from __future__ import annotations

import ast
import os

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "backend", "hsserve")


def modules() -> dict[str, str]:
    """Dotted module name -> path, for every module of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def imports_of(path: str, known: set[str]) -> set[str]:
    """The package's modules that `path` imports (at run time: TYPE_CHECKING blocks left out)."""
    tree = ast.parse(open(path).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hsserve"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
    return found & known


def test_the_arrows_hold():
    mods = modules()
    known = set(mods)
    graph = {m: imports_of(p, known) for m, p in mods.items()}

    def reaches(src: str, dst_prefix: str) -> list[str]:
        return sorted(m for m in graph[src] if m == dst_prefix or m.startswith(dst_prefix + "."))

    for m in mods:
        if m.startswith(("hsserve.engine", "hsserve.models", "hsserve.kernels")):
            assert not reaches(m, "hsserve.triton"), f"{m} imports the Triton side"
        if m.startswith(("hsserve.models", "hsserve.kernels")):
            assert not reaches(m, "hsserve.engine"), f"{m} (below the engine) imports it"
    assert not reaches("hsserve.engine.executor", "hsserve.engine.loop")
    assert not reaches("hsserve.engine.scheduler", "hsserve.engine.executor")
    assert not reaches("hsserve.engine.scheduler", "hsserve.engine.loop")


def test_files_and_functions_stay_small():
    too_long = []
    for m, path in modules().items():
        src = open(path).read()
        if src.count("\n") > 350:
            too_long.append(f"{m}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    too_long.append(f"{m}.{node.name}: {n} lines")
    assert not too_long, too_long


def test_every_bench_readme_anchor_cited_in_code_exists():
    """Comments point into bench/README.md for the measurement behind a choice: each such
    anchor is one of its headings (GitHub's slugs: lower case, spaces to dashes)."""
    import re

    readme = os.path.join(PACKAGE, "..", "..", "bench", "README.md")
    headings = re.findall(r"^#+ (.+)$", open(readme).read(), flags=re.M)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    cited = {}
    for m, path in modules().items():
        for anchor in re.findall(r"bench/README\.md#([\w-]+)", open(path).read()):
            cited.setdefault(anchor, m)
    assert cited, "no comment points into bench/README.md"
    missing = {a: m for a, m in cited.items() if a not in slugs}
    assert not missing, missing
