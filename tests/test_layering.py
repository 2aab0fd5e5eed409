"""The import graph of ``src/vitscope`` (issue 44): no import circles, and no import from a lower layer to a higher
one. Every ``import`` / ``from ... import`` of a vitscope module counts, at module level and inside functions
(``if TYPE_CHECKING:`` blocks aside); ``from PACKAGE import NAME`` counts as an import of the module that
defines NAME (a submodule, or the target of the package's `vitscope._lazy.lazy_exports`).

The layers are declared once: the table under "## Layers" in docs/ARCHITECTURE.md, read here, so the document
and the check cannot drift."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOC = ROOT / "docs" / "ARCHITECTURE.md"

#: (importer, imported) arrows tolerated for now: none. A name covers its submodules. An entry must still be a
#: violation (an upward arrow, or an arrow on a circle), so a fixed one fails the test until it is deleted here.
KNOWN_VIOLATIONS_IN_SPLIT_MODULES: set[tuple[str, str]] = set()


# ---------------------------------------------------------------------------------------------- the checker


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, "vitscope.study.plan"
    target: str  # imported module
    where: str   # "vitscope/study/plan.py:81" (under src/)


def layers_from_doc(text: str) -> list[list[str]]:
    """The "## Layers" table, bottom first: each row's second cell, its `backticked` module names (relative to
    ``vitscope``: ``metrics`` is vitscope.metrics and its submodules; ``__init__`` is the package itself)."""
    section = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/ARCHITECTURE.md has no '## Layers' section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    layers = [re.findall(r"`([\w.]+)`", row.split("|")[2]) for row in rows[2:]]  # header and --- row skipped
    assert layers and all(layers), "every row of the Layers table names its modules in its second cell"
    return layers


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = node.orelse
        stack.extend(children)


def lazy_exports(tree: ast.AST) -> dict[str, str]:
    """``{name: module}`` of a `vitscope._lazy.lazy_exports(__name__, {...})` call (``**{n: "m" for n in (...)}``
    entries too)."""
    out: dict[str, str] = {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "lazy_exports"
                and len(call.args) > 1 and isinstance(call.args[1], ast.Dict)):
            continue
        for key, value in zip(call.args[1].keys, call.args[1].values, strict=True):
            if key is not None:
                out[ast.literal_eval(key)] = ast.literal_eval(value)
            elif isinstance(value, ast.DictComp) and isinstance(value.value, ast.Constant):
                for name in ast.literal_eval(value.generators[0].iter):
                    out[name] = value.value.value
    return out


def import_graph(src: Path = SRC, package: str = "vitscope") -> tuple[set[str], list[Edge]]:
    """The package's modules and every import of one of them by another (see the module's docstring)."""
    files = {module_name(p, src): p for p in sorted((src / package).rglob("*.py"))}
    trees = {m: ast.parse(p.read_text(encoding="utf-8"), str(p)) for m, p in files.items()}
    lazy = {m: lazy_exports(t) for m, t in trees.items() if files[m].name == "__init__.py"}

    def known(name: str) -> str:  # the module itself, else its nearest enclosing one
        while name not in files and "." in name:
            name = name.rpartition(".")[0]
        return name

    edges = []
    for mod, tree in trees.items():
        pkg = mod if files[mod].name == "__init__.py" else mod.rpartition(".")[0]
        where = files[mod].relative_to(src).as_posix()
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = []
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in files else lazy.get(base, {}).get(a.name, base))
            for t in targets:
                if t == package or t.startswith(package + "."):
                    edges.append(Edge(mod, known(t), f"{where}:{node.lineno}"))
    return set(files), list(dict.fromkeys(edges))  # one edge per statement and module imported


def layer_index(layers: list[list[str]], package: str = "vitscope") -> Callable[[str], int | None]:
    """module -> its layer's index (None: no row names it); the most specific name wins."""
    names = {(package if n == "__init__" else f"{package}.{n}"): i for i, row in enumerate(layers) for n in row}

    def of(module: str) -> int | None:
        name = module
        while name not in names and "." in name:
            name = name.rpartition(".")[0]
        return names.get(name)

    return of


def _covers(name: str, module: str) -> bool:
    return module == name or module.startswith(name + ".")


def tolerated(edge: Edge, known: Iterable[tuple[str, str]]) -> bool:
    return any(_covers(a, edge.source) and _covers(b, edge.target) for a, b in known)


