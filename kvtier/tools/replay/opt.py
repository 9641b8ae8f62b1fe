"""The two limits a replay is compared with, computed offline on the replay's own block access stream.

* Infinite cache: every access to a block seen before is a hit.
* Belady's optimum (MIN) for a cache of ``capacity`` blocks: on a miss the block is kept if some held block
  is next used later than it, and the held block used farthest in the future is evicted; a block never used
  again is not kept (bypass). For unit-size blocks this maximises the number of hits over every way of
  managing the cache, online or offline, that only takes a block in when it is accessed.

What it bounds (see docs/replay.md "Trace replay"): the replayer's hits in HBM and in every store tier together. The
union of HBM and the store's tiers never holds more distinct blocks than the sum of their capacities, and a
block enters that union only when a request accesses it (it is computed then; demotions only move blocks
already inside). Any such system is one way of managing a cache of that summed capacity, so its block hits,
and so its prefix hits (hits only count up to a request's first miss), are at most MIN's at that capacity.
Hence, per replay: policy hit rate <= OPT <= infinite-cache hit rate, all in input tokens.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

_CHUNK = 1 << 16


def next_use(stream: np.ndarray) -> np.ndarray:
    """For each access i, the index of the next access to the same block, or len(stream) if none."""
    n = len(stream)
    out = np.full(n, n, dtype=np.int32 if n < 2**31 - 1 else np.int64)
    if n < 2:
        return out
    order = np.argsort(stream, kind="stable")  # positions grouped by block, in time order within a block
    sorted_ids = stream[order]
    same = sorted_ids[1:] == sorted_ids[:-1]
    del sorted_ids  # a 66M-access stream makes every temporary here hundreds of MB
    out[order[:-1][same]] = order[1:][same]
    return out


def infinite_hits(stream: np.ndarray) -> int:
    """Accesses to a block seen earlier in the stream."""
    return int(len(stream) - len(np.unique(stream))) if len(stream) else 0


def peak_reuse(nxt: np.ndarray) -> int:
    """The most blocks that are, at one moment, waiting for a later access (``nxt``: ``next_use``'s answer):
    a cache this large keeps every one of them, so its hits are the infinite cache's."""
    n = len(nxt)
    reused = nxt < n
    # Block accessed at t, next at m: waiting over steps t..m-1 (the access at m consumes it).
    waiting = np.cumsum(np.bincount(np.flatnonzero(reused), minlength=n) - np.bincount(nxt[reused], minlength=n))
    return int(waiting.max()) if n else 0


def belady_hits(stream: np.ndarray, capacity: int, nxt: np.ndarray | None = None) -> int:
    """Hits of Belady's MIN (with bypass) on ``stream`` with room for ``capacity`` blocks.

    The cache is tracked by next-use times only: a held block is represented by the index of its next access
    (``kept[i]`` is set while the block accessed at i is held, waiting for that access). Held entries are on
    a max-heap; entries consumed by a hit stay in the heap as stale values smaller than the current index,
    so the heap's top is always a held block while any is held, and stale entries are swept out in batches.
    Where ``capacity`` is at least ``peak_reuse`` nothing is ever evicted: every re-access hits, no loop.
    """
    n = len(stream)
    if capacity <= 0 or n == 0:
        return 0
    if nxt is None:
        nxt = next_use(stream)
    if capacity >= peak_reuse(nxt):
        return int(np.count_nonzero(nxt < n))
    kept = bytearray(n + 1)
    heap: list[int] = []  # -next_use of held blocks, plus stale entries (<= current index)
    held = hits = 0
    push, replace = heapq.heappush, heapq.heapreplace
    for base in range(0, n, _CHUNK):
        for t, m in enumerate(nxt[base:base + _CHUNK].tolist(), base):
            if kept[t]:
                hits += 1
                held -= 1
            if m == n:
                continue  # never used again: keeping it cannot help
            if held < capacity:
                push(heap, -m)
                kept[m] = 1
                held += 1
            elif -heap[0] > m:
                kept[-replace(heap, -m)] = 0
                kept[m] = 1
        if len(heap) > 2 * capacity + _CHUNK:
            end = base + _CHUNK
            heap = [v for v in heap if -v >= end]
            heapq.heapify(heap)
    return hits


@dataclass(frozen=True)
class Limits:
    """Hits (in block accesses) of the two limits on one stream."""

    accesses: int
    infinite: int
    opt: int
    capacity: int


class LimitsCache:
    """Memoises limits per (stream, capacity): runs whose request order did not change (a timed trace, or
    policies that happened to produce the same order) share one OPT computation. Not thread-safe."""

    def __init__(self) -> None:
        self._memo: dict[tuple[int, bytes, int], Limits] = {}
        self._next_use: dict[tuple[int, bytes], np.ndarray] = {}  # the last stream's only: it can be large

    def limits(self, stream: np.ndarray, capacity: int) -> Limits:
        import xxhash

        key = (len(stream), xxhash.xxh3_128_digest(np.ascontiguousarray(stream)), capacity)  # hashes in place
        got = self._memo.get(key)
        if got is None:
            nxt = self._next_use.get(key[:2])
            if nxt is None:  # one stream, several capacities (HBM + store, store alone): computed once
                self._next_use = {key[:2]: (nxt := next_use(stream))}
            got = Limits(len(stream), infinite_hits(stream), belady_hits(stream, capacity, nxt), capacity)
            self._memo[key] = got
        return got
