"""The import layering of kvtier, read from the source (ast, nothing imported): floors, circles, and the line
between the client side and the daemons.

Floors, lowest first. A module imports modules of its own floor and of the floors below it; an import of a higher
floor is an arrow up and fails (file:line named):

    0 base     the package kvtier itself (its names load on first use) and its root modules: units, keys (the
               package: hashers, table), layout, blocks, envvars, backoff, iothreads, pins, private, ratelog,
               registry, weights; kvtier.memory (host memory and copies)
    1 rooms    kvtier.wire, kvtier.auth, kvtier.policies, kvtier.kernels, kvtier.transport, kvtier.tiers,
               kvtier.offload, kvtier.settings (the tiers' sections of the config) and kvtier.client, the master's
               SDK (MasterClient, Router: what the pool tier asks kvtier-master with)
    2 store    kvtier.store, kvtier.config (the store's Config: every section together), kvtier.prefetch, and the
               store's side of the SDK: kvtier.client.agent (NodeAgent), .store_hints, .store_prefetch
    3 top      the engine connectors (kvtier.connectors), the daemons (kvtier.pool, kvtier.master and what they
               share, kvtier.daemon) and the tools (kvtier.tools, kvtier.bench, kvtier.__main__)

A module's floor is that of the longest prefix naming it (the bare ``kvtier`` names the package alone); every
module has one.

Circles: no module imports itself through others, over the whole tree and lazy imports (inside functions)
included. An import of ``a.b.c`` also imports the packages ``a.b`` and ``a`` (Python runs their ``__init__``
first) but for those the importing module sits in (they run before it). Not edges: imports under ``if
TYPE_CHECKING`` (never run), and the declared lazy loads: what a package ``__init__`` imports in its module-level
``__getattr__`` (PEP 562: nothing until the name is used) and the few lazy imports of ``LAZY_LOADS`` below, each
with its reason. A floor rule reads type-only imports too (a type from above is a dependency on above).

The client side and the daemons (a violation is named file:line):

    client side  kvtier.transport, kvtier.tiers, kvtier.client, kvtier.store*, kvtier.connectors
    daemons      kvtier.pool (folder pool/), kvtier.master (folder master/)
    shared       kvtier.wire (the formats both sides speak) and the neutral library rooms (kvtier.keys,
                 kvtier.auth, kvtier.memory.hostcopy, ...; kvtier.tiers.dram, the DRAM both use, and kvtier.store.types)

* a client module never imports a daemon (kvtier.pool, kvtier.master);
* a daemon never imports the client side, except where it truly is a client of another daemon, and then only
  through the SDK's public entries: ``from kvtier.client import NodeAgent`` (a pool registering with a master)
  and ``from kvtier.transport import connect, PoolConnection, PoolError`` (a pool copying from another pool),
  ``pool_offers`` (a pool's hello offers what the transports' table lists);
* the two daemons never import each other (what they share is in kvtier.wire).

Tools (kvtier.tools.cli, kvtier.tools.replay, bench) may start daemons (kvtier.pool.process, the pool launcher)
and are no side of the rule.
"""

from __future__ import annotations

from pathlib import Path

from importgraph import ROOT, Edge, edges_of, graph, imports, loops, modules, within

# The floors, lowest first: (name, the prefixes of the modules on it); the module's docstring says what each holds.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("kvtier", "kvtier.units", "kvtier.keys", "kvtier.layout", "kvtier.blocks", "kvtier.envvars",
              "kvtier.backoff", "kvtier.iothreads", "kvtier.pins", "kvtier.private", "kvtier.ratelog",
              "kvtier.registry", "kvtier.weights", "kvtier.memory")),
    ("rooms", ("kvtier.wire", "kvtier.auth", "kvtier.policies", "kvtier.kernels", "kvtier.transport", "kvtier.tiers",
               "kvtier.offload", "kvtier.settings", "kvtier.client")),
    ("store", ("kvtier.store", "kvtier.config", "kvtier.prefetch", "kvtier.client.agent", "kvtier.client.store_hints",
               "kvtier.client.store_prefetch")),
    ("top", ("kvtier.connectors", "kvtier.pool", "kvtier.master", "kvtier.daemon", "kvtier.tools", "kvtier.bench",
             "kvtier.__main__")),
]
# Declared lazy plug-in loads: (importing module, imported prefix) -> why. Only an import inside a function matches
# (one at module level is an edge whatever this says), and each entry must still match one.
LAZY_LOADS = {
    ("kvtier.policies.registry", "kvtier.policies"):
        "the registry imports the built-in policies when first asked (_load_builtins); each registers itself "
        "with it by decorator, so each imports the registry",
}

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
        if name == p or name.startswith(p + "."):
            return p
    return None


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


