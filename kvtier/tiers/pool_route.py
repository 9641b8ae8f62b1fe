"""Where a PoolTier puts blocks and where it looks for them: a static list of pools, or kvtier-master.

* ``PeerRoute(endpoints)``: no master. Each key belongs to one pool by rendezvous hashing over the pools that
  are up (with one pool, everything goes there). Gets ask the pool the key hashes to; a key put while its
  pool was down sits on the next-ranked pool and is a miss once its own pool is back (a miss, never wrong).
* ``MasterRoute(master, requester)``: kvtier-master places (``route_put`` among nodes labelled role=pool, so
  engines' own DRAM is never a target) and finds (``locate``: per key, a live pool holding it). Its answers
  are the directory, so ``contains`` needs no round trip to the pools.

Both are thread-safe. A route names pools by endpoint; the tier owns the connections.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvtier import wire
from kvtier.keys import rendezvous_order
from kvtier.pool.protocol import POOL_LABELS
from kvtier.transport.base import PoolUnavailable

Up = Callable[[str], bool]  # is this pool usable now (not in its back-off after a failure)?


class PoolRoute(Protocol):
    authoritative: bool  # locate() answers from a directory: a key it does not name is not held

    def place(self, keys: Sequence[bytes], block_bytes: int, up: Up) -> list[str | None]:
        """The pool each new block should go to (None: no pool has room or is up)."""

    def locate(self, keys: Sequence[bytes], up: Up) -> list[str | None]:
        """The pool to ask for each key (None: no pool holds it)."""

    def endpoints(self) -> list[str]:
        """Every pool this route knows now."""

    def close(self) -> None: ...


class PeerRoute:
    """A static list of pool endpoints, placement by rendezvous hashing of keys over the ones that are up."""

    authoritative = False

    def __init__(self, endpoints: Sequence[str]) -> None:
        if not endpoints:
            raise ValueError("a pool route needs at least one pool endpoint")
        self._endpoints = list(dict.fromkeys(endpoints))

    def place(self, keys: Sequence[bytes], block_bytes: int, up: Up) -> list[str | None]:
        return self._owners(keys, up)

    def locate(self, keys: Sequence[bytes], up: Up) -> list[str | None]:
        return self._owners(keys, up)

    def _owners(self, keys: Sequence[bytes], up: Up) -> list[str | None]:
        live = [e for e in self._endpoints if up(e)]
        if len(live) <= 1:
            return [live[0] if live else None] * len(keys)
        first = rendezvous_order(np.frombuffer(wire.pack_keys(keys), "<u8").reshape(-1, 2), live)[:, 0]
        return [live[i] for i in first.tolist()]

    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    def close(self) -> None:
        pass


class MasterRoute:
    """kvtier-master's placements and directory. ``requester`` is this node's id (the local_first policy
    places on the requester when it is a pool itself)."""

    authoritative = True

    def __init__(self, master: str, requester: str, timeout_s: float = 0.5) -> None:
        from kvtier.client import MasterClient

        self.master = master
        self.requester = requester
        self._client = MasterClient(master, timeout_s)
        self._address: dict[str, str] = {}  # node id -> endpoint
        self._lock = threading.Lock()

    def place(self, keys: Sequence[bytes], block_bytes: int, up: Up) -> list[str | None]:
        from kvtier.client import MasterError

        try:
            targets = self._client.route_put([block_bytes] * len(keys), self.requester, keys, labels=POOL_LABELS)
            unknown = {t[0] for t in targets if t is not None and t[0] not in self._address}
            if unknown:
                self._refresh()
        except MasterError as e:
            raise PoolUnavailable(self.master, f"the master cannot place blocks: {e}", "master") from None
        out = [self._address.get(t[0]) if t is not None else None for t in targets]
        return [e if e is not None and up(e) else None for e in out]

    def locate(self, keys: Sequence[bytes], up: Up) -> list[str | None]:
        from kvtier.client import MasterError

        try:
            found = self._client.locate(keys, labels=POOL_LABELS)
        except MasterError as e:
            raise PoolUnavailable(self.master, f"the master cannot locate blocks: {e}", "master") from None
        with self._lock:
            for node, _tier, address in found.holders:
                self._address[node] = address
        return [found.holders[w][2] if w >= 0 else None for w in found.where]

    def endpoints(self) -> list[str]:
        with self._lock:
            return sorted(set(self._address.values()))

    def _refresh(self) -> None:
        nodes = self._client.nodes()
        with self._lock:
            for n in nodes:
                if n.get("labels", {}).get("role") == POOL_LABELS["role"] and n.get("address"):
                    self._address[n["node"]] = n["address"]

    def close(self) -> None:
        self._client.close()
