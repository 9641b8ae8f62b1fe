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

Each channel also keeps its account (``seconds``): the seconds demand loads held it and the seconds the
prefetches' blocks took at its bandwidth. The two never add up to more than the replay's span (a prefetch only
spends time demand left free), and their sum over the span says how close the tier's bandwidth is to its limit:
near 1, prefetch has no time left to move anything, and only fewer bytes read from the tier (more kept in
DRAM, less prefetched in vain) shortens the turns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from kvtier.prefetch import Prefetcher
from kvtier.tools.replay.hbm import HbmPrefixCache
from kvtier.store import TieredStore


class _Channel:
    """One lower tier's read bandwidth on the virtual clock: the demand loads' intervals on it, and the credit
    (in blocks) its free time has earned the prefetches and they have not spent yet."""

    __slots__ = ("bandwidth", "t", "busy", "credit", "demand_s", "prefetch_s")

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self.t = 0.0  # free time is counted up to here
        self.busy: deque[tuple[float, float]] = deque()  # demand loads' (start, end), in start order
        self.credit = 0.0
        self.demand_s = 0.0  # seconds demand loads held the channel
        self.prefetch_s = 0.0  # seconds the prefetches' blocks took

    def free(self, now: float) -> float:
        """Seconds in [t, now] no demand load held the channel (t moves to now)."""
        t0, busy = self.t, self.busy
        held = 0.0
        while busy and busy[0][1] <= t0:
            busy.popleft()
        for start, end in busy:
            if start >= now:
                break
            held += min(end, now) - max(start, t0)
        self.t = max(t0, now)
        return max(0.0, now - t0 - held)


class ReplayPrefetch:
    """Drives a Prefetcher over ``store`` on the replay's virtual clock. ``bandwidth``: bytes/s per lower
    tier; ``block_bytes``: the real block size (the store's are stand-ins)."""

    def __init__(self, store: TieredStore, bandwidth: Mapping[str, float], block_bytes: int,
                 hbm: HbmPrefixCache | None = None) -> None:
        # The engine knows what its HBM holds: a chain's prefix there needs no prefetch.
        self.prefetcher = Prefetcher(store, resident=hbm.prefix if hbm is not None else None)
        self.block_bytes = block_bytes
        self.channels = {t.name: _Channel(bandwidth[t.name]) for t in store.tiers[1:]}

    def demand(self, tier: str, start: float, seconds: float) -> None:
        """A demand load holds ``tier``'s channel for ``seconds`` from ``start`` (the link's order: starts
        never go back)."""
        ch = self.channels.get(tier)
        if ch is not None and seconds > 0:
            ch.busy.append((start, start + seconds))
            ch.demand_s += seconds

    def advance(self, now: float) -> None:
        """Spend the channels' free time up to ``now`` on the prefetcher's jobs: what a channel's credit does
        not buy (no job, or no room in DRAM) is lost, idle time is never banked."""
        budget: dict[str, int] = {}
        for name, ch in self.channels.items():
            ch.credit += ch.free(now) * ch.bandwidth / self.block_bytes
            budget[name] = int(ch.credit)
        moved = self.prefetcher.step(budget) if self.prefetcher.pending() else {}
        for name, ch in self.channels.items():
            n = moved.get(name, 0)
            ch.credit = ch.credit - n if n >= budget[name] else 0.0
            ch.prefetch_s += n * self.block_bytes / ch.bandwidth

    def seconds(self) -> dict[str, dict[str, float]]:
        """Per lower tier: the seconds demand loads held its channel and the seconds the prefetches took."""
        return {name: {"demand": ch.demand_s, "prefetch": ch.prefetch_s} for name, ch in self.channels.items()}