# ---- the import graph: floors and circles ---------------------------------------------------------------------


def declared_lazy(edge: Edge, lazy_loads: dict[tuple[str, str], str] | None = None) -> bool:
    """A load that is no edge: a package __init__'s __getattr__ import, or a lazy import LAZY_LOADS declares."""
    lazy_loads = LAZY_LOADS if lazy_loads is None else lazy_loads
    return edge.site.getattr_load or edge.site.lazy and any(
        edge.source == source and within(edge.target, prefix) for source, prefix in lazy_loads)


def floor_of(module: str) -> int | None:
    """The floor of the longest prefix naming ``module`` (the bare ``kvtier`` names the package alone)."""
    best: tuple[int, int] | None = None  # (prefix length, floor)
    for floor, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or p != "kvtier" and module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), floor)
    return None if best is None else best[1]


def _floor_name(module: str) -> str:
    floor = floor_of(module)
    return f"floor {floor} {FLOORS[floor][0]}" if floor is not None else "no floor"


def arrows_up(edges: list[Edge], lazy_loads: dict[tuple[str, str], str] | None = None) -> list[str]:
    """Each import of a higher floor than the importing module's, as "file:line: why" (lazy and type-only ones
    included: a dependency on above either way)."""
    out: dict[tuple[str, str], str] = {}
    for e in edges:
        low, high = floor_of(e.source), floor_of(e.target)
        if low is None or high is None or high <= low or declared_lazy(e, lazy_loads):
            continue
        how = " (its package, run first)" if e.implied else ""
        out.setdefault((e.where, e.target), f"{e.where}: {e.source} ({_floor_name(e.source)}) imports {e.target}"
                                              f"{how} ({_floor_name(e.target)})")
    return sorted(out.values())


def circles(edges: list[Edge], lazy_loads: dict[tuple[str, str], str] | None = None) -> list[str]:
    """Each circle of the edges that run (no type-only ones, no declared lazy loads), as "a (file:line) -> b
    (file:line) -> ... -> a": one per edge back into the path a depth-first walk is on."""
    following: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for e in edges:
        if e.site.type_only or declared_lazy(e, lazy_loads):
            continue
        following.setdefault(e.source, set()).add(e.target)
        where.setdefault((e.source, e.target), e.where + (" (its package, run first)" if e.implied else ""))
    return loops(following, where)


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
    following: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    known = {m for _, m in modules() if _under(m, rooms) and m not in rooms}
    for path, module in modules():
        if module not in known:
            continue
        for line, target, _names in imports(path, module):
            if target in known and target != module:
                following.setdefault(module, set()).add(target)
                where.setdefault((module, target), f"{path.relative_to(ROOT)}:{line}")
    found = loops(following, where)
    assert not found, "import circles:\n" + "\n".join(found)


def test_no_arrow_up() -> None:
    found = arrows_up(graph())
    assert not found, "imports of a higher floor (move the code down, or pass the value in):\n" + "\n".join(found)


def test_no_import_circle() -> None:
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(found)


def test_every_module_has_a_floor_and_every_floor_entry_a_module() -> None:
    """A new room is placed on a floor (not silently read as the root's), and no prefix names a room gone."""
    names = {m for _, m in modules()}
    unplaced = sorted(m for m in names if floor_of(m) is None)
    assert not unplaced, f"modules on no floor (add them to FLOORS): {unplaced}"
    stale = [p for _, prefixes in FLOORS for p in prefixes if not any(within(m, p) for m in names)]
    assert not stale, f"FLOORS entries naming no module: {stale}"


def test_every_declared_lazy_load_is_still_one() -> None:
    """Each LAZY_LOADS entry still matches a lazy import (a fixed circle takes its entry with it)."""
    used = {(e.source, p) for e in graph() for (s, p) in LAZY_LOADS if e.site.lazy and e.source == s
            and within(e.target, p)}
    assert set(LAZY_LOADS) <= used, f"LAZY_LOADS entries matching no lazy import: {sorted(set(LAZY_LOADS) - used)}"


