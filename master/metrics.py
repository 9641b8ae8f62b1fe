"""Prometheus metrics of the master (prometheus_client, served on ``--metrics-port``).

Requests per op and status (rates come from ``rate(kvtier_master_requests_total[1m])``), latency histograms
per op, keys per op, nodes per state, directory size and memory, and per node and tier: capacity, used bytes,
utilization, measured bandwidth, plus per node RPC latency and resyncs. Op labels are only the known op
names ("unknown" otherwise): a client must not be able to blow up label cardinality.

Updated from the master's event loop; the metrics port's own thread serves them (kvtier/daemon/metrics_http.py:
bounded connections and deadlines; prometheus_client's metric objects are thread-safe).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier import wire
from kvtier.auth.gate import REASONS as GATE_REASONS
from kvtier.daemon.metrics_http import REASONS as HTTP_REASONS
from kvtier.daemon.metrics_http import MetricsServer

KNOWN_OPS = frozenset({
    wire.PING, wire.LOOKUP, wire.COST, wire.ROUTE_PUT, wire.HEAT, wire.TOP, wire.NODES, wire.PIN, wire.UNPIN,
    wire.PRIORITY, wire.HINTS, wire.LOCATE, wire.FORGET, wire.REGISTER, wire.HEARTBEAT, wire.EVENTS,
    wire.INVENTORY, wire.GOODBYE,
})
STALENESS_BUCKETS = (100e-6, 250e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 100e-3, 0.5, 2.0, 10.0)
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0)


class MasterMetrics:
    """The master's metric objects in their own registry (several masters can live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvtier_master_requests", "Requests served, by op and status (ok or an error "
                                "code)", ["op", "status"], registry=r)
        self.latency = Histogram("kvtier_master_request_seconds", "Time to serve a request inside the master, "
                                 "by op", ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.keys = Counter("kvtier_master_request_keys", "Keys carried by requests, by op", ["op"], registry=r)
        self.nodes = Gauge("kvtier_master_nodes", "Nodes by state (live, syncing, pending, dead)", ["state"],
                           registry=r)
        self.entries = Gauge("kvtier_master_directory_keys", "Keys in the directory (held by >= 1 location)",
                             registry=r)
        self.directory_bytes = Gauge("kvtier_master_directory_bytes", "Bytes of the directory's arrays",
                                     registry=r)
        self.hints = Gauge("kvtier_master_hints", "Pins and priorities kept (keys and sessions)", registry=r)
        self.node_capacity = Gauge("kvtier_master_node_capacity_bytes", "Tier capacity a node registered",
                                   ["node", "tier"], registry=r)
        self.node_used = Gauge("kvtier_master_node_used_bytes", "Tier bytes in use (last heartbeat)",
                               ["node", "tier"], registry=r)
        self.node_utilization = Gauge("kvtier_master_node_utilization", "Used / capacity per node tier",
                                      ["node", "tier"], registry=r)
        self.node_bandwidth = Gauge("kvtier_master_node_bandwidth_bytes_per_second", "Measured transfer "
                                    "bandwidth (EWMA) per node tier", ["node", "tier"], registry=r)
        self.node_rpc_latency = Gauge("kvtier_master_node_rpc_latency_seconds", "Measured RPC latency (EWMA) "
                                      "per node", ["node"], registry=r)
        self.resyncs = Counter("kvtier_master_node_resyncs", "Full inventories started, per node", ["node"],
                               registry=r)
        self.lease_expiries = Counter("kvtier_master_lease_expiries", "Nodes declared dead for silence",
                                      registry=r)
        self.replies_dropped = Counter("kvtier_master_replies_dropped", "Replies not sent, by reason: the client's "
                                       "queue was full (not reading), it was gone, or the unsent-reply budget was "
                                       "spent (the client got a short 'busy' error instead)", ["reason"],
                                       registry=r)
        self.unsent_reply_bytes = Gauge("kvtier_master_unsent_reply_bytes", "Bytes of large replies zmq has not "
                                        "sent yet (bounded by --reply-budget)", registry=r)
        # Shared directory (--directory redis://): master/shared.py.
        self.backend_state = Gauge("kvtier_master_backend_state", "1 for the shared directory's current state: ok, "
                                   "read_only (redis unreachable: reads served, writes refused), catching_up "
                                   "(reloading), starting", ["state"], registry=r)
        self.log_entries = Counter("kvtier_master_log_entries", "Shared log entries applied, by origin (self: "
                                   "appended by this master)", ["origin"], registry=r)
        self.log_staleness = Histogram("kvtier_master_log_staleness_seconds", "From another master accepting a "
                                       "write to this master applying it", buckets=STALENESS_BUCKETS, registry=r)
        self.log_append_seconds = Histogram("kvtier_master_log_append_seconds", "One append of queued writes to "
                                            "the shared log", buckets=STALENESS_BUCKETS, registry=r)
        self.read_only = Counter("kvtier_master_read_only", "Times the shared directory became read-only (redis "
                                 "unreachable)", registry=r)
        self.reloads = Counter("kvtier_master_reloads", "Reloads of the shared directory from its snapshot "
                               "(a gap, redis restarted behind this master, a new epoch)", registry=r)
        self.snapshots = Counter("kvtier_master_snapshots", "Shared snapshots this master wrote", registry=r)
        # One family for every door, as the pool's: port="zmq" the request socket's gate (kvtier/auth: a CurveZMQ
        # key not admitted, a wrong or missing owner token, closed in the handshake), port="metrics" the HTTP port.
        self.refused = Counter("kvtier_master_refused_connections", "Connections closed or refused, by port and "
                               "reason (zmq: key_not_authorized, handshake_failed, wrong_owner_token, "
                               "no_owner_token, other_uid_on_ipc, closed_in_handshake; metrics: the HTTP port's limits)",
                               ["port", "reason"], registry=r)
        # Every reason's series from the start: rate() sees the first refusal.
        for reason in GATE_REASONS.values():
            self.refused.labels("zmq", reason)
        for reason in HTTP_REASONS:
            self.refused.labels("metrics", reason)
        self.http = MetricsServer(r, lambda reason: self.refused.labels("metrics", reason).inc(),
                                  logging.getLogger("kvtier.master"))
        self.directory_losses = Counter("kvtier_master_directory_losses", "Times this master found the shared "
                                        "directory had lost writes it applied, so a new epoch began and every node "
                                        "resyncs, by what it found: empty (redis holds no epoch: restarted without "
                                        "its data, or flushed), behind (redis's log counter behind this master), "
                                        "rewritten (the log entry it applied last gone or another)", ["found"],
                                        registry=r)
        self.prefetches = Counter("kvtier_master_prefetches", "Prefetch orders (master/prefetch.py), by outcome: "
                                  "accepted, clipped, ignored (already in the node's top tier), rejected, "
                                  "delivered (in a node's heartbeat reply), expired (not collected in time)",
                                  ["outcome"], registry=r)
        for outcome in ("accepted", "clipped", "ignored", "rejected", "delivered", "expired"):
            self.prefetches.labels(outcome)  # every series from the start: rate() sees the first one
        self._children: dict[tuple[str, str], tuple[object, object, object]] = {}

    def refused_connections(self, counter: str) -> None:
        """A connection refused by the gate (kvtier/auth), from its ZAP or monitor thread: ``counter`` is the
        gate's counter name, labelled as the pool labels it (kvtier.auth.gate.REASONS)."""
        # .get: a counter a gate adds before the table names it is still counted (under its own name), never
        # an exception in the ZAP thread.
        self.refused.labels("zmq", GATE_REASONS.get(counter, counter)).inc()

    def observe(self, op: str, status: str, seconds: float, nkeys: int) -> None:
        label = op if op in KNOWN_OPS else "unknown"
        child = self._children.get((label, status))
        if child is None:
            child = (self.requests.labels(label, status), self.latency.labels(label), self.keys.labels(label))
            self._children[(label, status)] = child
        req, lat, keys = child
        req.inc()  # type: ignore[attr-defined]
        lat.observe(seconds)  # type: ignore[attr-defined]
        if nkeys:
            keys.inc(nkeys)  # type: ignore[attr-defined]

    def node_tier(self, node: str, tier: str, capacity: int, used: int, bw: float) -> None:
        self.node_capacity.labels(node, tier).set(capacity)
        self.node_used.labels(node, tier).set(used)
        self.node_utilization.labels(node, tier).set(used / capacity if capacity else 0.0)
        self.node_bandwidth.labels(node, tier).set(bw)

    def forget_node(self, node: str, tiers: list[str]) -> None:
        """A forgotten node's series go (a churn of node ids must not grow the metrics without bound)."""
        for tier in tiers:
            for g in (self.node_capacity, self.node_used, self.node_utilization, self.node_bandwidth):
                try:
                    g.remove(node, tier)
                except KeyError:
                    pass
        for g in (self.node_rpc_latency, self.resyncs):
            try:
                g.remove(node)
            except KeyError:
                pass

    def serve(self, port: int, host: str) -> int:
        """Start the HTTP endpoint; returns the port it bound (``port`` 0 picks a free one)."""
        return self.http.start(host, port)

    def close(self) -> None:
        self.http.close()
