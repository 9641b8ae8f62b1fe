"""Lookups in one pass: the store's batch answers (contains, lookup_prefix's length and runs, pin) equal what
asking each tier about each key alone gives, and the DRAM tier's native index of held keys agrees with its
key -> slot map through puts, removes, evictions and hand-downs."""

from __future__ import annotations

import threading
from itertools import groupby

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import blocks_for
from kvtier.keys import Namespace
from kvtier.pins import PinTable
from kvtier.store import TieredStore
from kvtier.store.types import StoreLookup
from kvtier.tiers.dram import DramTier
from kvtier.tiers.ssd import DiskTier

BB = 4096
KEYS = Namespace("lookup-test").keys(range(48))


def per_key_tier(store: TieredStore, key: bytes) -> str | None:
    """The oracle: the first tier that, asked about this key alone, holds it."""
    return next((t.name for t in store.tiers if list(t.contains([key])) == [True]), None)


@settings(max_examples=60, deadline=None)
@given(held=st.lists(st.sampled_from(["dram", "ssd", "both", "none"]), min_size=1, max_size=24),
       order=st.lists(st.integers(0, 47), max_size=40))
def test_batch_answers_equal_per_key_answers(tmp_path_factory, held, order):
    dram = DramTier(32 * BB, BB, policy="lru")
    ssd = DiskTier(tmp_path_factory.mktemp("ssd"), 64 * BB, BB, segment_bytes=16 * BB, direct_io="false",
                   staging_bytes=0)
    with TieredStore([dram, ssd], offload="on_evict") as store:
        for k, where in zip(KEYS, held):
            if where in ("dram", "both"):
                dram.put([k], blocks_for([k], BB))
            if where in ("ssd", "both"):
                ssd.put([k], blocks_for([k], BB))
        asked = [KEYS[i] for i in order]  # repeats, unheld keys and keys never put, in any order
        truth = [per_key_tier(store, k) for k in asked]
        assert store.contains(asked) == [t is not None for t in truth]
        assert store.contains(asked, local_only=True) == [t is not None for t in truth]  # both tiers are local
        length = truth.index(None) if None in truth else len(truth)
        runs = [(t, len(list(run))) for t, run in groupby(truth[:length])]
        found = store.lookup_prefix(asked)
        assert found == StoreLookup(length, runs)
        assert found.tiers == truth[:length]  # the compatibility view: one (highest) tier name per held key
        assert [found.count(t) for t in ("dram", "ssd")] == [truth[:length].count(t) for t in ("dram", "ssd")]
        assert [found.count("ssd", upto=u) for u in range(length + 2)] == [
            truth[: min(u, length)].count("ssd") for u in range(length + 2)]
        pinned = store.lookup_prefix(asked, pin=True)
        assert pinned == found
        assert all(store.pins.count(k) == asked[:length].count(k) for k in set(asked))
        store.unpin(asked[:length])
        assert store.pin(asked) == [t is not None for t in truth]
        store.unpin([k for k, t in zip(asked, truth) if t is not None])
        assert len(store.pins) == 0


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "remove"]), st.integers(0, 47), st.integers(1, 12)),
                    max_size=30))
def test_the_dram_index_agrees_with_its_slot_map_through_evictions(ops):
    """A DRAM of 16 slots under puts and removes of 48 keys: evictions happen often. Nothing is leaving between
    calls, so what the tier holds is exactly its key -> slot map (``keys()``, a dict snapshot)."""
    dram = DramTier(16 * BB, BB, policy="lru")
    for op, start, n in ops:
        ks = KEYS[start : start + n]
        if op == "put":
            dram.put(ks, blocks_for(ks, BB))
        else:
            dram.remove(ks)
        held = set(dram.keys())
        assert dram.contains(KEYS).tolist() == [k in held for k in KEYS]
    dram.close()
    assert not dram.contains(KEYS).any()


def test_a_key_put_again_while_it_is_handed_down_stays_held_after_the_hand_down():
    """Evicted (leaving, handed down outside the lock), put again meanwhile from the listener, then the hand-down
    ends: the key is held (in the slot map and in the index), not dropped with its leaving state."""
    dram = DramTier(2 * BB, BB, policy="lru")
    seen: list[bool] = []
    again = threading.Event()

    def on_evict(keys, views):
        seen.append(bool(dram.contains(keys).all()))  # leaving: still held here while it goes down
        if not again.is_set():
            again.set()
            dram.put(keys[:1], blocks_for(keys[:1], BB))  # back in (evicting the other block)

    dram.attach(PinTable(), on_evict)
    dram.put(KEYS[:2], blocks_for(KEYS[:2], BB))
    dram.put(KEYS[2:3], blocks_for(KEYS[2:3], BB))  # evicts KEYS[0] (LRU), whose hand-down puts it back
    assert seen and all(seen)
    assert KEYS[0] in dram.keys()
    assert dram.contains(KEYS[:3]).tolist() == [k in set(dram.keys()) for k in KEYS[:3]]
    assert dram.contains(KEYS[:1]).tolist() == [True]
    dram.close()


@pytest.mark.parametrize("bad", [b"short", b"x" * 17, "a string of sixteen"[:16]])
def test_a_lookup_with_a_key_of_the_wrong_length_or_type_is_refused_by_name(bad):
    store = TieredStore.from_config({"dram_capacity": 4 * BB}, BB)
    store.put(KEYS[:2], blocks_for(KEYS[:2], BB))
    for call in (store.contains, store.lookup_prefix, store.tiers[0].contains):
        with pytest.raises(ValueError, match="key 1: expected 16 bytes"):
            call([KEYS[0], bad, KEYS[1]])
    assert store.contains(KEYS[:3]) == [True, True, False]  # nothing lost
    store.close()
