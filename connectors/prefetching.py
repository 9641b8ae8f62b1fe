"""Prefetch between turns in an engine's worker store (a vLLM worker's, connectors/vllm/worker.py; an SGLang rank's
HiCache backend's, connectors/sglang/backend.py): the store runs a Prefetcher (kvtier/prefetch/) moved by a
PrefetchDriver thread, where a tier sits below DRAM (an SSD, a pool) and the connector's ``prefetch`` key is on
(the default). One class for both engines: what differs is only how the store hears of requests.

The Prefetcher learns which agents are idle from what the store is told (``TieredStore.observe``: the arrivals,
completions and hints the policies see; vLLM's scheduler notes, observe.py; SGLang's request hooks, sglang/hints.py),
so an agent's prefix comes up from the SSD or a pool while it thinks, with no hint; a standard ``Prefetch`` hint
(kv_hints) asks it explicitly (``Prefetcher.request``). Started after the store, stopped before it closes (the
driver's last copies finish first). Its counts reach the connector's stats as deltas since the last
``take_counters`` (vLLM sums them over ranks and logs them; SGLang's backend returns them in ``stats()``):
``prefetch_blocks`` (copied up), ``prefetch_used_blocks`` (their agent came back to them on top),
``prefetch_wasted_blocks`` (evicted from DRAM unused), ``prefetch_cancelled_blocks`` (left below: the agent came
back first or finished), and per lower tier ``prefetch_from_<tier>_blocks``.
"""

from __future__ import annotations

from kvtier.prefetch import COUNTS, PrefetchCounts, PrefetchDriver, Prefetcher
from kvtier.store import TieredStore
from kvtier.tiers.base import PrefetchTarget


class WorkerPrefetch:
    """A worker store's Prefetcher and its driver thread. ``for_store`` decides whether the store gets one."""

    def __init__(self, store: TieredStore) -> None:
        self.prefetcher = Prefetcher(store)
        self.driver = PrefetchDriver(self.prefetcher)
        self._taken = PrefetchCounts()  # the counts at the last take_counters

    @classmethod
    def for_store(cls, store: TieredStore, enabled: bool) -> WorkerPrefetch | None:
        """A running WorkerPrefetch if ``enabled`` and a tier sits below a top tier a prefetch can fill (DRAM);
        None otherwise (DRAM alone: nothing below to bring up)."""
        if not enabled or len(store.tiers) < 2 or not isinstance(store.tiers[0], PrefetchTarget):
            return None
        return cls(store)

    def take_counters(self) -> dict[str, int]:
        """The prefetch counts since the last call (blocks), named as in the module docstring."""
        now, last = self.prefetcher.counts, self._taken
        out = {}
        for name in COUNTS:
            key = "prefetch_blocks" if name == "prefetched" else f"prefetch_{name}_blocks"
            out[key] = getattr(now, name) - getattr(last, name)
        for tier, n in now.from_tier.items():
            out[f"prefetch_from_{tier}_blocks"] = n - last.from_tier.get(tier, 0)
        self._taken = PrefetchCounts(*(getattr(now, name) for name in COUNTS), dict(now.from_tier))
        return out

    def close(self) -> None:
        self.driver.close()
