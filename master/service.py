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
from kvtier.master.nodes import DEAD, LIVE, Node, NodeRegistry
from kvtier.master.persist import MasterDisk
from kvtier.master.placement import PlacementPolicy, make_placement

log = logging.getLogger(__name__)


@dataclass
class MasterSettings:
    """The daemon's knobs (``kvtier-master --help`` documents each)."""

    bind: str = "tcp://127.0.0.1:7300"
    data_dir: str | None = None
    metrics_port: int | None = 9310
    metrics_host: str = "0.0.0.0"
    lease_s: float = 10.0
    heat_half_life_s: float = 600.0
    placement: str = "most_available"
    max_batch_keys: int = 1 << 20
    max_message_bytes: int = 256 << 20
    snapshot_interval_s: float = 300.0
    sweep_slots_per_tick: int = 1 << 18
    max_hint_keys: int = 1 << 20
    cost: CostDefaults = field(default_factory=CostDefaults)
    auth_dir: str = ""  # CurveZMQ keys (kvtier/auth): server.key_secret and authorized/; "" admits anyone


class MasterState:
    """Directory, nodes, hints, cost model and placement policies of one master."""

    def __init__(self, settings: MasterSettings, metrics: MasterMetrics | None = None,
                 mono: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.mono, self.wall = mono, wall
        self.started = mono()
        self.metrics = metrics or MasterMetrics()
        self.directory = Directory(HeatClock(settings.heat_half_life_s, wall()))
        self.registry = NodeRegistry(settings.lease_s)
        self.hints = HintTable(settings.max_hint_keys)
        self.cost = CostModel(self.registry, settings.cost)
        self._placements: dict[str, PlacementPolicy] = {}
        make_placement(settings.placement)  # fail at start-up, not at the first route_put
        self.hints_dirty = False
        self.activity = Activity()  # for kvtier status (ping's "activity")
        self.nodes_dirty: set[str] = set()  # node records to write to disk

    # ---- shared helpers for the ops --------------------------------------------------------------------

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
        retired = self.registry.expire(self.mono())
        if retired:
            self.metrics.lease_expiries.inc()
            self.retire(retired)

    def retire(self, locations: list[int]) -> None:
        self.directory.retire(locations)

    def node_allocated(self, node: Node) -> None:
        """A node got fresh locations: the directory masks must have room for them."""
        self.directory.ensure_locations(self.registry.location_count)
        self.metrics.resyncs.labels(node.node_id).inc()

    # ---- timer -----------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Periodic housekeeping (the server calls this every ~100 ms)."""
        self.expire_leases()
        if self.hints.expire(self.wall()):
            self.hints_dirty = True
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
            self.hints = HintTable.from_wire(hints, self.settings.max_hint_keys)
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

    def dirty_records(self) -> list[dict[str, Any]]:
        out = [self.registry.nodes[n].record() for n in self.nodes_dirty
               if n in self.registry.nodes and self.registry.nodes[n].state != DEAD]
        self.nodes_dirty.clear()
        return out
