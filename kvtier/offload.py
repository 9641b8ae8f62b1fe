"""Offload and promotion between a store's top tier (host DRAM) and each tier under it (the SSD, the remote pool).

Runs inside TieredStore, in the caller's process, on the threads of the store calls that trigger it; it holds
no bytes itself: the lower tier's ``put_later`` copies what is offloaded into its own staging memory before it
returns, so a DRAM slot can be reused at once and a write queued before DRAM evicts its block still lands.

One policy, by name:
  write_through  every block put into DRAM is also queued for the disk (the put waits for staging memory, so
                 under sustained load puts run at disk speed: that is what write-through means)
  on_evict       a block is written when DRAM evicts it, unless the disk holds it already
  second_hit     like on_evict, but only blocks seen at least twice (a put and a hit, or put again after it was
                 dropped): one-shot blocks, such as a subagent's private suffix, never cost a disk write
Every policy also writes, on eviction, a block that should be on the disk but is not (its write-through copy
was dropped: staging full, or the disk stopped admitting then).
Promotion (``promote``): a block served by the lower tier is copied into DRAM as well, so the session's next
turn finds it there; it stays on disk too, so evicting it again costs no write.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvtier.blocks import BlockRows
from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)

OFFLOAD_POLICIES = ("write_through", "on_evict", "second_hit")

Emit = Callable[[str, str, list[bytes]], None]  # (kind, tier name, keys): the store's event hook


class Offloader:
    """Moves blocks between ``top`` and ``lower`` by ``policy``. Thread-safe. ``on_top_evict`` is called under
    the top tier's lock and never waits; the other hooks run on the store caller's thread."""

    def __init__(self, top: Tier, lower: Tier, policy: str = "on_evict", *, promote: bool = True,
                 emit: Emit | None = None, seen_capacity: int = 1 << 16, index: int = 1) -> None:
        if policy not in OFFLOAD_POLICIES:
            raise ValueError(f"unknown offload policy {policy!r}; known: {', '.join(OFFLOAD_POLICIES)}")
        self.top, self.lower, self.policy, self.promote = top, lower, policy, promote
        self.index = index  # the lower tier's position in the store (the ``served`` value after_get sees)
        self._emit = emit or (lambda kind, tier, keys: None)
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # key -> sightings (second_hit), LRU-bounded
        self._seen_capacity = seen_capacity
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    # ---- hooks the store calls ----------------------------------------------------------------------

    def after_put(self, keys: Sequence[bytes], rows: BlockRows) -> None:
        """``keys`` were just stored in the top tier from ``rows`` (valid during this call)."""
        if self.policy == "second_hit":
            self._see(keys)
        elif self.policy == "write_through" and keys:
            self._offload(list(keys), rows, wait=True)

    def on_top_evict(self, keys: Sequence[bytes], views: Sequence[Any]) -> None:
        """The top tier evicts ``keys``; ``views`` of their bytes are valid during this call only."""
        # This runs under the top tier's lock: a remote tier's contains is a network round trip, so it answers
        # from what it knows locally (``held_locally``: sent or fetched recently); the pool skips the rest if held.
        held = self.lower.held_locally(keys) if getattr(self.lower, "remote", False) else self.lower.contains(keys)
        if self.policy == "second_hit":
            with self._lock:
                wanted = [i for i, k in enumerate(keys) if not held[i] and self._seen.get(k, 0) >= 2]
                self._counts["skipped_seen_once"] += len(keys) - sum(held) - len(wanted)
        else:
            wanted = [i for i, h in enumerate(held) if not h]
        if wanted:
            self._offload([keys[i] for i in wanted], [views[i] for i in wanted], wait=False)

    def after_borrow(self, keys: Sequence[bytes]) -> None:
        """``keys`` were hits read in place from the top tier (a connector's zero-copy borrow)."""
        if self.policy == "second_hit":
            self._see(keys)

    def after_get(self, keys: Sequence[bytes], served: Sequence[int], rows: BlockRows) -> None:
        """``served[i]`` is the index of the tier that served key i (-1: a miss); ``rows`` hold the bytes.
        Promotes what this offloader's lower tier served."""
        if self.policy == "second_hit":
            self._see([k for k, t in zip(keys, served) if t >= 0])
        if not self.promote:
            return
        below = [i for i, t in enumerate(served) if t == self.index]
        if not below:
            return
        up = [keys[i] for i in below]
        held = self.top.put(up, BlockRows(rows.ptrs[below], rows.owners))
        promoted = [k for k, h in zip(up, held) if h]
        with self._lock:
            self._counts["promoted"] += len(promoted)
        self._emit("stored", self.top.name, promoted)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every offload queued so far is written (or failed); False on timeout."""
        flush = getattr(self.lower, "flush", None)
        return True if flush is None else bool(flush(timeout))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"policy": self.policy, "promote": self.promote, **self._counts}

    # ---- internals ----------------------------------------------------------------------------------

    def _offload(self, keys: list[bytes], blocks: Any, *, wait: bool) -> None:
        with self._lock:
            self._counts["offered"] += len(keys)
        put_later = getattr(self.lower, "put_later", None)
        if put_later is None:  # a lower tier without write-behind: write now (under the top tier's lock)
            held = self.lower.put(keys, blocks)
            self._written([k for k, h in zip(keys, held) if h])
            return
        future: Future[list[bytes]] | None = put_later(keys, blocks, wait=wait)
        if future is None:  # the lower tier does not admit (disk full or failing): its stats say why
            with self._lock:
                self._counts["refused"] += len(keys)
            return
        future.add_done_callback(lambda f: self._written(f.result() if not f.exception() else []))

    def _written(self, stored: list[bytes]) -> None:
        with self._lock:
            self._counts["written"] += len(stored)
        self._emit("stored", self.lower.name, stored)

    def _see(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            seen = self._seen
            for k in keys:
                seen[k] = seen.get(k, 0) + 1
                seen.move_to_end(k)
            while len(seen) > self._seen_capacity:
                seen.popitem(last=False)

