"""Node and TierState: what kvtier-master knows about one node (a process holding a TieredStore: an engine or
kvtier-pool), as its registration and heartbeats describe it, how the ``nodes`` op shows it and what of it
persists across master restarts. The lifecycle (the states below, leases, ownership) is nodes.py's
NodeRegistry. Plain data; master event loop only, as the registry that holds them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.master.access import ANONYMOUS_QUOTA

LIVE, SYNCING, PENDING, DEAD = "live", "syncing", "pending", "dead"


@dataclass
class TierState:
    """One tier of a node as its heartbeats describe it. ``bw`` 0.0 means not measured yet."""

    name: str
    capacity: int
    used: int = 0
    bw: float = 0.0  # bytes/s, EWMA of real transfers out of this tier, measured by the node
    promised: int = 0  # bytes route_put sent here since the last heartbeat (not yet in ``used``)

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used - self.promised)


@dataclass
class Node:
    """What the master knows about one node (a process holding a TieredStore: an engine or kvtier-pool)."""

    node_id: str
    address: str
    tiers: dict[str, TierState]  # in the node's order, fastest first
    labels: dict[str, str]
    incarnation: str
    state: str = SYNCING
    locations: dict[str, int] = field(default_factory=dict)  # tier -> location, for the current sync generation
    applied_seq: int | None = None  # last event sequence number applied; None: needs a full inventory
    next_part: int | None = None  # next inventory part expected while syncing
    last_seen: float = 0.0
    path_bw: dict[str, float] = field(default_factory=dict)  # peer node id -> bytes/s into this node
    rpc_latency_s: float = 0.0
    registered_at: float = field(default_factory=time.time)
    owner: str = ANONYMOUS_QUOTA  # the key that registered it (access.Caller.quota)
    dead_at: float | None = None  # wall clock of its death (lease expiry or goodbye); None while not dead
    beats: int = 0  # node ops applied (register, heartbeat, inventory): a logged expiry names the count it saw

    @property
    def incarnation_digest(self) -> str:
        """What ``nodes`` shows of the incarnation: enough to tell two apart, not enough to act as the node."""
        return hashlib.sha256(self.incarnation.encode()).hexdigest()[:12]

    def view(self, now: float, lease_s: float) -> dict[str, Any]:
        """The node as the ``nodes`` op answers it."""
        return {
            "node": self.node_id, "address": self.address, "state": self.state, "labels": self.labels,
            "incarnation": self.incarnation_digest, "owner": self.owner[:12], "dead_at": self.dead_at,
            "applied_seq": self.applied_seq,
            "silent_s": round(max(0.0, now - self.last_seen), 3), "lease_s": lease_s,
            "rpc_latency_s": self.rpc_latency_s, "path_bw": self.path_bw,
            "tiers": [{"name": t.name, "capacity": t.capacity, "used": t.used, "bw": t.bw} for t in self.tiers.values()],
            "registered_at": self.registered_at,
        }

    def record(self) -> dict[str, Any]:
        """What persists across master restarts (liveness does not: a restarted master hears nodes anew)."""
        return {"node": self.node_id, "address": self.address, "labels": self.labels,
                "incarnation": self.incarnation, "registered_at": self.registered_at,
                "tiers": [[t.name, t.capacity] for t in self.tiers.values()], "owner": self.owner,
                "dead_at": self.dead_at}