def test_floor_of() -> None:
    assert floor_of("kvtier") == 0 and floor_of("kvtier.keys.table") == 0
    assert floor_of("kvtier.client.master") == 1 and floor_of("kvtier.client.agent") == 2
    assert floor_of("kvtier.pool.server") == 3 and floor_of("kvtier.__main__") == 3
    assert floor_of("kvtier.newroom") is None  # not the root's: the bare kvtier names the package alone


def test_the_floor_rule_catches_an_arrow_up(tmp_path: Path) -> None:
    """Each arrow up is found, lazy and type-only ones too; own floor and lower ones pass."""
    known = {m for _, m in modules()}
    lazy_getattr = "def __getattr__(name):\n    from kvtier.store import TieredStore\n    return TieredStore\n"
    cases = {
        ("kvtier.units", "m.py", "from kvtier.store import TieredStore\n"): True,
        ("kvtier.memory.x", "m.py", "import kvtier.config\n"): True,
        ("kvtier.tiers.x", "m.py", "def f():\n    from kvtier.prefetch import Prefetcher\n"): True,
        ("kvtier.wire.x", "m.py", "import typing\nif typing.TYPE_CHECKING:\n    import kvtier.pool\n"): True,
        ("kvtier.client.master", "m.py", "from kvtier.client import agent\n"): True,
        ("kvtier.store.x", "m.py", "from kvtier.pool import process\n"): True,
        ("kvtier.wire.x", "m.py", lazy_getattr): True,  # __getattr__ of a module, not of a package __init__
        ("kvtier.wire.x", "__init__.py", lazy_getattr): False,  # a package's lazy name: a declared lazy load
        ("kvtier.client.x", "m.py", "from kvtier.client import api\n"): False,
        ("kvtier.store.x", "m.py", "from kvtier.tiers import Tier\nfrom kvtier import units\n"): False,
        ("kvtier.tools.x", "m.py", "from kvtier.bench.common import x\n"): False,  # the same floor
        ("kvtier.pool.x", "m.py", "from kvtier.store.types import StoreEvent\n"): False,
    }
    for (module, name, source), bad in cases.items():
        path = tmp_path / name
        path.write_text(source)
        found = arrows_up(list(edges_of(path, module, known | {module})))
        assert bool(found) == bad, (module, source, found)


def test_the_circle_rule_catches_a_circle(tmp_path: Path) -> None:
    """A circle is found through a lazy import and through a package run first, with each edge's file:line; a
    package's __getattr__ load, a type-only import and a declared lazy load are no edges."""

    def scan(files: dict[str, str], lazy_loads: dict[tuple[str, str], str] | None = None) -> list[str]:
        scanned = []
        for i, (module, source) in enumerate(files.items()):
            folder = tmp_path / str(len(list(tmp_path.iterdir()))) / str(i)
            folder.mkdir(parents=True)
            path = folder / ("__init__.py" if module in ("kvtier.p", "kvtier.q") else "m.py")
            path.write_text(source)
            scanned.append((path, module))
        return circles([e for p, m in scanned for e in edges_of(p, m, {m for _, m in scanned})], lazy_loads)

    found = scan({"kvtier.a": "from kvtier import b\n", "kvtier.b": "def f():\n    import kvtier.a\n"})
    assert len(found) == 1 and "kvtier.a (" in found[0] and "kvtier.b (" in found[0] and "m.py:2" in found[0], found
    # kvtier.q.x imports kvtier.p.b: kvtier/p/__init__ runs first, and it imports kvtier.p.a, which imports q.x
    package = {"kvtier.p": "from kvtier.p.a import A\n", "kvtier.p.a": "import kvtier.q.x\nA = 1\n",
               "kvtier.p.b": "", "kvtier.q": "", "kvtier.q.x": "from kvtier.p.b import B\n"}
    found = scan(package)
    assert found and "its package, run first" in found[0], found
    lazy = "def __getattr__(name):\n    from kvtier.p.a import A\n    return A\n"
    assert not scan({**package, "kvtier.p": lazy})
    assert not scan({"kvtier.a": "import kvtier.b\n",
                     "kvtier.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvtier.a\n"})
    plugins = {"kvtier.a": "def load():\n    import kvtier.b\n", "kvtier.b": "import kvtier.a\n"}
    assert scan(plugins) and not scan(plugins, {("kvtier.a", "kvtier.b"): "why"})
    # a declared lazy load is so only inside a function
    assert scan({"kvtier.a": "import kvtier.b\n", "kvtier.b": "import kvtier.a\n"}, {("kvtier.a", "kvtier.b"): "why"})
