"""Print the cycles of shardpoint's import graph (one per line); exit 1 when there is one.

Every ``import`` counts wherever it is written: at the top of a module, inside a function
(a cycle hidden in a function is still a cycle) or under ``if TYPE_CHECKING:``, with one
exception: an import inside a module-level ``def __getattr__`` (PEP 562) is a lazy
re-export, a name served to other modules that the module's own code never uses, and so is
an ``if TYPE_CHECKING:`` import of a module that ``__getattr__`` re-exports (its static
declaration); those edges are printed, not counted. An edge
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


def imports_of(root: Path, path: Path, modules: set[str], lazy: set[str] | None = None) -> set[str]:
    """The modules of the package that ``path`` imports (those imported by its module-level
    ``__getattr__`` go to ``lazy`` instead)."""
    name = module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    served: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    reexports = {
        id(node)
        for top in tree.body
        if isinstance(top, ast.FunctionDef) and top.name == "__getattr__"
        for node in ast.walk(top)
    }
    declared = {
        id(node)
        for top in tree.body
        if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
        for node in ast.walk(top)
    }
    typing_only: set[str] = set()
    for node in ast.walk(tree):
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
                if id(node) in reexports:
                    served.add(target)
                elif id(node) in declared:
                    typing_only.add(target)
                else:
                    found.add(target)
    found |= typing_only - served
    if lazy is not None:
        lazy |= served
    return found


def graph(root: Path, lazy: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Module -> the package modules it imports, for every ``.py`` under ``root`` (lazy
    re-exports of a module-level ``__getattr__`` go to ``lazy``)."""
    paths = sorted(root.rglob("*.py"))
    # a compiled extension (``_native``) is known by its ``.pyi`` stub
    modules = {module_name(root, p) for p in [*paths, *root.rglob("*.pyi")]}
    edges = {}
    for p in paths:
        served: set[str] = set()
        edges[module_name(root, p)] = imports_of(root, p, modules, served)
        if lazy is not None and served:
            lazy[module_name(root, p)] = served
    return edges


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
    lazy: dict[str, set[str]] = {}
    edges = graph(root, lazy)
    found = cycles(edges)
    for module, targets in sorted(lazy.items()):
        print(f"lazy re-export (module __getattr__, not counted): {module} -> {', '.join(sorted(targets))}")
    for members in found:
        print(" -> ".join(shortest_cycle(edges, members)), f"(component of {len(members)} modules)")
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(found)} cycles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
