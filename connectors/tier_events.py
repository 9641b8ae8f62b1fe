"""TierEventNames: a store's per-tier key events turned back into the engine's own block names, for KV events.

A TieredStore announces which kvtier keys each tier gained or lost (``StoreEvent``); a KV-aware router wants
the engine's block hashes (vLLM's BlockHash bytes, SGLang's hex page keys). The connector names keys while
it puts or gets them (``naming``); this class remembers each named key's engine hash and the tiers that hold
it, and hands every stored/removed event, with engine hashes, to the connector's ``emit`` (which builds the
engine's own event objects: vLLM's in connectors/vllm/events.py, SGLang's in connectors/sglang/events.py).

It forgets a key's hash when the store holds the key nowhere: a block DRAM evicts is often still on its way
to the SSD (write-behind), and its "stored in ssd" event, which comes after DRAM's "removed", must still
find the hash. No engine import.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvtier.store.types import StoreEvent

# (kind "stored" or "removed", tier name, the engine hashes of the event's keys that have one)
Emit = Callable[[str, str, list[Any]], None]


class TierEventNames:
    """Store events -> (kind, tier, engine hashes) for ``emit``. Thread-safe: the store calls
    ``on_store_event`` from whichever thread changed a tier (DRAM's evictions: in the put that evicted, with the
    DRAM lock released); ``emit`` runs under this object's lock, so it must be short and must not call back into
    the store.

    ``holds`` (the store's ``contains(local_only=True)``: no tier lock, no round trip) says whether the store
    still holds keys that the tiers which reported them have all lost: such a key keeps its hash, in a bounded table of
    ``max_in_transit`` keys (a write that never lands must not grow it for ever). Without ``holds`` a key
    is forgotten as soon as no reporting tier holds it."""

    def __init__(self, emit: Emit, *, holds: Callable[[Sequence[bytes]], list[bool]] | None = None,
                 max_in_transit: int = 1 << 16) -> None:
        self._emit = emit
        self._holds = holds
        self._max_in_transit = max_in_transit
        self._lock = threading.Lock()
        self._known: dict[bytes, tuple[Any, set[str]]] = {}  # key -> (engine hash, tiers holding it)
        # Keys no tier reported holding, that the store still held (queued for the SSD) -> engine hash.
        self._in_transit: OrderedDict[bytes, Any] = OrderedDict()
        self._naming: dict[bytes, Any] = {}  # keys being put/got right now -> engine hash

    @contextmanager
    def naming(self, keys: Sequence[bytes], hashes: Sequence[Any]) -> Iterator[None]:
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
        hashes = []
        with self._lock:
            emptied = []
            for key in event.keys:
                entry = self._known.get(key)
                if event.kind == "stored":
                    h = entry[0] if entry is not None else self._in_transit.pop(key, None) or self._naming.get(key)
                    if h is None:
                        continue  # a block this process never named (e.g. restored from disk at start)
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
                self._emit(event.kind, event.tier, hashes)

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


__all__ = ["Emit", "TierEventNames"]
