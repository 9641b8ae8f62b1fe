"""NodeRegistry: the nodes of the cluster, their leases, their measured signals, and their directory locations.

A node goes through these states:

    (register) -> syncing --inventory done--> live --silent for a lease--> dead
                    ^                           |
                    +------- seq gap -----------+
    pending: loaded from disk after a master restart, not heard from yet (not answered from, lease running)

Only *live* nodes are answered from: a syncing node's placements are incomplete, a pending one's may be
stale, a dead one's are gone. A dead node is kept (``nodes`` shows it) for ``forget_dead_s``, then forgotten,
here and on disk; a restarted master forgets the ones whose grace ran out while it was down.

An address (the node's endpoint) belongs to the node that registered it while that node is not dead: a
register naming an address another node holds is refused (ERR_NODE_OWNED), so the endpoints the master hands
out (replication's copy sources, locate's holders) are each one registered node's.

A node id belongs to the registration that holds it while it is not dead: only a request carrying that
registration's incarnation (a random id the node draws at start and never shows; ``nodes`` shows a digest)
and, with keys, coming from the same key may act as the node (heartbeat, events, inventory, goodbye) or
register it again; anyone else gets ERR_NODE_OWNED until it says goodbye or its lease runs out. With keys, the
key that holds it may also register it afresh (the node restarted): keys are the cluster's own daemons.

Bounds: at most ``max_nodes`` nodes (live, syncing, pending or dead: the oldest dead one is forgotten early to
make room), at most ``max_nodes_per_client`` registered by one key (0: no such limit), and at most
``max_locations`` locations numbered at once (each is a bit in every directory entry's mask). Each (node, tier)
of a sync generation owns one *location* (a bit of the directory masks); a new sync generation or a death
retires the old locations, which the directory sweeps and hands back for reuse (their numbering is
locations.py's LocationTable; the registry says which node holds which).

What the master knows of one node (Node, TierState, the states) is node.py's; the numbering of directory
locations, locations.py's. Runs in the master's event loop; not thread-safe. Times: ``now`` is
time.monotonic() (leases), except ``registered_at`` (wall clock, for humans).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.master.access import ANONYMOUS_QUOTA
from kvtier.master.directory import location_words
from kvtier.master.locations import LocationTable
from kvtier.master.node import DEAD, LIVE, PENDING, SYNCING, Node, TierState
from kvtier.wire import WireError

log = logging.getLogger(__name__)

class NodeRegistry:
    """Nodes by id, leases of ``lease_s`` seconds, and the location numbering the directory masks use."""

    def __init__(self, lease_s: float, *, max_nodes: int = 1024, max_nodes_per_client: int = 0,
                 max_locations: int = 1024, forget_dead_s: float = 3600.0,
                 wall: Callable[[], float] = time.time, reclaim: Callable[[], list[int]] | None = None) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease must be > 0 seconds, got {lease_s}")
        self.lease_s = lease_s
        self.max_nodes, self.max_nodes_per_client = max_nodes, max_nodes_per_client
        self.max_locations, self.forget_dead_s = max_locations, forget_dead_s
        self.wall = wall
        self.reclaim = reclaim  # finishes the directory's sweep now, returning the locations it freed
        self.nodes: dict[str, Node] = {}
        self.dirty: set[str] = set()  # node records to write (register, death)
        self.forgotten: set[str] = set()  # node records to delete
        self.on_forget: Callable[[Node], None] | None = None  # e.g. drop its metric series
        self.locations = LocationTable(max_locations)  # the directory-mask bits each (node, tier) owns
        self._live_mask = np.zeros(1, np.uint64)
        self._live_dirty = True
        self._next_deadline = float("inf")

    # ---- locations -------------------------------------------------------------------------------------

    @property
    def location_count(self) -> int:
        """Locations ever numbered (owned, retired or free): the directory masks need this many bits."""
        return self.locations.count

    def owner(self, loc: int) -> tuple[str, str] | None:
        return self.locations.owner(loc)

    def _allocate(self, node: Node) -> None:
        node.locations.update(self.locations.number(node.node_id, list(node.tiers), self.reclaim))

    def _retire(self, node: Node) -> list[int]:
        """Take the node's locations away (their bits are swept by the directory, then ``release``d)."""
        locs = list(node.locations.values())
        self.locations.retire(locs)
        node.locations = {}
        self._live_dirty = True
        return locs

    def release(self, locations: list[int]) -> None:
        """The directory swept these locations clean: they may be numbered again."""
        self.locations.release(locations)

    def mark_retired(self, locations: list[int]) -> None:
        """Locations whose bits may still be in the directory but that no node owns (before a sweep)."""
        for loc in locations:
            self.locations.set_owner(loc, None)

    def _claim(self, node: Node) -> None:
        """Mark the locations a restored node already holds (``node.locations``) as its own."""
        for tier, loc in node.locations.items():
            self.locations.set_owner(loc, (node.node_id, tier))

    # ---- node lifecycle --------------------------------------------------------------------------------

    def register(self, node_id: str, address: str, tiers: list[tuple[str, int]], labels: dict[str, str],
                 incarnation: str, seq: int, now: float, owner: str = ANONYMOUS_QUOTA,
                 keyed: bool = False) -> tuple[Node, bool, list[int]]:
        """Register (or re-register) a node. Returns (node, needs_inventory, retired locations).

        A node that re-registers with the incarnation and sequence number the master last applied (a master
        restart, a lost reply) keeps its placements; anything else starts a new sync generation. A node id
        that another registration holds (not dead) is refused (ERR_NODE_OWNED), unless ``keyed`` (the master
        requires keys) and ``owner`` is the key that holds it. A new id past the node limits is refused
        (ERR_TOO_LARGE) after forgetting the oldest dead node, if any, to make room.
        """
        old = self.nodes.get(node_id)
        if old is not None and old.state != DEAD:
            self.check_owner(old, incarnation, owner, keyed, "register")
        self._check_address(node_id, address, owner)
        if old is None:
            self._make_room(owner)
        tier_states = {name: TierState(name, cap) for name, cap in tiers}
        keep = (old is not None and old.incarnation == incarnation and old.state != DEAD
                and old.applied_seq == seq and old.locations and list(old.tiers) == list(tier_states))
        retired: list[int] = []
        if keep and old is not None:
            node = old
            node.address, node.labels = address, labels
            for name, t in tier_states.items():
                node.tiers[name].capacity = t.capacity
            node.state = LIVE
        else:
            if old is not None:
                retired = self._retire(old)
            node = Node(node_id, address, tier_states, labels, incarnation, state=SYNCING, owner=owner,
                        registered_at=self.wall())  # a shared log's entry time: the same on every master
            if old is not None and old.incarnation == incarnation:
                node.registered_at = old.registered_at
            self.nodes[node_id] = node
        node.last_seen = now
        node.beats += 1
        self.dirty.add(node_id)
        self.forgotten.discard(node_id)
        self._changed()
        return node, not keep, retired

    def check_owner(self, node: Node, incarnation: str, owner: str, keyed: bool, op: str) -> None:
        """ERR_NODE_OWNED unless the request comes from the registration holding ``node`` (see the module doc)."""
        same_key = not keyed or node.owner == owner
        if same_key and (node.incarnation == incarnation or (keyed and op == "register")):
            return
        raise WireError(wire.ERR_NODE_OWNED, f"node {node.node_id!r} is {node.state} and held by another "
                                             f"registration (incarnation {node.incarnation_digest}"
                                             f"{', key ' + node.owner[:12] if keyed else ''}); a {op} for it "
                                             "must come from that node. It is free once that node says goodbye "
                                             f"or stays silent for its lease ({self.lease_s:g} s)")

    def _check_address(self, node_id: str, address: str, owner: str) -> None:
        """ERR_NODE_OWNED when another node that is not dead registered ``address``: an endpoint is one node's,
        so a stranger cannot register a real pool's endpoint under a name of its own (and have the master send
        other pools there to copy, or clients to read). The server logs the refusal and counts it
        (kvtier_master_requests{op="register",status="node_owned"}); the message names who and whose."""
        if not address:
            return
        holder = next((n for n in self.nodes.values()
                       if n.address == address and n.node_id != node_id and n.state != DEAD), None)
        if holder is not None:
            raise WireError(wire.ERR_NODE_OWNED, f"node {node_id[:64]!r} (client {owner[:12]}) may not register "
                                                 f"address {address[:128]!r}: node {holder.node_id!r} "
                                                 f"({holder.state}) holds it; a node registers its own endpoint")

    def _make_room(self, owner: str) -> None:
        if self.max_nodes_per_client and owner != ANONYMOUS_QUOTA:
            mine = sum(n.owner == owner and n.state != DEAD for n in self.nodes.values())
            if mine >= self.max_nodes_per_client:
                raise WireError(wire.ERR_TOO_LARGE, f"this key ({owner[:12]}) holds {mine} nodes, the master's "
                                                    f"--max-nodes-per-client is {self.max_nodes_per_client}")
        if len(self.nodes) < self.max_nodes:
            return
        dead = [n for n in self.nodes.values() if n.state == DEAD]
        if not dead:
            counts = self.counts()
            raise WireError(wire.ERR_TOO_LARGE, f"the master keeps at most {self.max_nodes} nodes and holds "
                                                f"{len(self.nodes)} ({', '.join(f'{v} {k}' for k, v in counts.items())}"
                                                "): none is dead to forget (raise --max-nodes)")
        oldest = min(dead, key=lambda n: n.dead_at or 0.0)
        log.info("node table full (%d): forgetting dead node %s early to make room", self.max_nodes, oldest.node_id)
        self.forget(oldest)

    def forget(self, node: Node) -> list[int]:
        """Drop ``node`` from the registry and (through ``forgotten``) from disk; returns retired locations."""
        retired = self._retire(node) if node.locations else []
        del self.nodes[node.node_id]
        self.dirty.discard(node.node_id)
        self.forgotten.add(node.node_id)
        self._changed()
        if self.on_forget is not None:
            self.on_forget(node)
        return retired

    def forget_dead(self) -> list[str]:
        """Forget nodes dead for longer than ``forget_dead_s``; their ids."""
        now = self.wall()
        gone = [n for n in self.nodes.values()
                if n.state == DEAD and n.dead_at is not None and now - n.dead_at >= self.forget_dead_s]
        for n in gone:
            log.info("forgetting node %s: dead for %.0f s (--forget-dead-s %g)", n.node_id, now - n.dead_at,
                     self.forget_dead_s)
            self.forget(n)
        return [n.node_id for n in gone]

    def begin_inventory(self, node: Node) -> list[int]:
        """Part 0 of a full inventory: a fresh sync generation. Returns the retired old locations."""
        retired = self._retire(node)
        node.state = SYNCING
        node.applied_seq = None
        self._allocate(node)
        node.next_part = 1
        self._changed()
        return retired

    def finish_inventory(self, node: Node, seq: int) -> None:
        node.state = LIVE
        node.applied_seq = seq
        node.next_part = None
        self._changed()

    def lose_sync(self, node: Node, why: str) -> list[int]:
        """The node's placements can no longer be trusted (an event gap): stop answering from them."""
        log.warning("node %s out of sync (%s): its placements are dropped until it sends a full inventory",
                    node.node_id, why)
        retired = self._unsync(node)
        self._changed()
        return retired

    def lose_sync_all(self, why: str) -> list[int]:
        """No node's placements can be trusted (the shared directory's history was lost or rolled back): every
        node not dead is answered ``resync`` at its next contact (one log line for all of them)."""
        syncing = [n for n in self.nodes.values() if n.state != DEAD]
        retired = [loc for n in syncing for loc in self._unsync(n)]
        if syncing:
            log.warning("all %d nodes out of sync (%s): their placements are dropped until each sends a full "
                        "inventory", len(syncing), why)
        self._changed()
        return retired

    def _unsync(self, node: Node) -> list[int]:
        """Syncing, no inventory under way (so its next heartbeat or events are answered ``resync``)."""
        node.state = SYNCING
        node.applied_seq = None
        node.next_part = None
        return self._retire(node)

    def expire(self, now: float) -> list[int]:
        """Mark nodes silent for longer than their lease dead; returns their retired locations."""
        if now < self._next_deadline:
            return []
        retired: list[int] = []
        for node in self.nodes.values():
            if node.state != DEAD and now - node.last_seen > self.lease_s:
                log.warning("node %s lease expired: silent %.1f s > lease %.1f s; dropping its placements "
                            "(state was %s)", node.node_id, now - node.last_seen, self.lease_s, node.state)
                self._die(node)
                retired += self._retire(node)
        self._changed()
        return retired

    def silent(self, now: float) -> list[Node]:
        """Nodes (not dead) silent for longer than their lease, changing nothing (a shared master proposes
        their deaths to the log instead of declaring them)."""
        return [n for n in self.nodes.values() if n.state != DEAD and now - n.last_seen > self.lease_s]

    def due_to_forget(self) -> bool:
        now = self.wall()
        return any(n.state == DEAD and n.dead_at is not None and now - n.dead_at >= self.forget_dead_s
                   for n in self.nodes.values())

    def _die(self, node: Node) -> None:
        node.state = DEAD
        node.applied_seq = None
        node.dead_at = self.wall()
        self.dirty.add(node.node_id)

    def leave(self, node: Node, why: str = "said goodbye") -> list[int]:
        """The node said goodbye (or an operator forgets it): dead now; returns its retired locations."""
        log.info("node %s %s; dropping its placements", node.node_id, why)
        self._die(node)
        retired = self._retire(node)
        self._changed()
        return retired

    def heard_from(self, node: Node, now: float) -> None:
        node.last_seen = now
        node.beats += 1
        deadline = now + self.lease_s
        if deadline < self._next_deadline:
            self._next_deadline = deadline

    def _changed(self) -> None:
        self._live_dirty = True
        alive = [n.last_seen for n in self.nodes.values() if n.state != DEAD]
        self._next_deadline = min(alive) + self.lease_s if alive else float("inf")

    # ---- answers ---------------------------------------------------------------------------------------

    def live_mask(self, words: int) -> np.ndarray:
        """Bits of the locations of live nodes (what every answer ANDs placements with)."""
        if self._live_dirty or len(self._live_mask) != words:
            locs = [loc for n in self.nodes.values() if n.state == LIVE for loc in n.locations.values()]
            self._live_mask = location_words(locs, words)
            self._live_dirty = False
        return self._live_mask

    def live_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.state == LIVE]

    def counts(self) -> dict[str, int]:
        out = {LIVE: 0, SYNCING: 0, PENDING: 0, DEAD: 0}
        for n in self.nodes.values():
            out[n.state] += 1
        return out

    # ---- restart ---------------------------------------------------------------------------------------

    def load(self, records: list[dict[str, Any]], synced: dict[str, dict[str, Any]], now: float) -> None:
        """Nodes from disk after a restart: pending, with the locations and sequence number of the directory
        snapshot (``synced``: node id -> {"incarnation", "seq", "locations"}) where it has them."""
        wall = self.wall()
        for rec in records:
            tiers = {name: TierState(name, cap) for name, cap in rec["tiers"]}
            dead_at = rec.get("dead_at")
            if dead_at is not None and wall - dead_at >= self.forget_dead_s:
                self.forgotten.add(rec["node"])  # its grace ran out while the master was down
                continue
            node = Node(rec["node"], rec["address"], tiers, rec["labels"], rec["incarnation"],
                        state=PENDING if dead_at is None else DEAD, registered_at=rec["registered_at"],
                        last_seen=now, owner=rec.get("owner", ANONYMOUS_QUOTA), dead_at=dead_at)
            snap = synced.get(node.node_id)
            if node.state != DEAD and snap and snap["incarnation"] == node.incarnation and \
                    set(snap["locations"]) == set(tiers):
                node.applied_seq = snap["seq"]
                node.locations = dict(snap["locations"])
                self._claim(node)
            self.nodes[node.node_id] = node
        self._changed()

    def export(self) -> list[dict[str, Any]]:
        """Every node, whole (what a shared snapshot holds; liveness times excepted: they are this master's)."""
        return [{"node": n.node_id, "address": n.address, "labels": n.labels, "incarnation": n.incarnation,
                 "state": n.state, "locations": n.locations, "applied_seq": n.applied_seq, "next_part": n.next_part,
                 "path_bw": n.path_bw, "rpc_latency_s": n.rpc_latency_s, "registered_at": n.registered_at,
                 "owner": n.owner, "dead_at": n.dead_at, "beats": n.beats,
                 "tiers": [[t.name, t.capacity, t.used, t.bw, t.promised] for t in n.tiers.values()]}
                for n in self.nodes.values()]

    def load_export(self, records: list[dict[str, Any]], now: float) -> None:
        """Nodes as ``export`` wrote them, locations numbered as they were (an empty registry only). Each
        node not dead gets a lease from ``now``: this master has not heard it yet."""
        for r in records:
            tiers = {name: TierState(name, cap, used, bw, promised) for name, cap, used, bw, promised in r["tiers"]}
            node = Node(r["node"], r["address"], tiers, r["labels"], r["incarnation"], state=r["state"],
                        locations=dict(r["locations"]), applied_seq=r["applied_seq"], next_part=r["next_part"],
                        last_seen=now, path_bw=dict(r["path_bw"]), rpc_latency_s=r["rpc_latency_s"],
                        registered_at=r["registered_at"], owner=r["owner"], dead_at=r["dead_at"], beats=r["beats"])
            self._claim(node)
            self.nodes[node.node_id] = node
        self._changed()

    def confirm(self, node: Node, seq: int) -> bool:
        """A pending node heartbeats with ``seq``: live again if it matches the snapshot, else it must resync."""
        if node.applied_seq == seq and node.locations:
            node.state = LIVE
            self._changed()
            return True
        return False

    def adopt_orphans(self, present: list[int]) -> list[int]:
        """After a restart: of the locations with bits in the restored directory (``present``), those no node
        owns must be swept before reuse (returned); every other unowned number is free now."""
        owned = {loc for n in self.nodes.values() for loc in n.locations.values()}
        return self.locations.adopt_orphans(present, owned)
