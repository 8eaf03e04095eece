"""Print the cycles of shardpoint's import graph (one per line); exit 1 when there is one.

Every ``import`` counts wherever it is written: at the top of a module, inside a function
(a cycle hidden in a function is still a cycle) or under ``if TYPE_CHECKING:``. An edge
``a -> b`` means module ``a`` imports something from module ``b`` (``from .b import x``,
``from . import b``, ``import shardpoint.b``); importing a package imports its
``__init__``. Run from the repository root::

    python tools/import_cycles.py [src/shardpoint]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    """``shardpoint._format.names`` for ``src/shardpoint/_format/names.py``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path, path: Path, modules: set[str]) -> set[str]:
    """The modules of the package that ``path`` imports."""
    name = module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            # ``from . import x`` imports the submodule x when there is one
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # import a.b.c -> the deepest known module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports, for every ``.py`` under ``root``."""
    paths = sorted(root.rglob("*.py"))
    # a compiled extension (``_native``) is known by its ``.pyi`` stub
    modules = {module_name(root, p) for p in [*paths, *root.rglob("*.pyi")]}
    return {module_name(root, p): imports_of(root, p, modules) for p in paths}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted,
    plus a shortest cycle through each for the reader."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def shortest_cycle(edges: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component."""
    start = members[0]
    allowed = set(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & allowed):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return members  # pragma: no cover - a component always has a cycle


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "src/shardpoint").resolve()
    edges = graph(root)
    found = cycles(edges)
    for members in found:
        print(" -> ".join(shortest_cycle(edges, members)), f"(component of {len(members)} modules)")
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(found)} cycles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
