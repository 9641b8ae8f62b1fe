"""Belady's optimum and the infinite cache against brute force and a plain reference implementation."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tools.replay import opt
from kvtier.tools.replay.opt import LimitsCache, belady_hits, infinite_hits, next_use, peak_reuse
from replaykit import brute_force_opt


def reference_belady(stream: list[int], capacity: int) -> int:
    """Textbook MIN with bypass: explicit held set, evict (or skip) the farthest next use."""
    nxt = next_use(np.asarray(stream)).tolist()
    held: dict[int, int] = {}  # block -> index of its next use
    hits = 0
    for t, b in enumerate(stream):
        if b in held:
            hits += 1
            del held[b]
        if nxt[t] == len(stream):
            continue
        if len(held) < capacity:
            held[b] = nxt[t]
        else:
            far = max(held, key=held.__getitem__)
            if held[far] > nxt[t]:
                del held[far]
                held[b] = nxt[t]
    return hits


def test_next_use():
    s = np.array([5, 1, 5, 2, 1, 5])
    assert next_use(s).tolist() == [2, 4, 5, 6, 6, 6]
    assert next_use(np.array([], dtype=np.int32)).tolist() == []
    assert infinite_hits(s) == 3


@settings(max_examples=200, deadline=None)
@given(stream=st.lists(st.integers(0, 5), max_size=13), capacity=st.integers(0, 3))
def test_belady_is_optimal(stream, capacity):
    assert belady_hits(np.asarray(stream, dtype=np.int32), capacity) == brute_force_opt(stream, capacity)


@pytest.mark.parametrize("chunk", [3, 64])
def test_belady_with_heap_sweeps_matches_reference(monkeypatch, chunk):
    """Small chunks force the stale-entry sweep many times; results must not change."""
    monkeypatch.setattr(opt, "_CHUNK", chunk)
    rng = np.random.default_rng(7)
    for capacity in (1, 4, 17):
        stream = rng.zipf(1.3, 3000) % 200
        assert belady_hits(stream, capacity) == reference_belady(stream.tolist(), capacity)


def reference_peak_reuse(stream: list[int]) -> int:
    """After each access: how many blocks seen so far are accessed again later; the largest count."""
    return max((len({b for b in stream[:t + 1] if b in stream[t + 1:]}) for t in range(len(stream))), default=0)


@settings(max_examples=300, deadline=None)
@given(stream=st.lists(st.integers(0, 9), max_size=40))
def test_peak_reuse_is_the_smallest_cache_that_reaches_the_infinite_cache(stream):
    """At capacity >= peak_reuse belady_hits answers without its loop: the infinite cache's hits. The bound is
    tight (one block less and MIN misses), and the loop agrees with the shortcut where both apply."""
    s = np.asarray(stream, dtype=np.int32)
    peak = peak_reuse(next_use(s))
    assert peak == reference_peak_reuse(stream)
    for capacity in range(max(peak - 2, 1), peak + 2):  # (the reference needs room for one)
        assert belady_hits(s, capacity) == reference_belady(stream, capacity)
    if peak > 0:
        assert belady_hits(s, peak) == infinite_hits(s) > belady_hits(s, peak - 1)


def test_limits_are_memoised_per_stream_and_capacity():
    cache = LimitsCache()
    s = np.array([1, 2, 1, 3, 2, 1], dtype=np.int32)
    a = cache.limits(s, 1)
    assert cache.limits(s.copy(), 1) is a
    assert cache.limits(s, 2) is not a and cache.limits(s, 2).opt >= a.opt
    assert (a.accesses, a.infinite) == (6, 3)