def strongly_connected(nodes: Iterable[str], edges: Iterable[Edge]) -> list[set[str]]:
    """The graph's strongly connected components of more than one module (Tarjan, iterative)."""
    succ: dict[str, set[str]] = {n: set() for n in nodes}
    for e in edges:
        if e.source != e.target:
            succ.setdefault(e.source, set()).add(e.target)
            succ.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out = []
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
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
                    work.append((w, iter(sorted(succ[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def a_cycle(component: set[str], edges: list[Edge]) -> list[Edge]:
    """One shortest circle through the component's first module (breadth first), as its edges."""
    inside = [e for e in edges if e.source in component and e.target in component and e.source != e.target]
    start = min(component)
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in inside:
                if e.source != v:
                    continue
                if e.target == start:
                    path = [e]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if e.target not in came:
                    came[e.target] = e
                    nxt.append(e.target)
        frontier = nxt
    raise AssertionError(f"no circle in {component}")


def violations(modules: set[str], edges: list[Edge], layers: list[list[str]], known: Iterable[tuple[str, str]] = (),
               package: str = "vitscope") -> tuple[list[str], list[str]]:
    """(circles, upward imports), each as sentences with file:line, leaving out the ``known`` arrows."""
    of = layer_index(layers, package)
    checked = [e for e in edges if not tolerated(e, known)]
    circles = []
    for comp in strongly_connected(modules, checked):
        path = a_cycle(comp, checked)
        circles.append(" -> ".join([path[0].source, *(f"{e.target} ({e.where})" for e in path)]))
    upward = sorted(f"{e.where}: {e.source} (layer {of(e.source)}) imports {e.target} (layer {of(e.target)})"
                    for e in checked if of(e.source) is not None and of(e.target) is not None
                    and of(e.target) > of(e.source))
    return circles, upward


# ---------------------------------------------------------------------------------------------- the tests


def _graph() -> tuple[set[str], list[Edge], list[list[str]]]:
    modules, edges = import_graph()
    return modules, edges, layers_from_doc(DOC.read_text(encoding="utf-8"))


def test_every_module_has_one_layer_and_every_name_in_the_table_is_a_module():
    modules, _, layers = _graph()
    of = layer_index(layers)
    assert not sorted(m for m in modules if of(m) is None), "add them to the Layers table of docs/ARCHITECTURE.md"
    names = [n for row in layers for n in row]
    assert len(names) == len(set(names)), "a name is in two rows of the Layers table"
    stale = [n for n in names if ("vitscope" if n == "__init__" else f"vitscope.{n}") not in modules]
    assert not stale, f"the Layers table names modules that do not exist: {stale}"


def test_no_import_circles():
    circles, _ = violations(*_graph(), known=KNOWN_VIOLATIONS_IN_SPLIT_MODULES)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    _, upward = violations(*_graph(), known=KNOWN_VIOLATIONS_IN_SPLIT_MODULES)
    assert not upward, "upward imports (docs/ARCHITECTURE.md, Layers):\n" + "\n".join(upward)


def test_each_known_violation_still_occurs():
    """An entry of `KNOWN_VIOLATIONS_IN_SPLIT_MODULES` that is no longer upward nor on a circle is deleted."""
    modules, edges, layers = _graph()
    of = layer_index(layers)
    circles = strongly_connected(modules, edges)
    bad = [e for e in edges if (of(e.target) or 0) > (of(e.source) or 0)
           or any(e.source in c and e.target in c for c in circles)]
    fixed = sorted(k for k in KNOWN_VIOLATIONS_IN_SPLIT_MODULES if not any(tolerated(e, [k]) for e in bad))
    assert not fixed, f"fixed: delete from KNOWN_VIOLATIONS_IN_SPLIT_MODULES: {fixed}"


def test_the_checker_finds_a_circle_and_an_upward_import(tmp_path):
    """The check can fail: a fake package with a circle (a <-> b) and an upward import (low -> high, inside a
    function), a relative import, a lazy export and a TYPE_CHECKING import (not counted)."""
    pkg = tmp_path / "fake"
    (pkg / "high").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fake.b import X\n\n\n"
                  "def f():\n    from fake.high import thing\n",
        "a.py": "from . import b\n",
        "b.py": "import fake.a\n",
        "high/__init__.py": "lazy_exports(__name__, {**{n: 'fake.high.impl' for n in ('thing',)}})\n",
        "high/impl.py": "from .. import a\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    modules, edges = import_graph(tmp_path, "fake")
    assert {(e.source, e.target) for e in edges} == {("fake.low", "fake.high.impl"), ("fake.a", "fake.b"),
                                                     ("fake.b", "fake.a"), ("fake.high.impl", "fake.a")}
    layers = [["__init__", "low", "a", "b"], ["high"]]
    circles, upward = violations(modules, edges, layers, package="fake")
    assert len(circles) == 1 and "fake.a -> fake.b" in circles[0] and circles[0].endswith("fake/b.py:1)")
    assert upward == ["fake/low.py:7: fake.low (layer 0) imports fake.high.impl (layer 1)"]
    known = [("fake.a", "fake.b"), ("fake.low", "fake.high")]  # a name covers its submodules
    assert violations(modules, edges, layers, known, package="fake") == ([], [])
    table = "## Layers\n| layer | modules | owns |\n|---|---|---|\n| 0 | `__init__`, `low` | x |\n| 1 | `high` | y |\n"
    assert layers_from_doc("# t\n" + table + "## Next\n| a | `b` | c |\n") == [["__init__", "low"], ["high"]]
