"""Prometheus metrics of a kvtier-pool (prometheus_client, served on ``--metrics-port``, loopback by default).

Requests are counted as they are served (per op and status; op labels only the known op names, so a client
cannot blow up the label cardinality) with a latency histogram per op. Everything else is read from the
pool's state when Prometheus scrapes (a collector): bytes in and out per path, slots used / free / held by
clients, evictions, hits and misses, connections per port and stage, refused connections per reason, the
memory and held budgets, leases, requests waiting in the dispatcher, errors per code. The metrics table of
docs/pool.md "Node pool and remote DRAM: kvtier-pool" lists every name.

Thread-safe: the workers observe requests, the metrics port's thread (kvtier/daemon/metrics_http.py: bounded
connections and deadlines, its refusals counted here with port="metrics") collects.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtier.auth.gate import REASONS as GATE_REASONS
from kvtier.daemon.metrics_http import REASONS as HTTP_REASONS
from kvtier.daemon.metrics_http import MetricsServer
from kvtier.pool.ops import OPS
from kvtier.pool.replicas import REFUSALS
from kvtier.pool.state import PoolState

LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0)
# (counter in PoolState.counters, port label, reason label); the gate's own as the master labels them.
REFUSED = (
    *((name, "zmq", reason) for name, reason in GATE_REASONS.items()),
    ("zmq_handshake_timeouts", "zmq", "handshake_timeout"), ("zmq_accept_failed", "zmq", "accept_failed"),
    ("stream_refused", "stream", "all_busy"), ("stream_pending_dropped", "stream", "pending_full"),
    ("stream_pending_timeouts", "stream", "handshake_timeout"), ("stream_auth_refused", "stream", "bad_token"),
    ("stream_idle_closed", "stream", "idle_made_room"), ("stream_overdue", "stream", "message_deadline"),
    *((f"metrics_{reason}", "metrics", reason) for reason in HTTP_REASONS),
)
BYTES = (("bytes_in_zmq", "in", "zmq"), ("bytes_in_stream", "in", "stream"), ("bytes_in_onesided", "in", "onesided"),
         ("bytes_out_zmq", "out", "zmq"), ("bytes_out_stream", "out", "stream"),
         ("bytes_out_onesided", "out", "onesided"))


class PoolMetrics:
    """The pool's metric objects in their own registry (several pools can live in one test process)."""

    def __init__(self, state: PoolState, zmq_port: Any = None, stream: Any = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvtier_pool_requests", "Requests served, by op and status (ok or an error code)",
                                ["op", "status"], registry=self.registry)
        self.latency = Histogram("kvtier_pool_request_seconds", "Time to serve a zmq request inside the pool, by "
                                 "op", ["op"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.http = MetricsServer(self.registry, lambda reason: state.count(**{f"metrics_{reason}": 1}),
                                  logging.getLogger("kvtier.pool"))
        self.registry.register(_StateCollector(state, zmq_port, stream, self.http))
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def observe(self, op: str, status: str, seconds: float) -> None:
        label = op if op in OPS else "unknown"
        child = self._children.get((label, status))
        if child is None:
            child = self._children[(label, status)] = (self.requests.labels(label, status), self.latency.labels(label))
        child[0].inc()
        child[1].observe(seconds)

    def serve(self, port: int, host: str) -> int:
        """Start the HTTP endpoint; the port it bound (``port`` 0 picks a free one)."""
        return self.http.start(host, port)

    def close(self) -> None:
        self.http.close()


class _StateCollector(Collector):
    def __init__(self, state: PoolState, zmq_port: Any, stream: Any, http: MetricsServer) -> None:
        self.state, self.zmq_port, self.stream, self.http = state, zmq_port, stream, http

    def collect(self) -> Iterator[Any]:
        st = self.state
        with st._lock:  # noqa: SLF001 - one consistent snapshot of the counters
            c = dict(st.counters)
        tier = st.tier
        ts = tier.stats() if tier is not None else None
        bb = tier.block_bytes if tier is not None else 0

        b = CounterMetricFamily("kvtier_pool_bytes", "Block bytes moved, by direction (in: stored, out: read) and "
                                "path (zmq frames, the stream data port, one-sided shm/rdma copies)",
                                labels=["direction", "path"])
        for name, direction, path in BYTES:
            b.add_metric([direction, path], c.get(name, 0))
        yield b
        g = CounterMetricFamily("kvtier_pool_get_blocks", "Blocks asked for by gets, by result", labels=["result"])
        g.add_metric(["hit"], c.get("get_hits", 0))
        g.add_metric(["miss"], c.get("get_misses", 0))
        yield g
        yield CounterMetricFamily("kvtier_pool_located_reads", "Blocks one-sided clients read where they had seen "
                                  "them last, without an acquire (proven by slot generations; among the hits)",
                                  value=c.get("located_reads", 0))
        yield CounterMetricFamily("kvtier_pool_put_blocks", "Blocks stored", value=c.get("put_blocks", 0))
        yield CounterMetricFamily("kvtier_pool_evictions", "Blocks evicted to make room",
                                  value=ts.evictions if ts else 0)

        slots = GaugeMetricFamily("kvtier_pool_slots", "DRAM slots: used (holding a block or being written), free, "
                                  "held (by clients' leases and replies in flight; a subset of used)",
                                  labels=["state"])
        total = tier.capacity_bytes // bb if tier is not None else 0
        used = ts.used_bytes // bb if ts is not None and bb else 0
        slots.add_metric(["used"], used)
        slots.add_metric(["free"], total - used)
        slots.add_metric(["held"], min(used, st.held.used // bb) if bb else 0)
        yield slots
        yield GaugeMetricFamily("kvtier_pool_capacity_bytes", "DRAM served",
                                value=tier.capacity_bytes if tier is not None else st.settings.capacity)
        yield GaugeMetricFamily("kvtier_pool_block_bytes", "Block size (0: not set yet)", value=bb)

        conns = GaugeMetricFamily("kvtier_pool_connections", "Client connections open, by port and stage (zmq: "
                                  "open, handshaking; stream: admitted, pending; metrics: reading, answering)",
                                  labels=["port", "stage"])
        if self.zmq_port is not None:
            conns.add_metric(["zmq", "open"], self.zmq_port.open)
            conns.add_metric(["zmq", "handshaking"], self.zmq_port.handshaking)
        if self.stream is not None:
            conns.add_metric(["stream", "admitted"], self.stream.admitted)
            conns.add_metric(["stream", "pending"], self.stream.pending)
        answering = self.http.answering
        conns.add_metric(["metrics", "reading"], self.http.open - answering)
        conns.add_metric(["metrics", "answering"], answering)
        yield conns
        yield GaugeMetricFamily("kvtier_pool_clients", "Client accounts (a key, an address or a local process) "
                                "holding memory or slots now", value=max(st.memory.accounts(), st.held.accounts()))
        refused = CounterMetricFamily("kvtier_pool_refused_connections", "Connections closed or refused, by port "
                                      "and reason", labels=["port", "reason"])
        for name, port, reason in REFUSED:
            refused.add_metric([port, reason], c.get(name, 0))
        yield refused

        for budget, what in ((st.memory, "memory beyond the capacity for clients' requests and replies (staging)"),
                             (st.held, "DRAM clients hold unevictable (leases, replies in flight)")):
            gb = GaugeMetricFamily(f"kvtier_pool_{budget.name}_bytes", f"Bytes of {what}, by kind",
                                   labels=["kind"])
            gb.add_metric(["used"], budget.used)
            gb.add_metric(["peak"], budget.peak)
            gb.add_metric(["limit"], budget.limit)
            gb.add_metric(["per_client_limit"], budget.per_account)
            yield gb
        yield CounterMetricFamily("kvtier_pool_busy_refused", "Requests answered busy (too much waiting from one "
                                  "client or all)", value=c.get("busy_refused", 0))
        dropped = CounterMetricFamily("kvtier_pool_replies_dropped", "Replies not delivered: the client's connection "
                                      "held too many unread (not_reading: a call waiting on one timed out), the "
                                      "client was gone, or the send failed (error)", labels=["reason"])
        for reason in ("not_reading", "gone", "error"):
            dropped.add_metric([reason], c.get(f"replies_dropped_{reason}", 0))
        yield dropped
        yield CounterMetricFamily("kvtier_pool_quota_refused_blocks", "Blocks not reserved or acquired: past the "
                                  "client's share of the held budget", value=c.get("quota_refused_blocks", 0))
        waiting = st.dispatcher.queued if st.dispatcher is not None else 0
        yield GaugeMetricFamily("kvtier_pool_requests_waiting", "Requests queued in the dispatcher", value=waiting)

        leases = GaugeMetricFamily("kvtier_pool_leases", "One-sided leases, by state", labels=["state"])
        q = st.leases.quarantined
        leases.add_metric(["live"], len(st.leases) - q)
        leases.add_metric(["quarantined"], q)
        yield leases
        yield CounterMetricFamily("kvtier_pool_lease_expiries", "Leases not returned within --lease-s",
                                  value=st.leases.expired)
        yield CounterMetricFamily("kvtier_pool_foreign_lease_ops", "Commits/releases naming another client's lease",
                                  value=st.leases.foreign)
        copies = CounterMetricFamily("kvtier_pool_copies_refused", "Pool-to-pool copies refused (copy_from or the "
                                     "master's work), by reason: not_cluster, bad_source, wrong_node",
                                     labels=["reason"])
        for reason in REFUSALS:
            copies.add_metric([reason], c.get("copy_refused_" + reason, 0))
        yield copies
        errors = CounterMetricFamily("kvtier_pool_errors", "Requests refused with an error, by code", labels=["code"])
        for name, n in sorted(c.items()):
            if name.startswith("error_"):
                errors.add_metric([name[len("error_"):]], n)
        yield errors
