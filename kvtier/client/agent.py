"""NodeAgent: tells kvtier-master what one node holds, keeps its lease, and hands it the master's hints.

Runs in the process that holds the blocks (an engine with an embedded TieredStore, or kvtier-pool):

    agent = NodeAgent.for_store(store, "tcp://master:7300", node_id="gpu-3", address="tcp://gpu-3:7400")
    agent.start()                 # background thread; store events flow to the master from now on
    ...
    agent.record_transfer(nbytes, seconds, tier="dram")      # the data path reports real transfers
    agent.close()

What it does, all on its own thread with its own socket (the store's threads only append to a queue):

* registers (node id, address, tiers with capacity, labels, a fresh incarnation id) and, when the master asks,
  sends a full inventory in parts (after a master restart without a usable snapshot, after an event gap, after
  its own events were lost to a timeout);
* publishes the store's ADD/REMOVE events in batches, one sequence number per message;
* heartbeats every lease/3 with used bytes per tier, bandwidth EWMAs per tier and per peer (from
  ``record_transfer``) and the EWMA of its own RPC round trips to the master;
* re-registers when the master says it does not know the node (a restart that lost the registry, a lease
  that expired while the node was partitioned);
* fetches hints when their version changes and passes them to ``on_hints`` (for a store: ``StoreHints``
  turns the master's pins and priorities into leases of the store, kvtier/client/store_hints.py);
* passes the prefetch orders a heartbeat reply carries to ``on_prefetch`` (for a store: ``StorePrefetch`` makes
  them jobs of the store's Prefetcher, kvtier/client/store_prefetch.py; master/prefetch.py). An order reaches
  the node within one heartbeat interval (lease/3) of the request.

Inventories come from ``list_keys`` (tier name -> the keys it holds now) where the node can list its tiers
(kvtier-pool does: its DRAM tier has ``keys()``). Otherwise the agent keeps a set of the keys each tier holds
(from the events); with ``verify`` each inventory is checked against the tiers themselves, so a reordered
event cannot make it lie. That set costs ~100 B per key held; attach the agent before the store holds blocks
(or pass them as ``initial``). With ``goodbye``, ``close`` tells the master the node is leaving, so its
placements go at once instead of when its lease runs out (kvtier-pool does this on SIGTERM).
``max_batch_keys`` and ``inventory_part_keys`` are lowered to the master's --max-batch-keys when it says so at
registration. The incarnation is the node's proof of identity: the master lets only requests carrying it act
as the node (a stranger can neither say goodbye for it nor register over it); while another registration of
the same node id is live (this node restarted after a kill -9), registering is refused and retried until that
registration's lease runs out. A pool's ``on_replicate`` gets the heartbeat replies that carry hot-block
replication work (copies to make from other pools, replicas to drop: master/replication.py).
``on_event`` and ``record_transfer`` are thread-safe; everything else is for the thread that owns the agent.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvtier import wire
from kvtier.auth import ClientKeys
from kvtier.client import api
from kvtier.client.api import MasterHints, NodeReply, PrefetchOrder
from kvtier.client.master import MasterClient, MasterError, MasterUnknownNode
from kvtier.client.store_hints import StoreHints
from kvtier.client.store_prefetch import StorePrefetch

log = logging.getLogger(__name__)

MAX_PENDING_KEYS = 1 << 22  # past this, queued events are dropped and the next contact is a full inventory


class NodeAgent:
    """One node's reporter to the master. ``tiers``: (name, capacity bytes), fastest first."""

    def __init__(self, master: str, node_id: str, tiers: Sequence[tuple[str, int]], *, block_bytes: int,
                 address: str = "", labels: Mapping[str, str] | None = None,
                 used: Callable[[], Mapping[str, int]] | None = None,
                 verify: Callable[[str, list[bytes]], list[bool]] | None = None,
                 on_hints: Callable[[MasterHints], None] | None = None,
                 initial: Mapping[str, Iterable[bytes]] | None = None,
                 list_keys: Callable[[str], list[bytes]] | None = None, goodbye: bool = False,
                 heartbeat_s: float | None = None, batch_interval_s: float = 0.01, max_batch_keys: int = 65536,
                 inventory_part_keys: int = 262144, timeout_s: float = 2.0, ewma_alpha: float = 0.2,
                 auth: ClientKeys | None = None,
                 on_replicate: Callable[[NodeReply], None] | None = None,
                 on_prefetch: Callable[[list[PrefetchOrder]], None] | None = None) -> None:
        if not tiers:
            raise ValueError("a node needs at least one tier")
        self.master = master
        self.node_id = node_id
        self.tiers = [(name, int(cap)) for name, cap in tiers]
        self.block_bytes = block_bytes
        self.address = address
        self.labels = dict(labels or {})
        self.incarnation = uuid.uuid4().hex
        self._used, self._verify, self._on_hints = used, verify, on_hints
        self._list_keys = list_keys
        # A pool with hot-block replication: the heartbeat reply's copies and drops (kvtier.pool does them off
        # this thread; the callback must return at once).
        self._on_replicate = on_replicate
        self._on_prefetch = on_prefetch
        self._goodbye_on_close = goodbye
        self._heartbeat_s = heartbeat_s
        self.batch_interval_s = batch_interval_s
        self.max_batch_keys = max_batch_keys
        self.inventory_part_keys = inventory_part_keys
        self.timeout_s = timeout_s
        self.auth = auth  # CurveZMQ keys for a master started with --auth-dir
        self.alpha = ewma_alpha
        names = {name for name, _ in self.tiers}
        # No mirror where the tiers can list their keys: the agent then holds only what is queued.
        self._mirror: dict[str, set[bytes]] = {name: set() for name in names} if list_keys is None else {}
        for tier, keys in (initial or {}).items() if list_keys is None else ():
            self._mirror[tier].update(keys)
        self._names = names
        self._pending: list[tuple[int, str, list[bytes]]] = []
        self._pending_keys = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread finished a pass with nothing owed to the master
        # Owned by the agent thread from start() on.
        self.seq = 0
        self.registered = False
        self.need_inventory = True
        self.lease_s: float | None = None
        self.hints: MasterHints | None = None
        self._tier_bw: dict[str, float] = {}
        self._path_bw: dict[str, float] = {}
        self._rtt = 0.0
        self.counters = {"registrations": 0, "inventories": 0, "event_messages": 0, "heartbeats": 0,
                         "errors": 0, "dropped_events": 0, "prefetch_orders": 0}
        self.last_error: str | None = None
        self.store_prefetch: StorePrefetch | None = None  # for_store's: its prefetch orders' outcomes

    @classmethod
    def for_store(cls, store: Any, master: str, node_id: str, **kw: Any) -> NodeAgent:
        """An agent for a TieredStore: its tiers, their used bytes, inventory checks against the tiers, and
        the master's hints applied as leases of the store (``StoreHints``; ``hint_max_fraction`` is the lease
        budget the store gets if it has none yet), and the master's prefetch orders made jobs of ``prefetcher``
        (the store's kvtier.prefetch.Prefetcher; None: they are counted ignored; ``StorePrefetch``, kept as the
        agent's ``store_prefetch``). Attaches to the store's events; call ``start()`` next.
        Remote tiers (a PoolTier: blocks in kvtier-pool daemons, which report them themselves) are not the
        node's own."""
        local = store.local_tiers
        by_name = {t.name: t for t in local}
        on_hints = kw.pop("on_hints", None)
        if on_hints is None:
            on_hints = StoreHints(store, hint_max_fraction=kw.pop("hint_max_fraction", 0.5)).apply
        orders = StorePrefetch(kw.pop("prefetcher", None), node_id)
        kw.setdefault("on_prefetch", orders.apply)
        agent = cls(master, node_id, [(t.name, t.stats().capacity_bytes) for t in local],
                    block_bytes=store.block_bytes,
                    used=lambda: {t.name: t.stats().used_bytes for t in local},
                    verify=lambda tier, keys: by_name[tier].contains(keys), on_hints=on_hints, **kw)
        agent.store_prefetch = orders
        store.add_listener(agent.on_event)
        return agent

    # ---- called from any thread ------------------------------------------------------------------------

    def on_event(self, event: Any) -> None:
        """A TieredStore listener: ``event`` is a StoreEvent(kind "stored"/"removed", tier, keys)."""
        kind = wire.ADD if event.kind == "stored" else wire.REMOVE
        with self._cond:
            if event.tier not in self._names:
                return  # a tier the node did not register
            mirror = self._mirror.get(event.tier)
            if mirror is None:
                pass  # inventories come from list_keys
            elif kind == wire.ADD:
                mirror.update(event.keys)
            else:
                mirror.difference_update(event.keys)
            if self._pending_keys + len(event.keys) > MAX_PENDING_KEYS:
                # The master is unreachable for long: forget the queue, the mirror is the truth.
                self.counters["dropped_events"] += len(self._pending)
                self._pending, self._pending_keys = [], 0
                self.need_inventory = True
            else:
                self._pending.append((kind, event.tier, list(event.keys)))
                self._pending_keys += len(event.keys)
            self._cond.notify_all()

    def record_transfer(self, nbytes: int, seconds: float, *, tier: str | None = None,
                        peer: str | None = None) -> None:
        """Fold one real transfer into the bandwidth EWMA of ``tier`` (reads out of it) and/or of the path
        from ``peer`` (bytes it sent here)."""
        if seconds <= 0 or nbytes <= 0:
            return
        bw = nbytes / seconds
        with self._cond:
            for table, name in ((self._tier_bw, tier), (self._path_bw, peer)):
                if name is not None:
                    old = table.get(name)
                    table[name] = bw if old is None else (1 - self.alpha) * old + self.alpha * bw

    # ---- lifetime --------------------------------------------------------------------------------------

    def start(self) -> NodeAgent:
        self._thread = threading.Thread(target=self._run, name=f"kvtier-agent-{self.node_id}", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def wait_synced(self, timeout_s: float = 10.0) -> bool:
        """Block until the master has everything this node holds (registered, no inventory owed, no event
        queued); False on timeout. For tests and orderly start-up."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not (self.registered and not self.need_inventory and not self._pending and self._idle):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    # ---- the agent thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        client = MasterClient(self.master, self.timeout_s, auth=self.auth)
        next_heartbeat = 0.0
        backoff = 0.05
        try:
            while not self._stop.is_set():
                try:
                    if not self.registered:
                        self._register(client)
                        next_heartbeat = 0.0
                    if self.need_inventory:
                        self._send_inventory(client)
                    self._flush_events(client)
                    if time.monotonic() >= next_heartbeat:
                        self._heartbeat(client)
                        next_heartbeat = time.monotonic() + self._heartbeat_interval()
                    backoff = 0.05
                except MasterUnknownNode as e:
                    log.info("node %s: master does not know this node (%s); registering again", self.node_id,
                             e.message)
                    self.registered = False
                    continue
                except Exception as e:  # the master unreachable or refusing, or a bug: never kill the thread
                    self.counters["errors"] += 1
                    if self.last_error != str(e):
                        log.warning("node %s: master %s: %s; retrying", self.node_id, self.master, e,
                                    exc_info=not isinstance(e, MasterError))
                    self.last_error = str(e)
                    self.need_inventory = self.need_inventory or not isinstance(e, MasterError)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, max(0.5, self._heartbeat_interval() / 2))
                    continue
                with self._cond:
                    self._idle = True
                    self._cond.notify_all()
                    wait = next_heartbeat - time.monotonic()
                    if not self._pending and not self.need_inventory and wait > 0:
                        self._cond.wait(wait)
                    self._idle = False
                if self._pending and not self._stop.is_set():
                    self._stop.wait(self.batch_interval_s)  # let a burst of events coalesce into one message
            self._final_flush(client)
            self._goodbye(client)
        finally:
            client.close()

    def _final_flush(self, client: MasterClient) -> None:
        if self.registered and not self.need_inventory:
            try:
                self._flush_events(client)
            except MasterError as e:
                log.info("node %s: last events not delivered at close (%s)", self.node_id, e)

    def _goodbye(self, client: MasterClient) -> None:
        if not (self.registered and self._goodbye_on_close):
            return
        try:
            client.call(api.goodbye(self.node_id, self.incarnation), timeout_s=min(self.timeout_s, 1.0))
            log.info("node %s: said goodbye to master %s", self.node_id, self.master)
        except MasterError as e:  # the lease runs out instead
            log.info("node %s: goodbye not delivered (%s); the master drops it when its lease expires",
                     self.node_id, e)

    def _heartbeat_interval(self) -> float:
        if self._heartbeat_s is not None:
            return self._heartbeat_s
        return (self.lease_s or 3.0) / 3

    def _register(self, client: MasterClient) -> None:
        reply = client.call(api.register(self.node_id, self.incarnation, self.seq, self.tiers, self.address,
                                         self.labels))
        self.registered = True
        self.lease_s = reply.lease_s
        if reply.max_batch_keys:
            self.max_batch_keys = min(self.max_batch_keys, reply.max_batch_keys)
            self.inventory_part_keys = min(self.inventory_part_keys, reply.max_batch_keys)
        self.counters["registrations"] += 1
        with self._cond:
            self.need_inventory = self.need_inventory or reply.resync
        log.info("node %s registered with master %s (lease %.3g s, %s)", self.node_id, self.master,
                 reply.lease_s or 0, "sending inventory" if self.need_inventory else "in sync")

    def _send_inventory(self, client: MasterClient) -> None:
        with self._cond:
            snapshot = {tier: list(keys) for tier, keys in self._mirror.items()}
            self._pending, self._pending_keys = [], 0  # the snapshot already reflects them
            seq = self.seq
            self.need_inventory = False  # set again by any failure below or by an event overflow
        try:
            if self._list_keys is not None:
                # Listed after the queue was cleared, outside our lock (the tiers call on_event under theirs):
                # events in between are both in the listing and queued, and replaying them after it is harmless.
                snapshot = {tier: self._list_keys(tier) for tier in self._names}
            if self._verify is not None:
                snapshot = {t: [k for k, held in zip(keys, self._verify(t, keys)) if held] if keys else []
                            for t, keys in snapshot.items()}
            parts = list(_parts(snapshot, self.inventory_part_keys))
            for i, part in enumerate(parts):
                client.call(api.inventory(self.node_id, self.incarnation, seq, i, i == len(parts) - 1, part,
                                          {t: self.block_bytes for t in part}))
        except BaseException:
            self.need_inventory = True
            raise
        self.counters["inventories"] += 1
        log.info("node %s: inventory of %d keys sent to the master (seq %d, %d parts)", self.node_id,
                 sum(len(k) for k in snapshot.values()), seq, len(parts))

    def _flush_events(self, client: MasterClient) -> None:
        with self._cond:
            batch, self._pending, self._pending_keys = self._pending, [], 0
        for message in _messages(batch, self.max_batch_keys):
            self.seq += 1
            try:
                reply = client.call(api.events(self.node_id, self.incarnation, self.seq,
                                               [(k, t, keys, self.block_bytes) for k, t, keys in message]))
            except MasterError:
                self.need_inventory = True  # applied or not, the master's view is now uncertain
                raise
            self.counters["event_messages"] += 1
            if reply.resync:
                self.need_inventory = True
                return  # the inventory carries everything that is left

    def _heartbeat(self, client: MasterClient) -> None:
        used = dict(self._used()) if self._used is not None else {}
        with self._cond:
            bw, path_bw = dict(self._tier_bw), dict(self._path_bw)
        reply = client.call(api.heartbeat(self.node_id, self.incarnation, self.seq, used, bw, path_bw, self._rtt))
        self._rtt = client.last_rtt_s if not self._rtt else (1 - self.alpha) * self._rtt + self.alpha * client.last_rtt_s
        self.counters["heartbeats"] += 1
        if reply.resync:
            self.need_inventory = True
        if (reply.replicate or reply.drop) and self._on_replicate is not None:
            try:
                self._on_replicate(reply)
            except Exception:
                log.exception("node %s: on_replicate callback failed", self.node_id)
        if reply.prefetch:
            self.counters["prefetch_orders"] += len(reply.prefetch)
            if self._on_prefetch is None:
                log.warning("node %s: %d prefetch orders ignored (this node takes none)", self.node_id,
                            len(reply.prefetch))
            else:
                try:
                    self._on_prefetch(reply.prefetch)
                except Exception:
                    log.exception("node %s: on_prefetch callback failed", self.node_id)
        if reply.hints_version is not None and (self.hints is None or reply.hints_version != self.hints.version):
            hints = client.call(api.hints(-1))
            self.hints = hints
            if self._on_hints is not None:
                try:
                    self._on_hints(hints)
                except Exception:
                    log.exception("node %s: on_hints callback failed", self.node_id)


def _parts(snapshot: Mapping[str, list[bytes]], per_part: int) -> Iterable[dict[str, list[bytes]]]:
    """Split an inventory into parts of at most ``per_part`` keys; the last part (maybe empty) ends it."""
    part: dict[str, list[bytes]] = {}
    size = 0
    for tier, keys in snapshot.items():
        i = 0
        while i < len(keys):
            take = min(per_part - size, len(keys) - i)
            part.setdefault(tier, []).extend(keys[i : i + take])
            i += take
            size += take
            if size == per_part:
                yield part
                part, size = {}, 0
    yield part


def _messages(batch: list[tuple[int, str, list[bytes]]], max_keys: int) -> Iterable[list[tuple[int, str, list[bytes]]]]:
    """Group queued events into messages of at most ``max_keys`` keys, merging runs of the same kind and tier."""
    message: list[tuple[int, str, list[bytes]]] = []
    size = 0
    for kind, tier, keys in batch:
        for i in range(0, len(keys), max_keys):
            chunk = keys[i : i + max_keys]
            if size + len(chunk) > max_keys and message:
                yield message
                message, size = [], 0
            if message and message[-1][0] == kind and message[-1][1] == tier:
                message[-1] = (kind, tier, message[-1][2] + chunk)
            else:
                message.append((kind, tier, chunk))
            size += len(chunk)
    if message:
        yield message
