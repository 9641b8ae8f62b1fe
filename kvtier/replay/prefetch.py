"""The replay's model of prefetch between turns: a real Prefetcher (kvtier/prefetch.py) over the replay's store,
moved along on the virtual clock at each lower tier's bandwidth, demand first.

Each lower tier (SSD, pool) is one channel at its load bandwidth (the service model's). A demand load from a
tier holds its channel until the load is done; the prefetches from that tier use only the time its channel is
not held (demand first: a demand load is never slowed by a prefetch). At every event of the replay, before it
is handled, the time each channel was free since the last event becomes a budget of blocks
(``free seconds * bandwidth / block bytes``, real block bytes), and the Prefetcher moves that many at most; a
channel it leaves idle (no job, or no room in DRAM) loses that time, it is not banked. Blocks brought up are in
DRAM from that event on, so a request sees what finished before it arrived, and what is still on its way is
loaded as usual.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtier.prefetch import Prefetcher
from kvtier.replay.hbm import HbmPrefixCache
from kvtier.store import TieredStore


class _Channel:
    __slots__ = ("bandwidth", "t", "demand_until")

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self.t = 0.0  # the channel's prefetch traffic is done up to here
        self.demand_until = 0.0  # demand loads hold the channel until here


class ReplayPrefetch:
    """Drives a Prefetcher over ``store`` on the replay's virtual clock. ``bandwidth``: bytes/s per lower
    tier; ``block_bytes``: the real block size (the store's are stand-ins)."""

    def __init__(self, store: TieredStore, bandwidth: Mapping[str, float], block_bytes: int,
                 hbm: HbmPrefixCache | None = None) -> None:
        # The engine knows what its HBM holds: a chain's prefix there needs no prefetch.
        self.prefetcher = Prefetcher(store, resident=hbm.prefix if hbm is not None else None)
        self.block_bytes = block_bytes
        self.channels = {t.name: _Channel(bandwidth[t.name]) for t in store.tiers[1:]}
        self.bytes_moved = 0

    def demand(self, tier: str, until: float) -> None:
        """A demand load from ``tier`` holds its channel until ``until``."""
        ch = self.channels.get(tier)
        if ch is not None and until > ch.demand_until:
            ch.demand_until = until

    def advance(self, now: float) -> None:
        """Spend the channels' free time up to ``now`` on the prefetcher's jobs."""
        budget: dict[str, int] = {}
        starts: dict[str, float] = {}
        for name, ch in self.channels.items():
            start = max(ch.t, ch.demand_until)
            starts[name] = start
            if now > start:
                budget[name] = int((now - start) * ch.bandwidth / self.block_bytes)
        moved = self.prefetcher.step(budget) if budget and self.prefetcher.pending() else {}
        for name, ch in self.channels.items():
            n = moved.get(name, 0)
            if n and n >= budget.get(name, 0):  # busy the whole interval: the remainder carries over
                ch.t = starts[name] + n * self.block_bytes / ch.bandwidth
            else:  # idle for part of it (no job, or no room): that time is gone
                ch.t = max(now, starts[name]) if now > starts[name] else ch.t
            self.bytes_moved += n * self.block_bytes
