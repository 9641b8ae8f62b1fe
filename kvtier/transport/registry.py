"""The pool transports, one table: each data path a PoolConnection class registered by name, with what it needs of
the endpoint, the pool's hello and this host, and its place in ``transport="auto"`` (``connect`` in dial.py picks
from this table; ``pool_transport`` names one of it). A new transport is one module and one
``register_transport`` call, in kvtier or in a module of your own imported before the connection is made.

    name    auto  endpoints  pool must offer  pool service (offers it when)     this host must
    shm     0     ipc://     shm              shm (an ipc:// endpoint it binds)  map the pool's file (a connection
                                                                                 that may: ``shared_memory``)
    rdma    1     tcp://     rdma             rdma (it serves RDMA)              have pyverbs and an RDMA device
    stream  2     tcp://     stream           stream (its data port is on)       -
    tcp     3     both       tcp              frames (always)                    -

``auto`` takes the lowest-ranked transport that the endpoint, the pool's offer and this host all allow; naming
one insists on it, and what it cannot do here is an error naming why. Importing this module imports no
transport: a class is imported when first chosen (rdma pulls in nothing of pyverbs until then either).

The pool reads the same table (``pool_offers``): its hello lists a transport's offer when it serves the
transport's ``pool_service`` (what each service is and when a pool serves it: pool/offers.py ``SERVICES``). So a
transport registered in the pool's process over a service the pool has is offered with no edit of the pool;
one with no ``pool_service`` is never listed by the pool itself (it needs another transport's offer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.registry import import_target


@dataclass(frozen=True)
class Transport:
    """One data path to a pool."""

    name: str
    target: str  # "package.module:Class", a PoolConnection subclass, imported when first chosen
    offer: str  # the key the pool's hello must list under "transports"
    schemes: tuple[str, ...] = ("ipc", "tcp")  # endpoint schemes it runs over
    auto: int | None = None  # rank in transport="auto" (the lowest possible wins); None: only when named
    maps_memory: bool = False  # maps the pool's memory: never on a connection that may not (shared_memory False)
    copy_threads: bool = False  # copies host memory itself: takes connect()'s copy_threads
    host_reason: Callable[[], str | None] | None = None  # why this host cannot use it (None: it can)
    not_offered: str = ""  # what to tell a caller who named it when the pool does not offer it
    # What of the pool carries it: a pool serving that lists ``offer`` in its hello (pool/offers.py SERVICES:
    # "frames", "stream", "shm", "rdma"); None: the pool never lists it itself.
    pool_service: str | None = None

    def connection_class(self) -> type[Any]:
        return import_target(self.target)  # type: ignore[no-any-return]

    def cannot_here(self) -> str | None:
        return self.host_reason() if self.host_reason is not None else None


_TABLE: dict[str, Transport] = {}


def register_transport(transport: Transport) -> Transport:
    """Add ``transport`` to the table (ValueError if its name is taken, or is "auto")."""
    if transport.name == "auto" or transport.name in _TABLE and _TABLE[transport.name] != transport:
        raise ValueError(f"pool transport {transport.name!r} is registered already (or reserved)")
    _TABLE[transport.name] = transport
    return transport


def known_transports() -> list[str]:
    return list(_TABLE)


def transport(name: str) -> Transport:
    """The transport registered as ``name``; ValueError naming the known ones."""
    found = _TABLE.get(name)
    if found is None:
        raise ValueError(f"unknown pool transport {name!r}; known: auto, {', '.join(_TABLE)}")
    return found


def pool_offers() -> dict[str, list[str]]:
    """For the pool's hello: per pool service, the offers of the transports it carries (the table's order)."""
    out: dict[str, list[str]] = {}
    for t in _TABLE.values():
        if t.pool_service is not None and t.offer not in out.setdefault(t.pool_service, []):
            out[t.pool_service].append(t.offer)
    return out


def auto_order() -> list[Transport]:
    """The transports ``auto`` may pick, most preferred first."""
    ranked = [(t.auto, i, t) for i, t in enumerate(_TABLE.values()) if t.auto is not None]
    return [t for _, _, t in sorted(ranked)]


def _rdma_reason() -> str | None:
    from kvtier.wire.verbs import unavailable_reason

    return unavailable_reason()


register_transport(Transport("shm", "kvtier.transport.shm:ShmConnection", "shm", ("ipc",), auto=0, maps_memory=True,
                             copy_threads=True, pool_service="shm",
                             not_offered="the pool offers no shared memory (it does so on an ipc:// endpoint it "
                                         "binds)"))
register_transport(Transport("rdma", "kvtier.transport.rdma:RdmaConnection", "rdma", ("tcp",), auto=1,
                             host_reason=_rdma_reason, pool_service="rdma", not_offered="the pool serves no RDMA"))
register_transport(Transport("stream", "kvtier.transport.stream:StreamConnection", "stream", ("tcp",), auto=2,
                             pool_service="stream",
                             not_offered="the pool offers no stream data port (started with --stream off?)"))
register_transport(Transport("tcp", "kvtier.transport.tcp:TcpConnection", "tcp", auto=3, pool_service="frames"))
