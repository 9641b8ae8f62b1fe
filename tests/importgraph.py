"""The import graph of kvtier's source, read with ast (nothing imported): which modules the tree has (``modules``),
each import statement and when it runs (``sites``: lazy, type-only, a package __init__'s __getattr__ load), the
edges they make (``graph``: a module named, and the packages Python runs first) and the circles of a graph
(``loops``). tests/test_layering.py states the rules over it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> import name (setup.py's ROOTS)
FOLDERS = {"kvtier": "kvtier", "pool": "kvtier.pool", "master": "kvtier.master", "connectors": "kvtier.connectors",
           "bench": "kvtier.bench"}


def modules() -> Iterator[tuple[Path, str]]:
    """(file, module name) of every module of the tree."""
    for folder, package in FOLDERS.items():
        base = ROOT / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield path, ".".join([package, *parts])


@dataclass(frozen=True)
class Site:
    """One import statement: where, what it names, and when it runs."""

    line: int
    target: str  # the module named (``from a import b``: a)
    names: frozenset[str] | None  # the names imported from it; None for a plain ``import``
    lazy: bool  # inside a function: runs when the function is called
    type_only: bool  # under ``if TYPE_CHECKING``: never runs
    getattr_load: bool  # in a package __init__'s module-level __getattr__: runs when the name is first used


def sites(path: Path, module: str) -> Iterator[Site]:
    """Every import statement in the file at ``path`` (the module ``module``), lazy and type-only ones included."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, lazy: bool, type_only: bool, getattr_load: bool) -> Iterator[Site]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Site(node.lineno, alias.name, None, lazy, type_only, getattr_load)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield Site(node.lineno, target, frozenset(a.name for a in node.names), lazy, type_only, getattr_load)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            getattr_load = getattr_load or (is_package and node in tree.body and node.name == "__getattr__")
            lazy = True
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for part in node.body:
                yield from visit(part, lazy, True, getattr_load)
            for part in node.orelse:
                yield from visit(part, lazy, type_only, getattr_load)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, lazy, type_only, getattr_load)

    yield from visit(tree, False, False, False)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, module: str) -> Iterator[tuple[int, str, set[str] | None]]:
    """(line, imported module, names imported from it or None for a plain import) of every import in the file,
    lazy ones inside functions and TYPE_CHECKING blocks included."""
    for site in sites(path, module):
        yield site.line, site.target, None if site.names is None else set(site.names)
        for n in site.names or ():  # ``from kvtier import pool`` imports the module kvtier.pool
            yield site.line, f"{site.target}.{n}", set()


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target``: the module an import statement names, or a package it runs first."""

    source: str
    target: str
    where: str  # file:line of the import statement
    site: Site
    implied: bool  # a package of the named module (its __init__ runs first), not the named module itself


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def resolve(name: str, known: set[str]) -> str | None:
    """The module ``name`` lives in (``kvtier.wire.POOL_LABELS``: kvtier.wire); None outside the tree."""
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) or None


def edges_of(path: Path, module: str, known: set[str]) -> Iterator[Edge]:
    """The edges of one file: each module an import names (``from a import b``: a.b where b is a module, a where a
    name of a), and each package of it that the import runs first (not those ``module`` itself sits in)."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for site in sites(path, module):
        if not within(site.target, "kvtier"):
            continue
        submodules = {f"{site.target}.{n}" for n in site.names or () if f"{site.target}.{n}" in known}
        named = set(submodules)
        if site.names is None or len(submodules) < len(site.names):
            named.add(resolve(site.target, known) or site.target)
        for target in sorted(named - {module}):
            yield Edge(module, target, f"{rel}:{site.line}", site, implied=False)
            parts = target.split(".")
            for i in range(1, len(parts)):
                package = ".".join(parts[:i])
                if package in known and not within(module, package):
                    yield Edge(module, package, f"{rel}:{site.line}", site, implied=True)


def graph(scanned: list[tuple[Path, str]] | None = None) -> list[Edge]:
    """Every edge of the scanned modules (default: the whole tree)."""
    scanned = list(modules()) if scanned is None else scanned
    known = {m for _, m in scanned}
    return [e for path, module in scanned for e in edges_of(path, module, known)]


def loops(following: dict[str, set[str]], where: dict[tuple[str, str], str]) -> list[str]:
    """The circles of a graph, one per edge back into the path a depth-first walk is on, each edge's place named."""
    found: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(following.get(m, ())):
            if state.get(t) == 1:
                loop = [*path[path.index(t):], m, t] if t in path else [m, t]
                found.append(" -> ".join(f"{a} ({where[(a, b)]})" for a, b in zip(loop, loop[1:])) + f" -> {t}")
            elif t not in state:
                visit(t, [*path, m])
        state[m] = 2
    for m in sorted(following):
        if m not in state:
            visit(m, [])
    return found
