"""KV events for KV-aware routers: which engine blocks kvtier holds, and in which medium.

Worker side, ``EventRecorder`` listens to the store (``TieredStore.add_listener``) and turns its per-tier
stored/removed keys back into vLLM ``BlockStored`` / ``BlockRemoved`` events carrying the engine's own block
hashes, with medium CPU for host DRAM and STORAGE for the SSD, as vLLM's native offloading reports them.
It learns a key's engine hash when the worker saves or loads it, and forgets it when the store holds the key
nowhere: a block DRAM evicts is often still on its way to the SSD (write-behind), and its "stored in ssd"
event, which comes after DRAM's "removed", must still find the hash.

The events travel to the scheduler in ``KVTierKVEvents`` (vLLM concatenates every worker's), where
``EventQuorum`` publishes a stored block once every rank reported it (a prefix is loadable only when all
ranks hold their slice) and a removed block as soon as one rank lost it. It counts per (block, medium), not
per event: each rank batches its own SSD writes, so the ranks' events about one block rarely match whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import msgspec
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.store import StoreEvent

TIER_MEDIUM = {"dram": MEDIUM_CPU, "ssd": MEDIUM_STORAGE}


class EventRecorder:
    """Store events -> vLLM KV events, for one worker. Thread-safe: the store calls ``on_store_event`` from
    whichever thread changed a tier (DRAM's evictions under the DRAM lock).

    ``holds`` (the store's ``contains``; it takes no tier lock) says whether the store still holds keys that
    the tiers which reported them have all lost: such a key keeps its hash, in a bounded table of
    ``max_in_transit`` keys (a write that never lands must not grow it for ever). Without ``holds`` a key
    is forgotten as soon as no reporting tier holds it."""

    def __init__(self, block_size: int, mediums: Mapping[str, str] = TIER_MEDIUM, *,
                 holds: Callable[[Sequence[bytes]], list[bool]] | None = None, max_in_transit: int = 1 << 16) -> None:
        self.block_size = block_size
        self._mediums = dict(mediums)
        self._holds = holds
        self._max_in_transit = max_in_transit
        self._lock = threading.Lock()
        self._known: dict[bytes, tuple[bytes, set[str]]] = {}  # key -> (engine hash, tiers holding it)
        # Keys no tier reported holding, that the store still held (queued for the SSD) -> engine hash.
        self._in_transit: OrderedDict[bytes, bytes] = OrderedDict()
        self._naming: dict[bytes, bytes] = {}  # keys being put/got right now -> engine hash
        self._events: list[KVCacheEvent] = []

    @contextmanager
    def naming(self, keys: Sequence[bytes], hashes: Sequence[bytes]) -> Iterator[None]:
        """Within the block, store events about ``keys`` are reported under ``hashes``."""
        with self._lock:
            self._naming.update(zip(keys, hashes))
        try:
            yield
        finally:
            with self._lock:
                for k in keys:
                    self._naming.pop(k, None)

    def on_store_event(self, event: StoreEvent) -> None:
        medium = self._mediums.get(event.tier, event.tier.upper())
        hashes = []
        with self._lock:
            emptied = []
            for key in event.keys:
                entry = self._known.get(key)
                if event.kind == "stored":
                    h = entry[0] if entry is not None else self._in_transit.pop(key, None) or self._naming.get(key)
                    if h is None:
                        continue  # a block this worker never named (e.g. restored from disk at start)
                    if entry is None:
                        entry = self._known[key] = (h, set())
                    entry[1].add(event.tier)
                    hashes.append(h)
                elif entry is None:
                    self._in_transit.pop(key, None)  # dropped before its write landed: never reported there
                else:
                    entry[1].discard(event.tier)
                    if not entry[1]:
                        emptied.append(key)
                    hashes.append(entry[0])
            if emptied:
                self._forget(emptied)
            if hashes:
                ext = [maybe_convert_block_hash(h) for h in hashes]
                self._events.append(
                    BlockStored(block_hashes=ext, parent_block_hash=None, token_ids=[], block_size=self.block_size,
                                lora_id=None, medium=medium, lora_name=None, group_idx=0)
                    if event.kind == "stored" else BlockRemoved(block_hashes=ext, medium=medium, group_idx=0))

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _forget(self, keys: list[bytes]) -> None:
        """No reporting tier holds ``keys`` any more; keep the hash of those the store still holds (called
        with the lock held)."""
        held = self._holds(keys) if self._holds is not None else [False] * len(keys)
        in_transit = self._in_transit
        for key, h in zip(keys, held):
            engine_hash = self._known.pop(key)[0]
            if h:
                in_transit[key] = engine_hash
        while len(in_transit) > self._max_in_transit:
            in_transit.popitem(last=False)


class KVTierKVEvents(KVConnectorKVEvents):
    """The container vLLM carries from the workers to the scheduler: a plain list, concatenated across
    workers (the quorum is applied on the scheduler side, across steps)."""

    def __init__(self, events: list[KVCacheEvent] | None = None) -> None:
        self._events = list(events or ())
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVTierKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()
        self._workers = 1


class EventQuorum:
    """Scheduler side: publish a block's "stored in medium M" once ``ranks`` reports of it arrived (over any
    number of steps and events), its "removed from M" at the first report (the other ranks' reports are
    absorbed). A report of one kind restarts the count of the other. Counted per (block hash, medium, group); a
    published event carries the blocks of one incoming event that completed with it. At most ``max_pending``
    partly reported (block, medium) pairs are remembered; the oldest are dropped first. Not thread-safe
    (the scheduler's thread)."""

    def __init__(self, ranks: int, max_pending: int = 1 << 16) -> None:
        self.ranks = ranks
        self.max_pending = max_pending
        # (hash, medium, group) -> reports so far, of stores and of removals.
        self._stored: OrderedDict[tuple[object, str | None, int | None], int] = OrderedDict()
        self._removed: OrderedDict[tuple[object, str | None, int | None], int] = OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def add(self, events: Sequence[KVCacheEvent]) -> None:
        for event in events:
            removal = isinstance(event, BlockRemoved)
            if not removal and not isinstance(event, BlockStored):
                self._ready.append(event)  # not a block event of ours: nothing to agree on
                continue
            counts = self._removed if removal else self._stored
            publish = []
            for h in event.block_hashes:
                pair = (h, event.medium, event.group_idx)
                count = counts.pop(pair, 0) + 1
                # A report of the other kind restarts a count: after a removal every rank's store must come
                # again, and a stale count of removals must not swallow the next real one.
                (self._stored if removal else self._removed).pop(pair, None)
                if count == (1 if removal else self.ranks):
                    publish.append(h)
                if count < self.ranks:
                    counts[pair] = count
            if publish:
                self._ready.append(msgspec.structs.replace(event, block_hashes=publish))
        for counts in (self._stored, self._removed):
            while len(counts) > self.max_pending:
                counts.popitem(last=False)

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready
