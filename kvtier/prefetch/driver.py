"""What moves a Prefetcher in a server and shows it: ``PrefetchDriver`` (a thread, real time, demand first) and
``PrefetchCollector`` (its counts for Prometheus). A replay moves it on its virtual clock instead
(kvtier/tools/replay/prefetch.py)."""

from __future__ import annotations

import logging
import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtier.prefetch.prefetcher import COUNTS, Prefetcher

log = logging.getLogger(__name__)


class PrefetchDriver:
    """Moves a Prefetcher's jobs in real time on a thread of its own: every ``tick_s``, unless a demand read is
    under way in the store (``TieredStore.demand_reads``: demand first), each lower tier gets a budget of
    ``share`` of its measured read rate times the tick (``probe_blocks`` until a rate is measured), at most
    ``max_blocks``. ``close`` stops it (at most one step's copies later)."""

    def __init__(self, prefetcher: Prefetcher, *, tick_s: float = 0.05, share: float = 0.5,
                 probe_blocks: int = 16, max_blocks: int = 4096) -> None:
        if not tick_s > 0 or not 0 < share <= 1:
            raise ValueError(f"tick_s must be > 0 and share in (0, 1], got {tick_s}, {share}")
        self.prefetcher, self.tick_s, self.share = prefetcher, tick_s, share
        self.probe_blocks, self.max_blocks = probe_blocks, max_blocks
        self.deferred = 0  # ticks skipped for demand reads
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-prefetch", daemon=True)
        self._thread.start()

    def budget(self) -> dict[str, int]:
        store = self.prefetcher.store
        out = {}
        for tier in store.tiers[1:]:
            rate = self.prefetcher.rates.get(tier.name)
            n = self.probe_blocks if rate is None else int(rate * self.share * self.tick_s / store.block_bytes)
            out[tier.name] = max(1, min(self.max_blocks, n))
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            if not self.prefetcher.pending():
                continue
            if self.prefetcher.store.demand_reads:
                self.deferred += 1
                continue
            try:
                self.prefetcher.step(self.budget())
            except Exception:
                log.exception("prefetch step failed; retrying at the next tick")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class PrefetchCollector(Collector):
    """Prometheus view of a Prefetcher: ``kvtier_prefetch_bytes_total{outcome}`` (prefetched, used, wasted,
    cancelled) and ``kvtier_prefetch_jobs`` (agents waiting for their prefix). Register it in the process's
    registry (``registry.register(PrefetchCollector(p))``)."""

    def __init__(self, prefetcher: Prefetcher) -> None:
        self.prefetcher = prefetcher

    def collect(self):  # type: ignore[no-untyped-def]
        p = self.prefetcher
        bb = p.store.block_bytes
        c = CounterMetricFamily("kvtier_prefetch_bytes", "Bytes of prefetch between turns, by outcome: prefetched "
                                "(copied up into DRAM), used (their agent came back to them), wasted (evicted "
                                "unused), cancelled (left undone: the agent came back first or finished)",
                                labels=["outcome"])
        for outcome in COUNTS:
            c.add_metric([outcome], getattr(p.counts, outcome) * bb)
        yield c
        g = GaugeMetricFamily("kvtier_prefetch_jobs", "Idle agents whose prefix is being brought up")
        g.add_metric([], p.pending())
        yield g
