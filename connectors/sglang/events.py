"""L3Events: what kvtier holds for an SGLang server, as SGLang KV events, so a KV-aware router sees its L3.

SGLang publishes its own radix tree's events (medium GPU for L1, CPU_PINNED for L2) but nothing for an L3
backend. This publishes kvtier's: ``BlockStored`` / ``BlockRemoved`` with SGLang's block hash of the page
(``hash_str_to_int64(page key)``, what SGLang's own events carry for a request without ``extra_key`` or
``cache_salt``; SGLang hashes salted requests' events with another seed, which an L3 backend never sees),
medium ``EXTERNAL`` for kvtier's DRAM and the pools, ``DISK`` for the SSD, through SGLang's own
``ZmqEventPublisher`` (the same wire format, topic and replay socket as ``--kv-events-config``) on the
endpoint the ``kv_events_endpoint`` key names, offset by the attention-DP rank as SGLang offsets its own.

Only the rank SGLang publishes from (PP, attention TP and CP rank 0) publishes: with MHA TP > 1 each rank
stores its own heads at the same time, so rank 0's store speaks for the others (a page one rank lost is a
shorter hit, which SGLang's MIN over ranks handles). Events are published at the end of each backend call
(a write-behind SSD write that lands between calls goes out with the next one).

Thread-safe: any backend thread records and publishes; the publisher has its own thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from sglang.srt.disaggregation.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    StorageMedium,
    ZmqEventPublisher,
)
from sglang.srt.mem_cache.utils import hash_str_to_int64

from kvtier.connectors.tier_events import TierEventNames

TIER_MEDIUM = {"dram": StorageMedium.EXTERNAL.value, "pool": StorageMedium.EXTERNAL.value,
               "ssd": StorageMedium.DISK.value}


class L3Events(TierEventNames):
    """Store events -> SGLang KV event batches on a ZMQ publisher (see the module docstring)."""

    def __init__(self, endpoint: str, *, page_size: int, attn_dp_rank: int = 0, replay_endpoint: str = "",
                 topic: str = "", holds: Callable[[Sequence[bytes]], list[bool]] | None = None) -> None:
        super().__init__(self._record, holds=holds)
        self.page_size = page_size
        self._events: list[BlockStored | BlockRemoved] = []
        self._publisher = ZmqEventPublisher(attn_dp_rank, endpoint, replay_endpoint or None, topic=topic)

    def _record(self, kind: str, tier: str, hashes: list[str]) -> None:
        medium = TIER_MEDIUM.get(tier, StorageMedium.EXTERNAL.value)
        ids = [hash_str_to_int64(h) for h in hashes]
        self._events.append(
            BlockStored(block_hashes=ids, parent_block_hash=None, token_ids=[], block_size=self.page_size,
                        lora_id=None, medium=medium)
            if kind == "stored" else BlockRemoved(block_hashes=ids, medium=medium))

    def take(self) -> list[BlockStored | BlockRemoved]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def publish(self) -> None:
        """Send what was recorded since the last call (nothing when nothing was)."""
        events = self.take()
        if events:
            self._publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def close(self) -> None:
        self.publish()
        self._publisher.shutdown()
