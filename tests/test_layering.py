"""The import layering between kvtier's client side and its daemons, read from the source (ast, nothing imported).

    client side  kvtier.transport, kvtier.tiers, kvtier.client, kvtier.store*, kvtier.connectors
    daemons      kvtier.pool (folder pool/), kvtier.master (folder master/)
    shared       kvtier.wire (the formats both sides speak) and the neutral library rooms (kvtier.keys,
                 kvtier.auth, kvtier.memory.hostcopy, ...; kvtier.tiers.dram, the DRAM both use, and kvtier.store.types)

Rules (a violation is named file:line):
* a client module never imports a daemon (kvtier.pool, kvtier.master);
* a daemon never imports the client side, except where it truly is a client of another daemon, and then only
  through the SDK's public entries: ``from kvtier.client import NodeAgent`` (a pool registering with a master)
  and ``from kvtier.transport import connect, PoolConnection, PoolError`` (a pool copying from another pool),
  ``pool_offers`` (a pool's hello offers what the transports' table lists);
* the two daemons never import each other (what they share is in kvtier.wire).

Tools (kvtier.tools.cli, kvtier.tools.replay, bench) may start daemons (kvtier.pool.process, the pool launcher) and are no
side of the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> import name (setup.py's ROOTS, bench left out: a tool)
FOLDERS = {"kvtier": "kvtier", "pool": "kvtier.pool", "master": "kvtier.master", "connectors": "kvtier.connectors"}

CLIENT = ("kvtier.transport", "kvtier.tiers", "kvtier.client", "kvtier.store", "kvtier.connectors")
DAEMONS = ("kvtier.pool", "kvtier.master")
# What a daemon may import from the client side: the SDK's public entries, name by name.
# pool_offers: the transports' table as a pool reads it for its hello (what it offers comes from the one table).
PUBLIC_ENTRIES = {"kvtier.client": {"NodeAgent"},
                  "kvtier.transport": {"connect", "PoolConnection", "PoolError", "pool_offers"}}
# Library rooms the client side holds and a daemon may use too: the DRAM tier the pool serves from (and its slot
# bookkeeping), and the store's event vocabulary (what a pool's NodeAgent publishes).
SHARED_LIBRARY = ("kvtier.tiers.dram", "kvtier.tiers.slots", "kvtier.store.types")


def _under(name: str, prefixes: tuple[str, ...]) -> str | None:
    for p in prefixes:
        if name == p or name.startswith(p + ".") or (p == "kvtier.store" and name.startswith("kvtier.store_")):
            return p
    return None


def modules() -> Iterator[tuple[Path, str]]:
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


def imports(path: Path, module: str) -> Iterator[tuple[int, str, set[str] | None]]:
    """(line, imported module, names imported from it or None for a plain import) of every import in the file,
    lazy ones inside functions and TYPE_CHECKING blocks included."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = {a.name for a in node.names}
            yield node.lineno, target, names
            for n in names:  # ``from kvtier import pool`` imports the module kvtier.pool
                yield node.lineno, f"{target}.{n}", set()


def check(path: Path, module: str) -> list[str]:
    """What in the file at ``path`` (the module ``module``) breaks the rules, as "file:line: why" lines."""
    out: dict[str, str] = {}  # one line per import statement (``from a import b`` is read as a and as a.b)
    side_client, side_daemon = _under(module, CLIENT), _under(module, DAEMONS)
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for line, target, names in imports(path, module):
        if not target.startswith("kvtier"):
            continue
        daemon, client = _under(target, DAEMONS), _under(target, CLIENT)
        where = f"{rel}:{line}"
        if side_client and daemon:
            out.setdefault(where, f"{where}: client module {module} imports the daemon {target}")
        if side_daemon and daemon and daemon != side_daemon:
            out.setdefault(where, f"{where}: daemon {module} imports the other daemon {target}")
        if side_daemon and client and not _under(target, SHARED_LIBRARY):
            head, _, tail = target.rpartition(".")
            if names == set() and tail in PUBLIC_ENTRIES.get(head, set()):
                continue  # ``from kvtier.client import NodeAgent``: a name, not a module
            allowed = PUBLIC_ENTRIES.get(target)
            if allowed is None or not names or not names <= allowed:
                out.setdefault(where, f"{where}: daemon {module} imports the client side's {target}"
                           + (f" ({', '.join(sorted(names))})" if names else "") + f"; a daemon uses only {_entries()}")
    return list(out.values())


