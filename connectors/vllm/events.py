"""KV events for KV-aware routers: which engine blocks kvtier holds, and in which medium.

Worker side, ``EventRecorder`` listens to the store (``TieredStore.add_listener``) and turns its per-tier
stored/removed keys back into vLLM ``BlockStored`` / ``BlockRemoved`` events carrying the engine's own block
hashes, with medium CPU for host DRAM and STORAGE for the SSD, as vLLM's native offloading reports them.
Which key has which engine hash, and for how long, is kvtier.connectors.tier_events (shared with the SGLang
connector).

The events travel to the scheduler in ``KVTierKVEvents`` (vLLM concatenates every worker's), where
``EventQuorum`` publishes a stored block once every rank reported it (a prefix is loadable only when all
ranks hold their slice) and a removed block as soon as one rank lost it. It counts per (block, medium), not
per event: each rank batches its own SSD writes, so the ranks' events about one block rarely match whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

from kvtier.connectors.tier_events import TierEventNames

from .groups import GroupSpec

TIER_MEDIUM = {"dram": MEDIUM_CPU, "ssd": MEDIUM_STORAGE}


@dataclass(frozen=True)
class EventGroup:
    """What a KV event says of the cache group its blocks belong to (vLLM's ``group_idx``,
    ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``), so a router can tell a sliding-window
    block from a full-attention one."""

    kind: str = "full_attention"  # vLLM's KVCacheSpecKind value
    sliding_window: int | None = None


class EventRecorder(TierEventNames):
    """Store events -> vLLM KV events, for one worker (the naming and its thread-safety:
    kvtier.connectors.tier_events.TierEventNames). Keys are named ``(engine hash, group index)``; one event per
    group carries that group's index and kind (``groups``, by index; a group not there: full attention).
    ``mediums`` maps a tier name to vLLM's medium (others: the tier name upper-cased)."""

    def __init__(self, block_size: int, mediums: Mapping[str, str] = TIER_MEDIUM, *,
                 holds: Callable[[Sequence[bytes]], list[bool]] | None = None, max_in_transit: int = 1 << 16,
                 groups: Mapping[int, EventGroup] | None = None) -> None:
        super().__init__(self._record, holds=holds, max_in_transit=max_in_transit)
        self.block_size = block_size
        self._mediums = dict(mediums)
        self._groups = dict(groups or {})
        self._events: list[KVCacheEvent] = []

    def _record(self, kind: str, tier: str, names: list[tuple[bytes, int]]) -> None:
        medium = self._mediums.get(tier, tier.upper())
        by_group: dict[int, list[Any]] = {}
        for h, group in names:
            by_group.setdefault(group, []).append(maybe_convert_block_hash(h))
        for group, ext in by_group.items():
            spec = self._groups.get(group, EventGroup())
            self._events.append(
                BlockStored(block_hashes=ext, parent_block_hash=None, token_ids=[], block_size=self.block_size,
                            lora_id=None, medium=medium, lora_name=None, group_idx=group,
                            kv_cache_spec_kind=spec.kind, kv_cache_spec_sliding_window=spec.sliding_window)
                if kind == "stored" else BlockRemoved(block_hashes=ext, medium=medium, group_idx=group))

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


def event_group(group: GroupSpec) -> EventGroup:
    """The KV events' view of a cache group: vLLM's own kind name for its spec, and its window."""
    return EventGroup(kind=get_kv_cache_spec_kind(group.spec).value if group.spec is not None else "full_attention",
                      sliding_window=group.window or None)
