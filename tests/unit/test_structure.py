"""The package's shape, read from its source: no import circle (imports made only for type checking
count), no module over 500 lines, no class over 400, no function over 80, the warehouse and the
controller never import each other, and nothing edits sys.path. A change that breaks one of these names
the module, class or function it grew, or the circle it closed."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "dockd"
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 400, 80


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        if "_proto" in path.parts:  # (generated)
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dockd modules an import statement of module `name` names (a package's name for its members
    that are not modules)."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = name.split(".")
            if MODULES[name].name != "__init__.py":
                parts = parts[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        targets = [f"{base}.{a.name}" for a in node.names]
    found = []
    for t in targets:
        while t and t not in MODULES:
            t = t.rpartition(".")[0]
        if t and t not in (name, "dockd"):
            found.append(t)
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        graph[name] = {m for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                       for m in _imported(name, n)}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_no_import_circle():
    assert _circles(_graph()) == []


def test_the_circle_finder_finds_one():
    """(The check above can fail.)"""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_warehouse_and_the_controller_never_import_each_other():
    def package(module: str) -> str:
        return (module.split(".") + [""])[1]

    crossing = [(m, d) for m, deps in _graph().items() for d in deps
                if {package(m), package(d)} == {"warehouse", "controller"}]
    assert crossing == []


def test_sizes():
    over = []
    for name, path in MODULES.items():
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_MODULE:
            over.append(f"module {name}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                over.append(f"class {name}.{node.name}: {size} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION:
                over.append(f"function {name}.{node.name}: {size} lines")
    assert over == []


def test_nothing_edits_sys_path():
    edits = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*(=|\+=)|sys\.path\[")
    found = [str(p.relative_to(ROOT)) for d in ("dockd", "scripts", "benchmarks", "examples", "tests")
             for p in (ROOT / d).rglob("*.py") if p != pathlib.Path(__file__).resolve() and edits.search(p.read_text())]
    assert found == []
