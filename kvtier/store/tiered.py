"""TieredStore: one logical block store over an ordered list of tiers (DRAM, then the remote pool, then SSD).

Runs in the caller's process (embedded mode). Batch-first and thread-safe: any thread may call any method.
Buffer ownership: ``put`` copies the caller's blocks before it returns (``put_async``: before its future
completes), ``get`` writes into the caller's ``out`` buffers before it returns; the caller must keep those
buffers alive and unchanged until then. ``put_in_place`` lends the caller top-tier slots to write until its
``fill`` returns (a caller that produces the blocks itself, an engine connector's gather, skips its staging).

What the store adds over its tiers: "which tier holds this key?" is answered once per key and call, each tier
asked once (``_where``). A put asks it once (``prepare_put``: a PutPlan, which every write of the put then uses)
of the top tier and the local ones, never of a remote pool below (no master RPC per save; a block a pool holds
is at worst copied into DRAM again), and claims what no tier holds and no other thread is putting (concurrent
sessions sharing a prefix pay once: inflight.py); the writes themselves are writes.py's. A prefix lookup
can pin what it finds in the same pass (``lookup_prefix(pin=True)``, pinned before the tiers are asked). A get
falls through the tiers in order (each asked once about the keys the tiers above it missed), and what a lower
tier served is promoted into the top tier (asked once more, in the reserve that takes its slot: another reader
may have promoted it since the miss); pins (per-block reference counts) keep blocks from being evicted in every
tier, and leases are pins that expire (``store.leases``: a lookup's blocks until their load, an agent session's
blocks for its TTL); listeners hear which keys each tier gained and lost (the engines' KV events and the master's
directory feed on them). Which tiers a Config describes is build.py's; what moves between the top tier and each
lower one, offload/'s.

Past 400 lines on purpose: what is left here is the store's public API (each call's contract in its docstring)
and the bookkeeping every call shares (the one tier walk, counters, events; ``bring_up``, the copy a prefetch
between turns makes, and its hand-off to the offloaders that move blocks up, ``_moved_up``, are here because they
are that walk, the promotion claim and the store's pins and events); its parts with a role of their own
live beside it (build.py, writes.py, inflight.py, offload/, leases.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import numpy as np

from kvtier.blocks import BlockRows, block_rows
from kvtier.config import Config
from kvtier.store.inflight import InflightPuts
from kvtier.keys import check_keys
from kvtier.layout import BlockLayout
from kvtier.store.leases import LeaseTable
from kvtier.offload import OffloadPolicy, write_down
from kvtier.pins import PinTable
from kvtier.policies import Arrival, Clock, Completion, Hint, Observations
from kvtier.policies.sessions import SessionTracker
from kvtier.store.build import offloads_between, tiers_from_config
from kvtier.store.types import BroughtUp, Fill, Listener, PutResult, StoreEvent, StoreLookup
from kvtier.store.writes import PutPlan, TopWrites
from kvtier.tiers.base import ListsKeys, ObservingTier, PrefetchTarget, RemoteTier, Tier

log = logging.getLogger(__name__)


class TieredStore:
    """The embedded store. Build with ``TieredStore.from_config(config, layout)`` or from tier objects."""

    def __init__(self, tiers: Sequence[Tier], *, io_threads: int = 4, dtypes: Sequence[str] = (),
                 offload: str | OffloadPolicy | Sequence[str | OffloadPolicy] = "on_evict",
                 promote: bool | Sequence[bool] = True,
                 close_timeout_s: float = 30.0, clock: Clock | None = None) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        sizes = {t.block_bytes for t in tiers}
        if len(sizes) != 1:
            raise ValueError(f"all tiers must hold blocks of one size, got {sorted(sizes)}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)
        self.block_bytes = sizes.pop()
        # The lower tiers whose ``contains`` may be a round trip (a pool, or the master that knows the pools): a
        # put does not ask them (see _where). The top tier is the one a put writes: it is always asked.
        self._remote = [t > 0 and isinstance(tier, RemoteTier) for t, tier in enumerate(self.tiers)]
        self.pins = PinTable()
        self._dtypes = tuple(dtypes)
        self._lock = threading.Lock()
        self._inflight = InflightPuts()  # what put skips: keys another thread is writing now
        self.demand_reads = 0  # gets under way: a prefetch driver yields to them (kvtier/prefetch/)
        self._listeners: list[Listener] = []
        self._reclaimers: list[Callable[[], int]] = []  # release stale pins (expired leases) when full
        # Named pins that expire: a connector's lookup-to-load pins, an agent's session hints (leases.py).
        self.leases = LeaseTable(self)  # registers its sweep with add_reclaimer
        self._executor = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-io")
        self._closed = False
        self.close_timeout_s = close_timeout_s
        self.counters = {"put_stored": 0, "put_skipped": 0, "put_rejected": 0, "get_hits": 0, "get_misses": 0,
                         "promoted": 0, "prefetched": 0}
        # Between the top tier and each one under it: what goes down when, and what comes back up (offload/);
        # second_hit's memory of puts and hits is one for all lower tiers (recorded here, once per call).
        self._offloads, self._sightings = offloads_between(self.tiers, offload, promote, self._emit)
        # Writes into the top tier (copied, or filled in place where it declares addressable slots: a DramTier,
        # not the node pool at the top of a standalone store): what a PutPlan writes through, borrow lends from.
        self._writes = TopWrites(self.tiers[0], self._offloads, self._sightings, self._reclaim, self._stored,
                                 self.block_bytes, self._dtypes)
        self._slots = self._writes.slots
        for tier in self.tiers:
            tier.attach(self.pins, self._evict_listener(tier.name))
        # What the engine knows about requests and agents, for the tiers whose policies learn from it.
        self.clock: Clock = clock or time.monotonic
        self.sessions = SessionTracker(self.clock)
        self._observers = [t for t in self.tiers if isinstance(t, ObservingTier) and t.observes]
        self._watchers: list[Callable[[Observations], None]] = []  # add_watcher: a prefetcher's, after the tiers

    @classmethod
    def from_config(cls, config: Config | Mapping[str, Any] | str | None, layout: BlockLayout | int, *,
                    clock: Clock | None = None) -> TieredStore:
        """Build the tiers a Config describes for blocks of ``layout`` (or a plain block size in bytes).

        ``mode`` embedded: DRAM (+SSD); standalone: the node pool through shared memory (under an optional
        small private DRAM); distributed: DRAM, then remote pools, then the SSD if any. ``clock``: where the
        store and its policies read time (``time.monotonic``; a replay passes its virtual clock)."""
        cfg = Config.load(config)
        parts = tiers_from_config(cfg, layout, clock)
        return cls(parts.tiers, io_threads=cfg.io_threads, dtypes=parts.dtypes, offload=parts.offload,
                   promote=parts.promote, close_timeout_s=cfg.close_timeout_s, clock=clock)

    # ---- writes ----------------------------------------------------------------------------------------

    @contextmanager
    def prepare_put(self, keys: Sequence[bytes]) -> Iterator[PutPlan]:
        """The first half of a put: which of ``keys`` to write, answered once per key and claimed.

        ``plan.fresh`` are the positions of the keys neither the top tier nor a local one holds (each asked
        once; a remote tier below the top is not asked, so a distributed save costs no master RPC: see _where)
        and no other put is writing: they are in flight until the block exits, so a concurrent put of them skips
        them. Write them, whole or in chunks, with ``plan.put`` or ``plan.put_in_place`` inside the block; a caller that
        produces blocks (a connector's gather) asks first and copies only what is fresh.
        """
        check_keys(keys)
        where = self._where(keys, local_only=True)
        with self._inflight.claim(keys, where >= 0) as fresh:
            self._count(put_skipped=len(keys) - len(fresh))
            yield PutPlan(self._writes, list(keys), fresh, [keys[i] for i in np.flatnonzero(where == 0).tolist()])

    def put(self, keys: Sequence[bytes], blocks: Any) -> PutResult:
        """Store blocks (one per key) in the top tier; keys the top or a local tier holds, or another put is
        writing, are skipped (``prepare_put``)."""
        rows = block_rows(blocks, len(keys), self.block_bytes, dtypes=self._dtypes)
        with self.prepare_put(keys) as plan:  # checks the keys
            return plan.skipping(plan.put(plan.fresh, rows.take(plan.fresh)))

    # ---- what the store's callers ask about its tiers (declared by the tiers: kvtier/tiers/base.py) -------------

    @property
    def capacity_blocks(self) -> int:
        """Blocks the top tier holds at most (DRAM's slots; a standalone store's node pool): what hint leases,
        prefetch requests and a put's batches are bounded by."""
        return self.tiers[0].stats().capacity_bytes // self.block_bytes

    @property
    def pinned_memory(self) -> bool:
        """Whether the top tier's memory is page-locked (AddressableSlots.pinned): a GPU then copies to and from
        its slots directly; False for a top tier without addressable slots."""
        return self._slots is not None and self._slots.pinned

    @property
    def local_tiers(self) -> list[Tier]:
        """The tiers in this process's own memory and disk (not a RemoteTier: the pools report their blocks
        themselves)."""
        return [t for t in self.tiers if not isinstance(t, RemoteTier)]

    def local_keys(self) -> list[bytes]:
        """Every key the local tiers that list their keys (ListsKeys: DRAM, SSD) hold now, each once (a snapshot)."""
        keys: dict[bytes, None] = {}
        for tier in self.local_tiers:
            if isinstance(tier, ListsKeys):
                keys.update(dict.fromkeys(tier.keys()))
        return list(keys)

    @property
    def writes_in_place(self) -> bool:
        """Whether ``put_in_place`` works: the top tier has addressable slots (a DramTier; not the node pool
        at the top of a standalone store)."""
        return self._slots is not None

    def put_in_place(self, keys: Sequence[bytes], fill: Fill) -> PutResult:
        """put() with one copy fewer: the caller writes the blocks straight into the top tier's slots.

        Keys are skipped as put skips them; the others get slots (evicting as put
        does, never a pinned block nor a block of this batch the top tier holds). Then ``fill(index, slots)``
        runs once, on this thread, if any slot was taken: it writes block ``keys[index[j]]`` at host address
        ``slots.ptrs[j]`` and is done writing when it returns (GPU: synchronized). Only then are the keys
        published, with put's offloads, events and counters. If ``fill`` or a write-through offload raises,
        the top tier publishes nothing, every slot is freed and the exception propagates. TypeError where
        ``writes_in_place`` is False (use put).
        """
        if self._slots is None:  # before any tier is asked or any key claimed
            raise TypeError(f"the top tier {self.tiers[0].name!r} has no addressable slots to fill in place; use put")
        with self.prepare_put(keys) as plan:
            return plan.skipping(plan.put_in_place(plan.fresh, fill))

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop keys from every tier; return how many blocks were dropped in all.

        Pins stay: each belongs to a holder (a lease, a load in flight) that will unpin it, and a pin on a
        key no tier holds is harmless (it keeps a block put again under that key until its holder lets go).
        """
        check_keys(keys)
        total = 0
        for tier in self.tiers:
            present = [k for k, h in zip(keys, tier.contains(keys)) if h] if self._listeners else []
            n = tier.remove(keys)
            total += n
            if n and present:
                self._emit("removed", tier.name, present)
        return total

    # ---- reads -----------------------------------------------------------------------------------------

    def get(self, keys: Sequence[bytes], out: Any) -> list[bool]:
        """Copy held blocks into ``out`` (one writable block per key), trying tiers in order.

        Returns a hit mask; ``out`` rows of misses are left untouched, except that a row an SSD read landed
        in and whose checksum then failed is zeroed (a miss, never the damaged bytes).
        """
        check_keys(keys)
        rows = block_rows(out, len(keys), self.block_bytes, writable=True, dtypes=self._dtypes, what="out")
        with self._lock:
            self.demand_reads += 1
        try:
            return self._get(keys, rows)
        finally:
            with self._lock:
                self.demand_reads -= 1

    def _get(self, keys: Sequence[bytes], rows: BlockRows) -> list[bool]:
        hit = self.tiers[0].get(keys, rows)
        if all(hit):  # the top tier served every key (the common get): nothing to look for below it
            self._count(get_hits=len(keys), get_misses=0)
            if self._sightings is not None:
                self._sightings.see(keys)
            return hit
        served = [0 if h else -1 for h in hit]  # which tier served each key
        for t, tier in enumerate(self.tiers[1:], 1):
            missing = [i for i, h in enumerate(hit) if not h]
            if not missing:
                break
            found = tier.get([keys[i] for i in missing], rows.take(missing))
            for i, f in zip(missing, found):
                hit[i] = f
                served[i] = t if f else -1
        hits = sum(hit)
        self._count(get_hits=hits, get_misses=len(keys) - hits)
        if self._sightings is not None:
            self._sightings.see([k for k, t in zip(keys, served) if t >= 0])
        if any(t > 0 for t in served):
            self._promote(keys, served, rows)
        return hit

    @contextmanager
    def borrow(self, keys: Sequence[bytes]) -> Iterator[list[int | None]]:
        """Host addresses of the blocks the top tier holds (None for the others), readable in place until
        the block exits; they cannot be evicted meanwhile. Zero-copy reads for callers that copy straight
        from the slots (a connector's scatter into engine KV); ``get`` the None ones as usual."""
        check_keys(keys)
        if self._slots is None:  # a top tier without addressable slots
            yield [None] * len(keys)
            return
        with self._slots.acquire(keys) as addresses:
            self._count(get_hits=sum(a is not None for a in addresses))
            if self._sightings is not None:  # a hit like a get's: second_hit counts it as a sighting
                self._sightings.see([k for k, a in zip(keys, addresses) if a is not None])
            yield addresses

    def contains(self, keys: Sequence[bytes], *, local_only: bool = False) -> list[bool]:
        """Which keys some tier holds. ``local_only``: without asking a remote tier below the top one (no
        round trip; what a put asks, and what an event recorder may ask from an eviction callback)."""
        held = self._where(keys, local_only=local_only) >= 0
        return [True] * len(keys) if held.all() else held.tolist()  # all held: no list built bool by bool

    def lookup_prefix(self, keys: Sequence[bytes], *, pin: bool = False) -> StoreLookup:
        """How many leading keys are held, and by which tier each (the highest tier that holds it).

        ``pin``: the prefix found comes back pinned, one pin per key (the caller unpins them, e.g. a lease that
        adopts them: LeaseTable.lease_prefix). Every key is pinned before any tier is asked, so no block found
        can be chosen for eviction after the answer; one a tier had already chosen is still on its way down
        (DRAM hands it to the tier below, where it stays held unless that tier refuses it: then the load finds
        it missing and the engine recomputes). The keys past the prefix are unpinned at once.
        """
        if pin:
            self.pins.pin(keys)
        where = self._where(keys)
        missed = where < 0
        length = int(missed.argmax()) if missed.any() else len(keys)  # the first miss
        if pin and length < len(keys):
            self.pins.unpin(keys[length:])
        return StoreLookup(length, self._runs(where[:length]))

    # ---- what the engine knows ---------------------------------------------------------------------------

    def observe(self, arrivals: Sequence[Arrival] = (), completions: Sequence[Completion] = (),
                hints: Sequence[Hint] = ()) -> None:
        """Tell the tiers' policies what the engine knows, in a batch (kvtier.policies.observations): requests
        that arrived (their full chain of keys, root first, and the client's session id if any), requests
        that finished (stop reason, keys generated since), hints. Each observation's agent is filled in here
        (the session id, else inferred from the chains: ``self.sessions``) and its time where None (this
        store's clock), then the batch goes to every tier whose policy learns from it. O(batch); never
        raises for what it is told (unknown keys, requests or sessions are fine; a policy's error is logged).
        """
        batch = Observations(arrivals, completions, hints)
        if not batch or not (self._observers or self._watchers):
            return
        batch = self.sessions.resolve(batch)
        for tier in self._observers:
            tier.observe(batch)
        for watch in self._watchers:
            try:
                watch(batch)
            except Exception:
                log.exception("store observation watcher %r failed", watch)

    def add_watcher(self, watch: Callable[[Observations], None]) -> None:
        """Call ``watch(batch)`` with every resolved batch ``observe`` hands the tiers, after them (a
        prefetcher learns which agents are idle from it). Keep it short; it runs on the observing thread."""
        self._watchers.append(watch)

    # ---- prefetch between turns ------------------------------------------------------------------------

    def bring_up(self, chain: Sequence[bytes], session: str, start: int = 0,
                 budget: Mapping[str, int] | None = None) -> BroughtUp:
        """Copy into the top tier the blocks of ``chain[start:]`` (an agent's chain, root first) that only a
        lower tier holds, root first, as far as ``budget`` (blocks per lower tier, by name; None: no limit) and
        the top tier's policy (``PrefetchTarget.prefetch_room``: never evicting what is predicted to be needed
        sooner) allow. Stops at the first key no tier holds (a prefix ends there). Copies through the
        promotion path (the claim: a key a demand read is promoting meanwhile is written once); a block that
        went before it was read is skipped (a miss here, never wrong bytes). What kvtier/prefetch/ moves."""
        top = self.tiers[0]
        keys = chain[start:]
        if len(self.tiers) < 2 or not isinstance(top, PrefetchTarget) or not keys:
            return BroughtUp(len(keys), {}, [], "done")
        where = self._where(keys).tolist()
        take: list[int] = []
        per: dict[str, int] = {}
        end, why = len(keys), "done"
        for i, t in enumerate(where):
            if t == 0:
                continue
            if t < 0:
                end, why = i, "missing"
                break
            name = self.tiers[t].name
            if budget is not None and per.get(name, 0) >= budget.get(name, 0):
                end, why = i, "budget"
                break
            per[name] = per.get(name, 0) + 1
            take.append(i)
        if not take:
            return BroughtUp(end, {}, [], why)
        room = top.prefetch_room(session, keys[take[0]:], start + take[0], len(take))
        if room < len(take):
            end, why = take[room], "room"
            take = take[:room]
            if not take:
                return BroughtUp(end, {}, [], why)
        up = [keys[i] for i in take]
        rows = block_rows(np.empty((len(up), self.block_bytes), np.uint8), len(up), self.block_bytes,
                          writable=True, what="prefetch")
        served = [-1] * len(up)
        for t, tier in enumerate(self.tiers[1:], 1):
            missing = [i for i, s in enumerate(served) if s < 0]
            if not missing:
                break
            found = tier.get([up[i] for i in missing], rows.take(missing))
            for i, f in zip(missing, found):
                if f:
                    served[i] = t
        brought = self._promote(up, served, rows, always=True)
        if brought:
            self._moved_up(up, served, brought, session, [start + i for i in take])
        moved: dict[str, int] = {}
        got = set(brought)
        for key, t in zip(up, served):
            if t > 0 and key in got:
                name = self.tiers[t].name
                moved[name] = moved.get(name, 0) + 1
        self._count(prefetched=len(brought))
        return BroughtUp(end, moved, brought, why)

    # ---- pins ------------------------------------------------------------------------------------------

    def pin(self, keys: Sequence[bytes]) -> list[bool]:
        """Add one pin to each held key (pinned blocks are never evicted); True where the key was held by a
        tier the pins protect: the top tier and the local ones. A pool below evicts by its own rules, so it is
        not asked (no round trip: a save's session lease costs no master RPC) and its blocks are not pinned.

        Unheld keys are not pinned. Each successful pin needs one ``unpin``. Pinned first, then asked (one
        pass over the tiers), so a block reported held can no longer be chosen for eviction.
        """
        check_keys(keys)
        self.pins.pin(keys)
        held = self._where(keys, local_only=True) >= 0
        self.pins.unpin([keys[i] for i in np.flatnonzero(~held).tolist()])
        return held.tolist()

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Drop one pin per key. Unpinning a key that holds no pin is logged, not raised."""
        unknown = self.pins.unpin(keys)
        if unknown:
            log.warning("unpin of %d keys that hold no pin (first: %s)", len(unknown), unknown[0].hex())

    # ---- async variants --------------------------------------------------------------------------------

    def put_async(self, keys: Sequence[bytes], blocks: Any) -> Future[PutResult]:
        """put() on an I/O thread; ``blocks`` must stay unchanged until the future completes."""
        return self._submit(self.put, keys, blocks)

    def get_async(self, keys: Sequence[bytes], out: Any) -> Future[list[bool]]:
        """get() on an I/O thread; ``out`` is written by the time the future completes."""
        return self._submit(self.get, keys, out)

    def lookup_prefix_async(self, keys: Sequence[bytes]) -> Future[StoreLookup]:
        return self._submit(self.lookup_prefix, keys)

    # ---- events, stats, lifetime ----------------------------------------------------------------------

    def add_reclaimer(self, reclaim: Callable[[], int]) -> None:
        """Call ``reclaim()`` when a put finds no evictable space (and on ``stats``): it releases pins nobody
        needs any more, such as expired leases, and returns how many holders it released (> 0: the put is
        retried once). LeaseTables over this store register their sweep here themselves."""
        self._reclaimers.append(reclaim)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(StoreEvent)`` whenever a tier gains or loses keys (on the thread that caused it;
        keep it short and never call back into the store from it)."""
        self._listeners.append(listener)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the blocks queued for lower tiers (write-behind) are written; False on timeout."""
        return all([offload.flush(timeout) for offload in self._offloads])

    def stats(self) -> dict[str, Any]:
        self._reclaim()  # pinned_keys counts live pins only
        extra = {"offload": self._offloads[0].stats(),  # the tier right under the top one
                 "offloads": {o.lower.name: o.stats() for o in self._offloads}} if self._offloads else {}
        return {"block_bytes": self.block_bytes, "pinned_keys": len(self.pins), "inflight_puts": len(self._inflight),
                **self.counters, "tiers": {t.name: asdict(t.stats()) for t in self.tiers},
                "observations": self.sessions.stats(), **extra}

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the async calls, write DRAM's blocks down (below), close every tier. Idempotent.

        DRAM vanishes with the process, so a clean close treats it as evicted whole: each lower tier gets the
        blocks its offload policy would get on their eviction and does not hold yet (``on_evict``: every block
        the SSD lacks), for at most ``timeout_s`` (the ``close_timeout_s`` config key; default 30 s). Blocks not
        written by then are lost with the process; the log line says how many.
        """
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        write_down(self._offloads, self.close_timeout_s if timeout_s is None else timeout_s, self.block_bytes)
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._closed:
            raise RuntimeError("the store is closed")
        return self._executor.submit(fn, *args)

    def _evict_listener(self, tier_name: str) -> Callable[[Sequence[bytes], Sequence[Any]], None]:
        offloads = self._offloads if tier_name == self.tiers[0].name else []

        def on_evict(keys: Sequence[bytes], views: Sequence[Any]) -> None:
            for offload in offloads:
                offload.on_top_evict(keys, views)  # copies what goes down before the slots are reused
            self._emit("removed", tier_name, list(keys))

        return on_evict

    def _promote(self, keys: Sequence[bytes], served: Sequence[int], rows: BlockRows, *,
                 always: bool = False) -> list[bytes]:
        """Copy into the top tier what a lower tier served (``served[i]``: the index of the tier that served key
        i), where that tier's offloader promotes: the session's next turn finds it there, and it stays below
        too, so evicting it again costs no write. Through put's claim, so a key another thread is putting or
        promoting right now is written once; counted (``promoted``, per tier in the offload stats) and announced
        as put's blocks are. ``always``: whatever the offloaders say (a prefetch: bring_up counts it apart).
        Returns the keys copied up."""
        up = [i for i, t in enumerate(served) if t > 0 and (always or self._offloads[t - 1].promote)]
        if not up:
            return []
        up_keys = [keys[i] for i in up]
        # The top tier missed them before the copy from below (the caller's walk asked it), but another reader of
        # the same blocks may have promoted them meanwhile (two sessions on one prefix): the claim skips those
        # being written now, the top tier's own check-and-take those written since. A top tier with slots asks
        # itself that once per key, in the reserve that takes the slot (put_new: what it stored now); one
        # without is asked here first, and its put's answer cannot tell stored from held.
        slots = self._slots
        held = np.zeros(len(up_keys), bool) if slots is not None else self.tiers[0].contains(up_keys)
        with self._inflight.claim(up_keys, held) as fresh:
            fresh_keys = [up_keys[j] for j in fresh]
            fresh_rows = rows.take([up[j] for j in fresh]) if fresh else None
            if not fresh:
                promoted: list[int] = []
            elif slots is not None:
                promoted = [fresh[j] for j in slots.put_new(fresh_keys, fresh_rows)]
            else:
                promoted = [j for j, ok in zip(fresh, self.tiers[0].put(fresh_keys, fresh_rows)) if ok]
        if not promoted:
            return []
        out = [up_keys[j] for j in promoted]
        if not always:
            self._count(promoted=len(promoted))
            for offload in self._offloads:
                offload.promoted(sum(served[up[j]] == offload.index for j in promoted))
        self._emit("stored", self.tiers[0].name, out)
        return out

    def _moved_up(self, keys: Sequence[bytes], served: Sequence[int], brought: Sequence[bytes], session: str,
                  depths: Sequence[int]) -> None:
        """A prefetch's copies (``brought`` of ``keys``; ``served``, ``depths`` per key): each offloader is told
        what its lower tier served (Offloader.prefetched: a private tier under on_evict gives them up), while the
        top tier holds them pinned (one it evicted already is not handed up: it stays below)."""
        self.pins.pin(brought)
        try:
            held = {k for k, h in zip(brought, self.tiers[0].contains(brought)) if h}
            for offload in self._offloads:
                mine = [i for i, (k, t) in enumerate(zip(keys, served)) if t == offload.index and k in held]
                moved = [keys[i] for i in mine]
                if moved and offload.prefetched(moved, session, [depths[i] for i in mine]):
                    self._emit("removed", offload.lower.name, moved)
        finally:
            self.pins.unpin(brought)

    def _where(self, keys: Sequence[bytes], *, local_only: bool = False) -> np.ndarray:
        """Per key, the index of the first tier holding it (-1: none), as a numpy int array. Each tier is asked
        once, in one batch, about the keys the tiers above it lack; the answers merge in numpy, with no Python
        work per key above the tiers (a lookup of keys the top tier holds costs its one probe pass).

        ``local_only`` (what a put asks): remote tiers below the top one are not asked. Their answer would be a
        round trip per save (a master RPC in distributed mode), and what this process remembers of a pool can be
        stale (another client removed the block, the pool evicted it): a put skipped on that memory would lose
        the block. So a block a pool may hold is written to the top tier again (a local copy), and a pool that is
        written to keeps what it holds already (the one-sided paths then copy nothing; a stream put has sent the
        bytes). The offloader skips what this process knows a pool holds (RemoteTier.held_locally)."""
        where = np.full(len(keys), -1, np.int16)
        todo: np.ndarray | None = None  # positions no tier asked so far holds (None: every position)
        for t, tier in enumerate(self.tiers):
            if local_only and self._remote[t]:
                continue
            if todo is None:
                found = np.asarray(tier.contains(keys), dtype=bool)
                if found.all():  # the common lookup: the top tier holds every key
                    where[:] = t
                    break
                where[found] = t
                todo = np.flatnonzero(~found)
            else:
                found = np.asarray(tier.contains([keys[i] for i in todo.tolist()]), dtype=bool)
                where[todo[found]] = t
                todo = todo[~found]
            if not todo.size:
                break
        return where

    def _runs(self, where: np.ndarray) -> list[tuple[str, int]]:
        """The tiers of a prefix (``where``: tier index per key, none -1) as runs of (tier name, count)."""
        if not where.size:
            return []
        starts = np.flatnonzero(np.diff(where)) + 1
        bounds = [0, *starts.tolist(), len(where)]
        return [(self.tiers[int(where[a])].name, b - a) for a, b in zip(bounds, bounds[1:])]

    def _stored(self, keys: Sequence[bytes], new_keys: list[bytes]) -> PutResult:
        """Count, log and announce what one write of a plan stored in the top tier (``keys``: those it wrote)."""
        if len(new_keys) == len(keys):  # all stored (the common case): no set of them to build
            result = PutResult(len(new_keys), 0, [])
        else:
            held = set(new_keys)
            result = PutResult(len(new_keys), 0, [k for k in keys if k not in held])
        if result.rejected:
            log.debug("put: %d of %d blocks rejected (no evictable space in %s)", len(result.rejected),
                      len(keys), self.tiers[0].name)
        self._count(put_stored=result.stored, put_rejected=len(result.rejected))
        self._emit("stored", self.tiers[0].name, new_keys)
        return result

    def _reclaim(self) -> int:
        released = 0
        for reclaim in self._reclaimers:
            try:
                released += reclaim()
            except Exception:
                log.exception("store reclaimer %r failed", reclaim)
        return released

    def _emit(self, kind: str, tier: str, keys: list[bytes]) -> None:
        if keys and self._listeners:
            event = StoreEvent(kind, tier, keys)
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    log.exception("store listener %r failed on a %s event", listener, kind)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self.counters[name] += d


__all__ = ["BroughtUp", "Fill", "Listener", "PutPlan", "PutResult", "StoreEvent", "StoreLookup", "TieredStore"]
