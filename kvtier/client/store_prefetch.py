"""StorePrefetch: the master's prefetch orders (master/prefetch.py) applied to a node's store.

A router or an operator asks the master (``MasterClient.prefetch``, ``Router.prefetch``, ``kvtier prefetch``) that
the node which will serve a prompt bring the prompt's prefix up into its top tier; the node's NodeAgent collects
the order in its next heartbeat reply and calls ``apply`` on its own thread. Each order becomes an explicit job of
the store's Prefetcher (kvtier/prefetch/): ``Prefetcher.request`` for keys, ``request_session`` for a session
named alone. The Prefetcher copies from wherever the store reaches the blocks (its SSD, a pool through its pool
tier), within the room the top tier's policy grants and the bandwidth its driver leaves after demand loads.

Outcomes, counted (``kvtier_prefetch_orders_total{outcome}``; ``PrefetchOrdersCollector``) and logged (refusals
rate-limited): ``started`` (a job was made), ``unknown_session`` (a session this store has not seen), ``ignored``
(the store has no prefetcher). What the jobs then move is the Prefetcher's own count
(``kvtier_prefetch_bytes_total{outcome}``). Bounded: the master sends at most 64 orders per node per heartbeat,
and the Prefetcher keeps at most its ``max_jobs``. Thread-safe enough for one agent thread (counts under a lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvtier.client.api import PrefetchOrder
from kvtier.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from kvtier.prefetch import Prefetcher

log = logging.getLogger(__name__)
_refusals = RateLimitedLog(log, 1.0)
ORDER_OUTCOMES = ("started", "unknown_session", "ignored")


class StorePrefetch:
    """``apply`` is a NodeAgent's ``on_prefetch``. ``prefetcher``: the store's (None: every order is ignored)."""

    def __init__(self, prefetcher: Prefetcher | None, node: str = "") -> None:
        self.prefetcher = prefetcher
        self.node = node
        self.counts = dict.fromkeys(ORDER_OUTCOMES, 0)
        self._lock = threading.Lock()

    def apply(self, orders: Sequence[PrefetchOrder]) -> None:
        for order in orders:
            outcome, why = self._one(order)
            with self._lock:
                self.counts[outcome] += 1
            if outcome == "started":
                log.info("node %s: prefetch of session %r: %s", self.node, order.session, why)
            else:
                _refusals(outcome, logging.WARNING, "node %s: prefetch order for session %r %s: %s", self.node,
                          order.session, outcome, why)

    def _one(self, order: PrefetchOrder) -> tuple[str, str]:
        pf = self.prefetcher
        if pf is None:
            return "ignored", "this node's store has no prefetcher"
        if order.keys:
            pf.request(order.session, order.keys)
            return "started", f"{len(order.keys)} keys to bring up"
        if pf.request_session(order.session):
            return "started", "its last prefix to bring up"
        return "unknown_session", "this store has seen no request of that session (or forgot it)"


class PrefetchOrdersCollector(Collector):
    """Prometheus view of a StorePrefetch: ``kvtier_prefetch_orders_total{outcome}``."""

    def __init__(self, orders: StorePrefetch) -> None:
        self.orders = orders

    def collect(self):  # type: ignore[no-untyped-def]
        c = CounterMetricFamily("kvtier_prefetch_orders", "Prefetch orders this node got from the master, by "
                                "outcome: started (a prefetch job was made), unknown_session (a session the store "
                                "has not seen), ignored (the store has no prefetcher)", labels=["outcome"])
        with self.orders._lock:
            counts = dict(self.orders.counts)
        for outcome in ORDER_OUTCOMES:
            c.add_metric([outcome], counts[outcome])
        yield c
