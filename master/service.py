"""MasterState: everything the master knows, owned by its event loop, and what happens between requests.

The ops (ops_router.py, ops_node.py) read and change this state; the server (server.py) moves frames and
calls them; ``tick`` runs from the server's timer: lease expiry, hint expiry, sweeping dead locations out of
the directory, metrics gauges. ``restore`` and ``snapshot`` connect it to lmdb (persist.py).

Runs in the master's event loop; not thread-safe. Clocks are injectable (tests run leases without sleeping):
``mono`` for leases and latencies, ``wall`` for heat, hints and snapshots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.master.activity import Activity
from kvtier.master.cost import CostDefaults, CostModel
from kvtier.master.directory import Directory
from kvtier.master.heat import HeatClock
from kvtier.master.hints import HintTable
from kvtier.master.metrics import MasterMetrics
from kvtier.master.nodes import LIVE, Node, NodeRegistry
from kvtier.master.persist import MasterDisk
from kvtier.master.placement import PlacementPolicy, make_placement
from kvtier.master.prefetch import PrefetchOrders
from kvtier.master.replication import Replicator

log = logging.getLogger(__name__)


@dataclass
class MasterSettings:
    """The daemon's knobs (``kvtier-master --help`` documents each)."""

    bind: str = "tcp://127.0.0.1:7300"
    data_dir: str | None = None
    metrics_port: int | None = 9310
    metrics_host: str = "127.0.0.1"  # the Prometheus port serves anyone who reaches it: loopback unless widened
    lease_s: float = 10.0
    heat_half_life_s: float = 600.0
    placement: str = "most_available"
    max_batch_keys: int = 1 << 16  # keys per request (a 1 MiB key blob): the largest honest message's size
    max_message_bytes: int = 0  # zmq's MAXMSGSIZE; 0: message_bytes() (derived from max_batch_keys)
    snapshot_interval_s: float = 300.0
    sweep_slots_per_tick: int = 1 << 18
    # Memory bounds (docs/reliability.md): what the master keeps, whoever asks.
    max_nodes: int = 1024  # node records (live, syncing, pending, dead)
    max_nodes_per_client: int = 0  # nodes one key may hold (with --auth-dir; 0: only max_nodes)
    max_locations: int = 1024  # node tiers numbered at once: bits in every directory entry's mask
    forget_dead_s: float = 3600.0  # a dead node is forgotten (here and on disk) this long after its death
    max_hint_keys: int = 1 << 20
    max_hint_sessions: int = 1 << 18
    max_hints_per_client: int = 0  # hint entries one key may hold (with --auth-dir; 0: only the totals)
    reply_budget_bytes: int = 256 << 20  # replies zmq has not sent yet, all clients together
    client_reply_bytes: int = 32 << 20  # ... and per client connection (one larger reply when it has none unsent)
    handshake_timeout_s: float = 5.0  # a connection that has not finished zmq's handshake by then is closed
    cost: CostDefaults = field(default_factory=CostDefaults)
    auth_dir: str = ""  # CurveZMQ keys (kvtier/auth): server.key_secret and authorized/; "": the owner token
    # Without keys: False admits only this user's processes (the owner token, kvtier/auth/owner.py), True anyone
    # who reaches the port (--insecure-bind).
    insecure_bind: bool = False
    # The state's home: "" (this process, with --data-dir's lmdb if set) or redis://HOST:PORT/N, shared by every
    # master started with the same URL (master/shared.py).
    directory: str = ""
    write_timeout_s: float = 2.0  # redis: a write not seen back in the log by then is answered ERR_UNAVAILABLE
    # Hot-block replication (master/replication.py): off at 0; a prefix this hot held by one pool gets a copy.
    replicate_heat: float = 0.0
    replicate_interval_s: float = 5.0

    def message_bytes(self) -> int:
        """The largest message the master reads (zmq MAXMSGSIZE): 24 B per key of the largest batch (a key and
        a route_put size) plus 1 MiB for the rest of a request; a longer one closes its connection unread."""
        return self.max_message_bytes or self.max_batch_keys * 24 + (1 << 20)


