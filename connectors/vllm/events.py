"""KV events for KV-aware routers: which engine blocks kvtier holds, and in which medium.

Worker side, ``EventRecorder`` listens to the store (``TieredStore.add_listener``) and turns its per-tier
stored/removed keys back into vLLM ``BlockStored`` / ``BlockRemoved`` events carrying the engine's own block
hashes, with medium CPU for host DRAM and STORAGE for the SSD, as vLLM's native offloading reports them.
It learns a key's engine hash when the worker saves or loads it, and forgets it when no tier holds it.

The events travel to the scheduler in ``KVTierKVEvents`` (vLLM concatenates every worker's), where
``EventQuorum`` publishes a stored block once every rank reported it (a prefix is loadable only when all
ranks hold their slice) and a removed block as soon as one rank lost it.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

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
    whichever thread changed a tier."""

    def __init__(self, block_size: int, mediums: Mapping[str, str] = TIER_MEDIUM) -> None:
        self.block_size = block_size
        self._mediums = dict(mediums)
        self._lock = threading.Lock()
        self._known: dict[bytes, tuple[bytes, set[str]]] = {}  # key -> (engine hash, tiers holding it)
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
            for key in event.keys:
                entry = self._known.get(key)
                if event.kind == "stored":
                    h = entry[0] if entry is not None else self._naming.get(key)
                    if h is None:
                        continue  # a block this worker never named (e.g. restored from disk at start)
                    if entry is None:
                        entry = self._known[key] = (h, set())
                    entry[1].add(event.tier)
                    hashes.append(h)
                elif entry is not None:
                    entry[1].discard(event.tier)
                    if not entry[1]:
                        del self._known[key]
                    hashes.append(entry[0])
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
    """Scheduler side: publish BlockStored once ``ranks`` reports of it arrived (over any number of steps),
    BlockRemoved at its first report (later identical reports from the other ranks are absorbed). At most
    ``max_pending`` partly reported events are remembered; the oldest are dropped first. Not thread-safe
    (the scheduler's thread)."""

    def __init__(self, ranks: int, max_pending: int = 1 << 16) -> None:
        self.ranks = ranks
        self.max_pending = max_pending
        self._seen: OrderedDict[KVCacheEvent, int] = OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def add(self, events: Sequence[KVCacheEvent]) -> None:
        for event, n in Counter(events).items():
            count = self._seen.pop(event, 0) + n
            if isinstance(event, BlockRemoved) and count == n:
                self._ready.append(event)  # first report of a removal
            elif not isinstance(event, BlockRemoved) and count >= self.ranks > count - n:
                self._ready.append(event)  # the last rank's report of a store
            if count < self.ranks:
                self._seen[event] = count
        while len(self._seen) > self.max_pending:
            self._seen.popitem(last=False)

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready
