"""What a pool's hello offers: per transport its clients may use, what they need to know of it (a data port and its
token, the shared-memory file, the RDMA endpoint). The transports come from the client side's table
(kvtier/transport/registry.py, ``pool_offers``), each naming the ``pool_service`` that carries it; this module
says what each service is and whether this pool serves it (``SERVICES``), so a transport registered over a service
the pool has is offered with no edit here. Called on the pool's worker threads (it reads settled state only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.pool.state import PoolState
from kvtier.tiers.dram import DramTier
from kvtier.transport import pool_offers


def _frames(st: PoolState, tier: DramTier | None) -> dict[str, Any] | None:
    return {}  # block bytes in zmq frames on the pool's own sockets: every pool, nothing more to say


def _stream(st: PoolState, tier: DramTier | None) -> dict[str, Any] | None:
    if not st.stream_port:
        return None
    offer: dict[str, Any] = {"port": st.stream_port}
    if st.tokens is not None:  # the data port's admission (kvtier/auth/tokens.py); only keys or the owner
        offer["token"] = st.tokens.issue()  # token got this far
    return offer


def _shm(st: PoolState, tier: DramTier | None) -> dict[str, Any] | None:
    if st.shm_path is None:  # no ipc:// endpoint bound
        return None
    return ({"path": str(st.shm_path), "nbytes": tier.capacity_bytes,
             "generations": str(st.generations.path) if st.generations else ""}
            if tier is not None else {})  # unsized: the file comes with the first block


def _rdma(st: PoolState, tier: DramTier | None) -> dict[str, Any] | None:
    return st.rdma.describe() if st.rdma is not None else None


# What a pool serves, by the name a transport declares as its ``pool_service`` (kvtier/transport/registry.py), in
# the order the hello lists them: what a client is told of it, or None where this pool does not serve it (``tier``:
# the pool's tier as the hello found it, None while unsized).
SERVICES: dict[str, Callable[[PoolState, DramTier | None], dict[str, Any] | None]] = {
    "frames": _frames, "stream": _stream, "shm": _shm, "rdma": _rdma}


def offers(st: PoolState, tier: DramTier | None) -> dict[str, Any]:
    """The hello's ``transports``, from the transports' table (``pool_offers``: the table as this process has it,
    a transport registered by a module it imported included): per service this pool serves, the offer of each
    transport that declares it, each with what its service tells a client. A service no transport declares is not
    described (no data-port token issued for nobody); one this pool does not know is not offered."""
    out: dict[str, Any] = {}
    declared = pool_offers()
    for service, describe in SERVICES.items():
        keys = declared.get(service)
        offer = describe(st, tier) if keys else None
        if offer is not None:
            out.update((key, dict(offer)) for key in keys)
    return out