class MasterState:
    """Directory, nodes, hints, cost model and placement policies of one master."""

    def __init__(self, settings: MasterSettings, metrics: MasterMetrics | None = None,
                 mono: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.mono = mono
        self._clock_wall = wall
        # While a shared log entry is applied, "now" is the time its master accepted it, so every master that
        # applies it computes the same expiries and death times (master/shared.py).
        self.command_time: float | None = None
        # Shared (redis) state: leases, hint expiry and forgetting change state only through logged commands the
        # backend proposes, never as a side effect of a request or of this master's clock.
        self.shared = bool(settings.directory)
        self.started = mono()
        self.metrics = metrics or MasterMetrics()
        self.directory = Directory(HeatClock(settings.heat_half_life_s, wall()), count_unsent=bool(settings.directory))
        self.registry = NodeRegistry(settings.lease_s, max_nodes=settings.max_nodes,
                                     max_nodes_per_client=settings.max_nodes_per_client,
                                     max_locations=settings.max_locations, forget_dead_s=settings.forget_dead_s,
                                     wall=self.wall, reclaim=self._reclaim_locations)
        self.registry.on_forget = lambda node: self.metrics.forget_node(node.node_id, list(node.tiers))
        self.hints = self._hint_table()
        self.cost = CostModel(self.registry, settings.cost)
        self._placements: dict[str, PlacementPolicy] = {}
        make_placement(settings.placement)  # fail at start-up, not at the first route_put
        # Hot-block replication between pools, when --replicate-heat is set (master/replication.py).
        self.replication = (Replicator(settings.replicate_heat, settings.replicate_interval_s)
                            if settings.replicate_heat > 0 else None)
        self.prefetches = PrefetchOrders()  # orders waiting for their node's heartbeat (master/prefetch.py)
        self.activity = Activity()  # for kvtier status (ping's "activity")
        self.backend_status: Callable[[], dict[str, Any]] = lambda: {"kind": "memory", "state": "ok"}
        self._next_forget = 0.0
        # Shared: promised bytes counted here since the backend last logged them (an order-free sum).
        self._promised: dict[str, dict[str, int]] = {}

    def wall(self) -> float:
        """Unix time: the applied command's when one is being applied, else the clock's."""
        return self.command_time if self.command_time is not None else self._clock_wall()

    # ---- shared helpers for the ops --------------------------------------------------------------------

    def _hint_table(self, entries: Any = (), version: int = 0) -> HintTable:
        s = self.settings
        return HintTable.from_entries(entries, version, s.max_hint_keys, s.max_hint_sessions, s.max_hints_per_client,
                                      track_changes=bool(s.data_dir))

    def touch(self, slots: np.ndarray) -> None:
        """One access of each directory slot now (lookup, cost); shared, also counted for the log
        (``directory.take_unsent``)."""
        self.directory.touch(slots, self.wall())

    def promise(self, node: str, tier: str, nbytes: int) -> None:
        """route_put sent ``nbytes`` to (node, tier): free space it no longer has until its next heartbeat."""
        self.registry.nodes[node].tiers[tier].promised += nbytes
        if self.shared:
            by_tier = self._promised.setdefault(node, {})
            by_tier[tier] = by_tier.get(tier, 0) + nbytes

    def take_promises(self) -> dict[str, dict[str, int]]:
        out, self._promised = self._promised, {}
        return out

    def placement(self, spec: str | None) -> PlacementPolicy:
        spec = spec or self.settings.placement
        policy = self._placements.get(spec)
        if policy is None:
            policy = self._placements[spec] = make_placement(spec)
        return policy

    def live_mask(self) -> np.ndarray:
        """Expire leases first, so a node silent past its lease is never answered from."""
        self.expire_leases()
        return self.registry.live_mask(self.directory.words)

    def expire_leases(self) -> None:
        if self.shared:
            return  # deaths are logged commands (master/shared.py proposes them), applied by every master alike
        retired = self.registry.expire(self.mono())
        if retired:
            self.metrics.lease_expiries.inc()
            self.retire(retired)

    def expire_hints(self) -> None:
        if not self.shared:
            self.hints.expire(self.wall())

    def retire(self, locations: list[int]) -> None:
        self.directory.retire(locations)

    def _reclaim_locations(self) -> list[int]:
        """Finish the directory's sweep now (the registry ran out of swept location numbers while retired ones
        are still being cleared): how many nodes fit then depends only on the nodes, not on sweep timing."""
        freed: list[int] = []
        while self.directory.sweeping:
            freed += self.directory.sweep(self.directory.table.capacity)
        return freed

    def node_allocated(self, node: Node) -> None:
        """A node got fresh locations: the directory masks must have room for them."""
        self.directory.ensure_locations(self.registry.location_count)
        self.metrics.resyncs.labels(node.node_id).inc()

    # ---- timer -----------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Periodic housekeeping (the server calls this every ~100 ms)."""
        self.expire_leases()
        self.expire_hints()
        if not self.shared and self.mono() >= self._next_forget:
            self._next_forget = self.mono() + 1.0
            self.registry.forget_dead()
            self.prefetches.prune(self)  # shared: pruned as orders are added and taken, at their entries' time
        if self.replication is not None:
            self.replication.tick(self, self.mono())
        freed = self.directory.sweep(self.settings.sweep_slots_per_tick)
        if freed:
            self.registry.release(freed)
            log.info("directory swept clean of retired locations %s", freed)
        m = self.metrics
        for state, count in self.registry.counts().items():
            m.nodes.labels(state).set(count)
        m.entries.set(len(self.directory))
        m.directory_bytes.set(self.directory.nbytes)
        m.hints.set(len(self.hints))

    # ---- persistence -----------------------------------------------------------------------------------

    def restore(self, disk: MasterDisk) -> None:
        """Load nodes, hints and the directory snapshot after a (clean or crashed) restart."""
        now = self.mono()
        hints = disk.load_hints()
        if hints is not None:
            self.hints = self._hint_table(*hints)
        snap = disk.load_snapshot()
        synced: dict[str, dict[str, Any]] = {}
        if snap is not None:
            arrays, meta = snap
            self.directory.clock.t0 = meta["t0"]
            self.directory.restore(arrays)
            synced = meta["nodes"]
        self.registry.load(disk.load_nodes(), synced, now)
        self.directory.retire(self.registry.adopt_orphans(self.directory.present_locations()))
        self.directory.ensure_locations(self.registry.location_count)
        log.info("restored %d nodes (all pending until they heartbeat), %d directory keys, %d hints from disk",
                 len(self.registry.nodes), len(self.directory), len(self.hints))

    def snapshot(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Copies of the directory and the per-node sync points it is consistent with (cheap to take on the
        loop; the caller writes them from another thread)."""
        arrays = self.directory.export()
        nodes = {n.node_id: {"incarnation": n.incarnation, "seq": n.applied_seq, "locations": n.locations}
                 for n in self.registry.nodes.values() if n.state == LIVE and n.applied_seq is not None}
        return arrays, {"t0": self.directory.clock.t0, "nodes": nodes, "saved_at": self.wall()}

    def dirty_records(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Node records to write (registered or died since the last call) and node ids to delete (forgotten)."""
        reg = self.registry
        out = [reg.nodes[n].record() for n in reg.dirty if n in reg.nodes]
        gone = sorted(reg.forgotten)
        reg.dirty.clear()
        reg.forgotten.clear()
        return out, gone
