"""The package's layering: every import (module level, inside functions, under
``TYPE_CHECKING``) runs down :data:`LAYERS` (the layout README.md draws), or is a listed exception.

A new import that runs back up fails here, naming the two modules; fix it by moving the
code to the layer that owns it, or (rarely) add it to ``EXCEPTIONS`` with why.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hexagram"

#: top to bottom; a module may import its own layer and those below it
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hexagram.cli", "hexagram.__main__", "hexagram.bench", "hexagram.demo"),
    ("hexagram",),  # the package root: the public face that tools and users import
    ("hexagram.integrations",),
    ("hexagram.parallel",),
    ("hexagram.elastic",),
    ("hexagram.engine",),
    ("hexagram.auto",),
    ("hexagram.algorithms", "hexagram.testing"),
    ("hexagram.robust", "hexagram.optim"),
    ("hexagram.cost", "hexagram.cli_options"),  # the commands' shared options
    ("hexagram.comm",),
    ("hexagram.compress",),
    ("hexagram.runtime", "hexagram.rendezvous", "hexagram.launch", "hexagram.config",
     "hexagram.buckets", "hexagram.errors", "hexagram.models", "hexagram.data"),
)

#: (importer, imported) pairs allowed to run back up, each with why. The cost model reads
#: algorithms through its own interface (hexagram.cost.facts) and is handed them; the one
#: exception keeps the public ``hexagram.cost.simulate.simulate(labels, ...)`` taking the
#: registry's names, as users call it.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("hexagram.cost.simulate", "hexagram.algorithms.labels"): "public simulate takes names",
}


def layer(module: str) -> int:
    """Index of the longest layer prefix of ``module`` in :data:`LAYERS`."""
    best, length = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    assert best >= 0, f"{module} is on no layer: add it to LAYERS"
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, path: Path) -> Iterator[str]:
    """The modules one ``from ... import`` names (a submodule where a name is one)."""
    package = module_name(path) if path.name == "__init__.py" else \
        module_name(path).rpartition(".")[0]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        target = PACKAGE.parent / sub.replace(".", "/")
        yield sub if target.with_suffix(".py").exists() or target.is_dir() else module


def imports(path: Path) -> Iterator[tuple[str, int]]:
    """Every ``hexagram`` module ``path`` imports, wherever the import stands."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(m, node.lineno) for m in _resolve(node, path)]
        else:
            continue
        yield from ((n, line) for n, line in names if n.split(".")[0] == "hexagram")


def upward() -> list[tuple[str, str, int]]:
    """(importer, imported, line) for each import that runs back up the layers."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        for target, line in imports(path):
            if layer(target) < layer(me):
                found.append((me, target, line))
    return found


def test_no_import_runs_back_up_except_the_listed_ones() -> None:
    new = [f"{a} (line {n}) imports {b}" for a, b, n in upward() if (a, b) not in EXCEPTIONS]
    assert not new, "imports that run back up the layers:\n" + "\n".join(new)


def test_every_listed_exception_still_exists() -> None:
    seen = {(a, b) for a, b, _ in upward()}
    stale = [f"{a} -> {b}" for a, b in EXCEPTIONS if (a, b) not in seen]
    assert not stale, "remove these from EXCEPTIONS, they are gone: " + ", ".join(stale)


def test_the_walker_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    # the walker must see imports wherever they stand, or the test above could not fail
    source = "def f():\n    from hexagram.engine import ddp\n"
    node = ast.parse(source).body[0].body[0]  # type: ignore[attr-defined]
    assert isinstance(node, ast.ImportFrom)
    fake = PACKAGE / "comm" / "x.py"
    assert list(_resolve(node, fake)) == ["hexagram.engine.ddp"]
    assert layer("hexagram.engine.ddp") < layer(module_name(fake))


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every import, as :func:`imports` sees
    them; a name that is no module counts as its package)."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}

    def known(name: str) -> str:
        while name not in paths and "." in name:
            name = name.rpartition(".")[0]
        return name

    return {me: {known(t) for t, _ in imports(path)} - {me} for me, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert not found, "modules that import each other, directly or around a circle:\n" + \
        "\n".join(" <-> ".join(group) for group in found)


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
