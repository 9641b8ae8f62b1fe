"""Prefetch between turns: bring an idle agent's prefix up into the top tier (DRAM) before it comes back.

An agent's next turn arrives seconds after its tool call ends, and re-reads its whole context. When that context
sits below DRAM (SSD, a pool), the turn waits for it on its critical path. The Prefetcher watches what the store
is told (``TieredStore.add_watcher``: arrivals, completions, hints, sessions resolved) and keeps one job per
idle agent: its chain (the keys of its last request, root first, and those its completion added). ``step`` moves
jobs along, soonest predicted back first (the top tier's policy predicts: ``PrefetchTarget.predicted_back``;
an agent it does not expect back gets nothing), within a budget of blocks per lower tier that the caller gives
(what that tier's bandwidth leaves after demand loads: demand first) and the room the top tier's policy grants
(``prefetch_room``: never evicting a block predicted to be needed sooner). The copies are the store's
(``TieredStore.bring_up``, through the promotion path): a block a demand read brings up meanwhile is written once,
and one that went before it was read is skipped, so a prefetch that lost the race is a normal load.

A job whose chain is up is parked, not ended: its agent may think for a minute, and the top tier may evict
the chain meanwhile (its policy evicts the agent predicted back last first). When the top tier evicts a block of
a parked chain, the job is queued again, so the chain comes back up before its agent does (on the standard
agentic slice 1,717 jobs had ended up while a third of the SSD's hits went to agents idle 32-61 s). A job
ends when the agent comes back (an arrival: what it had not reached is counted cancelled), or when a hint says
the agent is finished. ``request`` is the explicit form (an operator or a
router: the SDK's prefetch call, kvtier/client/store_prefetch.py; ``request_session`` when it names only the agent).
Counted, in blocks: ``prefetched`` (copied up), ``used`` (the agent came back
to them while they were on top), ``wasted`` (evicted from the top tier unused), ``cancelled`` (left undone when
a job ended early: the rest of its prefix still below the top tier then).

In a server the Prefetcher is moved by a PrefetchDriver (driver.py; a thread: every ``tick_s`` each lower tier's
budget is its read rate measured on the prefetches' own copies times the tick, and nothing moves while a demand
read is under way in the store: demand first); in a replay by the virtual clock (kvtier/tools/replay/prefetch.py).
PrefetchCollector (driver.py) exposes the counts to Prometheus, in bytes.

Bounded: at most ``max_jobs`` jobs, and ``max_jobs`` parked holding ``max_parked_keys`` keys in all (jobs.py
ParkedJobs: an index from each key to its parked chains, ~56 bytes a key: ~110 MiB at the default; the oldest
dropped first), and ``max_chains`` remembered chains (least recently seen forgotten), and ``max_tracked``
prefetched keys waiting to be used (oldest forgotten).
Thread-safe (one lock; the store calls run outside it only for the copies).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.policies import Observations
from kvtier.prefetch.jobs import Job, ParkedJobs
from kvtier.store import TieredStore
from kvtier.store.types import StoreEvent
from kvtier.tiers.base import PrefetchTarget


COUNTS = ("prefetched", "used", "wasted", "cancelled")


@dataclass
class PrefetchCounts:
    """Blocks prefetched, used, wasted and cancelled so far, and per lower tier how many came from it."""

    prefetched: int = 0
    used: int = 0
    wasted: int = 0
    cancelled: int = 0
    from_tier: dict[str, int] = field(default_factory=dict)


class Prefetcher:
    """See the module docstring. ``store``'s top tier must be a PrefetchTarget (else nothing is ever moved)."""

    def __init__(self, store: TieredStore, *, max_jobs: int = 1024, max_chains: int = 1 << 14,
                 max_tracked: int = 1 << 18, max_parked_keys: int = 1 << 21,
                 resident: Callable[[Sequence[bytes]], int] | None = None) -> None:
        self.store = store
        # How many leading keys of a chain the engine holds above the store (its GPU prefix cache): those need
        # no prefetch. None: the store cannot tell, all of the chain is a candidate.
        self.resident = resident
        self.top = store.tiers[0] if isinstance(store.tiers[0], PrefetchTarget) else None
        self.max_jobs, self.max_chains, self.max_tracked = max_jobs, max_chains, max_tracked
        self.max_parked_keys = max_parked_keys
        self.counts = PrefetchCounts()
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._parked = ParkedJobs()  # chains up, watched until their agent is back
        self._chains: OrderedDict[str, list[bytes]] = OrderedDict()  # session -> its last chain
        self._inflight: dict[str, int] = {}  # session -> requests in flight
        self._requests: OrderedDict[str, str] = OrderedDict()  # request -> session, for completions
        self._brought: OrderedDict[bytes, None] = OrderedDict()  # prefetched, not used or evicted yet
        self._dropped: list[Job] = []  # jobs ended early, their undone part not counted yet (_settle)
        self._top_name = store.tiers[0].name
        self.rates: dict[str, float] = {}  # bytes/s read per lower tier, measured on the prefetches' copies
        store.add_watcher(self.observe)
        store.add_listener(self._on_event)

    # ---- what the store is told --------------------------------------------------------------------------

    def observe(self, batch: Observations) -> None:
        with self._lock:
            for a in batch.arrivals:
                if a.session is None:
                    continue
                self._cancel(a.session)
                self._used(a.keys)
                self._inflight[a.session] = self._inflight.get(a.session, 0) + 1
                chains = self._chains
                chains[a.session] = list(a.keys)
                chains.move_to_end(a.session)
                while len(chains) > self.max_chains:
                    gone, _ = chains.popitem(last=False)
                    self._inflight.pop(gone, None)
                self._requests[a.request] = a.session
                while len(self._requests) > self.max_chains:
                    self._requests.popitem(last=False)
            for c in batch.completions:
                session = c.session or self._requests.get(c.request)
                self._requests.pop(c.request, None)
                if session is None or session not in self._chains:
                    continue
                left = self._inflight.get(session, 1) - 1
                self._inflight[session] = max(0, left)
                chain = self._chains[session]
                if c.keys:
                    chain.extend(c.keys)
                if left <= 0:
                    self._enqueue(Job(session, chain))
            for h in batch.hints:
                session = h.session or (self._requests.get(h.request) if h.request else None)
                if session is not None and h.finished:
                    self._cancel(session)
                    self._chains.pop(session, None)
        self._settle()

    def request(self, session: str, chain: Sequence[bytes]) -> None:
        """Bring ``chain`` (root first) up for ``session``, as for an idle agent (an operator's or a router's
        prefetch call); it replaces the session's job, if any."""
        with self._lock:
            self._cancel(session)
            self._enqueue(Job(session, list(chain), explicit=True))
        self._settle()

    def request_session(self, session: str) -> bool:
        """``request`` for the last chain this prefetcher saw for ``session`` (an operator or a router that names
        the agent, not its keys: kvtier/client/store_prefetch.py); False if it remembers none."""
        with self._lock:
            chain = self._chains.get(session)
            if chain is None:
                return False
            self._cancel(session)
            self._enqueue(Job(session, list(chain), explicit=True))
        self._settle()
        return True

    def cancel(self, session: str) -> None:
        with self._lock:
            self._cancel(session)
        self._settle()

    # ---- moving blocks -------------------------------------------------------------------------------------

    def pending(self) -> int:
        """Jobs waiting to be moved along."""
        return len(self._jobs)

    def sessions(self) -> list[str]:
        """The agents with a job, in the order their jobs were made."""
        with self._lock:
            return list(self._jobs)

    def step(self, budget: Mapping[str, int]) -> dict[str, int]:
        """Move the jobs along, soonest predicted back first, within ``budget`` (blocks per lower tier, by
        name); returns the blocks moved per lower tier. A job the top tier's policy grants no room stops this
        step (the jobs after it are predicted back later: they would get no more room)."""
        moved: dict[str, int] = {}
        if self.top is None or not self._jobs or not any(v > 0 for v in budget.values()):
            return moved
        left = dict(budget)
        for job in self._order():
            if not any(v > 0 for v in left.values()):
                break
            if self.resident is not None:
                job.pos = max(job.pos, self.resident(job.chain))
            t0 = time.perf_counter()
            got = self.store.bring_up(job.chain, job.session, job.pos, left)
            self._measured(got.moved, time.perf_counter() - t0)
            with self._lock:
                # counted, and charged to the budget, even if the job was cancelled meanwhile (its agent came
                # back): the blocks are up
                self._record(got.keys, got.moved)
                if self._jobs.get(job.session) is job:
                    job.pos += got.done
                    if job.pos >= len(job.chain) or got.why == "missing":
                        del self._jobs[job.session]
                        self._park(job)
                elif self._inflight.get(job.session, 0) > 0:  # back, and they are on top before its loads
                    self._used(got.keys)
            for tier, n in got.moved.items():
                moved[tier] = moved.get(tier, 0) + n
                left[tier] = left.get(tier, 0) - n
            if got.why == "room":
                break
        self._settle()
        return moved

    def _order(self) -> list[Job]:
        """The jobs to move, soonest predicted back first; an agent predicted back never is dropped (an
        explicit request goes first, in the order asked)."""
        with self._lock:
            jobs = list(self._jobs.values())
        assert self.top is not None
        backs = self.top.predicted_back([j.session for j in jobs])
        ranked = []
        with self._lock:
            for i, (job, back) in enumerate(zip(jobs, backs)):
                if job.explicit:
                    ranked.append((-math.inf, i, job))
                elif back is None:
                    if self._jobs.get(job.session) is job:
                        del self._jobs[job.session]
                        self._dropped.append(job)
                else:
                    ranked.append((back, i, job))
        ranked.sort(key=lambda r: (r[0], r[1]))
        return [job for _, _, job in ranked]

    def _measured(self, moved: Mapping[str, int], seconds: float) -> None:
        """A step's copies: the read rate of the one lower tier it read from (several: not attributable, so
        not counted), smoothed."""
        if len(moved) != 1 or seconds <= 0:
            return
        (tier, n), = moved.items()
        if n < 4:
            return
        rate = n * self.store.block_bytes / seconds
        old = self.rates.get(tier)
        self.rates[tier] = rate if old is None else 0.8 * old + 0.2 * rate

    # ---- bookkeeping (under the lock) ------------------------------------------------------------------------

    def _enqueue(self, job: Job) -> None:
        self._jobs[job.session] = job
        if len(self._jobs) > self.max_jobs:  # bounded: the oldest job goes (its agent has waited longest)
            oldest = next(iter(self._jobs))
            self._cancel(oldest)

    def _cancel(self, session: str) -> None:
        self._parked.pop(session)  # up: nothing left undone
        job = self._jobs.pop(session, None)
        if job is not None:
            self._dropped.append(job)

    def _park(self, job: Job) -> None:
        """``job``'s chain is up (to its end, or to a key no tier holds): watch it until its agent is back."""
        self._parked.park(job, self.max_jobs, self.max_parked_keys)

    def _evicted(self, keys: Sequence[bytes]) -> None:
        """The top tier evicted ``keys``: a parked job whose chain lost one is queued again, from its root
        (what is still on top is skipped at no copy)."""
        for job in self._parked.touched(keys):
            job.pos = 0
            if job.session not in self._jobs:
                self._enqueue(job)

    def _settle(self) -> None:
        """Count what the jobs dropped since the last call left undone: the blocks of the rest of their prefix
        still below the top tier (asked of the store outside the lock)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        undone = 0
        for job in dropped:
            found = self.store.lookup_prefix(job.chain[job.pos:])
            undone += found.length - found.count(self._top_name)
        if undone:
            with self._lock:
                self.counts.cancelled += undone

    def _record(self, keys: list[bytes], moved: Mapping[str, int]) -> None:
        c = self.counts
        c.prefetched += len(keys)
        for tier, n in moved.items():
            c.from_tier[tier] = c.from_tier.get(tier, 0) + n
        brought = self._brought
        brought.update(dict.fromkeys(keys))
        while len(brought) > self.max_tracked:
            brought.popitem(last=False)

    def _used(self, keys: Sequence[bytes]) -> None:
        brought = self._brought
        if brought:
            n = len(brought)
            for k in keys:
                brought.pop(k, None)
            self.counts.used += n - len(brought)

    def _on_event(self, event: StoreEvent) -> None:
        if event.kind != "removed" or event.tier != self._top_name or not (self._brought or self._parked):
            return
        with self._lock:
            brought = self._brought
            n = len(brought)
            for k in event.keys:
                brought.pop(k, None)
            self.counts.wasted += n - len(brought)
            if self._parked:
                self._evicted(event.keys)