def violations() -> list[str]:
    return sorted({v for path, module in modules() for v in check(path, module)})


def _entries() -> str:
    return ", ".join(f"{m}.{n}" for m, names in PUBLIC_ENTRIES.items() for n in sorted(names))


def test_no_import_across_the_client_daemon_line() -> None:
    found = violations()
    assert not found, "imports across the client/daemon line (share through kvtier.wire):\n" + "\n".join(found)


def test_the_rule_sees_every_room() -> None:
    """The scan covers the rooms it rules on (a renamed folder must not make the test pass by reading nothing)."""
    names = {m for _, m in modules()}
    for must in ("kvtier.pool.server", "kvtier.master.server", "kvtier.transport", "kvtier.tiers.pool_route",
                 "kvtier.client", "kvtier.connectors", "kvtier.wire"):
        assert must in names, f"{must} not found among the scanned modules"


def test_the_rule_catches_each_kind(tmp_path: Path) -> None:
    """Each rule fires on a module that breaks it (so a passing scan means something)."""
    cases = {
        ("kvtier.transport.x", "from kvtier.pool import protocol\n"): True,
        ("kvtier.tiers.x", "import kvtier.master.replication\n"): True,
        ("kvtier.pool.x", "from kvtier.transport.stream import read_envelope\n"): True,
        ("kvtier.pool.x", "from kvtier.client.api import NodeReply\n"): True,
        ("kvtier.master.x", "from kvtier.pool.protocol import POOL_LABELS\n"): True,
        ("kvtier.pool.x", "from kvtier.transport import connect\n"): False,
        ("kvtier.pool.x", "from kvtier.client import NodeAgent\n"): False,
        ("kvtier.pool.x", "from kvtier.tiers.dram import DramTier\n"): False,
        ("kvtier.pool.x", "from kvtier.store import StoreEvent\n"): True,
        ("kvtier.pool.x", "from kvtier.store.types import StoreEvent\n"): False,
        ("kvtier.pool.x", "from kvtier.transport.connection import connect\n"): True,
        ("kvtier.pool.x", "import kvtier.transport\n"): True,
        ("kvtier.pool.x", "from kvtier import client\n"): True,
        ("kvtier.pool.x", "from kvtier.master import cli\n"): True,
        ("kvtier.connectors.vllm.x", "from ...pool import protocol\n"): True,
        ("kvtier.transport.x", "from kvtier.wire import pool\n"): False,
        ("kvtier.transport.x", "from kvtier.wire.pool import POOL_LABELS\n"): False,
    }
    for (module, source), bad in cases.items():
        path = tmp_path / "m.py"
        path.write_text(source)
        assert bool(check(path, module)) == bad, (module, source, check(path, module))


def test_no_import_circle_in_the_transports_and_the_wire() -> None:
    """The transports and the wire package import in one direction (lazy imports included): the transport base
    (connection.py) imports none of the transports built on it, and construction (dial.py) sits on top. Before,
    connection.py's connect() imported rdma, which imports onesided, which imports connection."""
    rooms = ("kvtier.transport", "kvtier.wire")
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    known = {m for _, m in modules() if _under(m, rooms) and m not in rooms}
    for path, module in modules():
        if module not in known:
            continue
        for line, target, _names in imports(path, module):
            if target in known and target != module:
                graph.setdefault(module, set()).add(target)
                where.setdefault((module, target), f"{path.relative_to(ROOT)}:{line}")
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                loop = [*path[path.index(t):], m, t] if t in path else [m, t]
                circles.append(" -> ".join(f"{a} ({where[(a, b)]})" for a, b in zip(loop, loop[1:])) + f" -> {t}")
            elif t not in state:
                visit(t, [*path, m])
        state[m] = 2
    for m in sorted(known):
        if m not in state:
            visit(m, [])
    assert not circles, "import circles:\n" + "\n".join(circles)
