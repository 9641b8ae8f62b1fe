"""Sightings (second_hit's memory, one per store): counts per key like a model, bounded to its capacity by
forgetting the least recently seen; and a store with two second_hit lower tiers counts each sighting once."""

from __future__ import annotations

from collections import OrderedDict

import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import blocks_for
from kvtier import Namespace, TieredStore
from kvtier.offload import Sightings
from kvtier.tiers.dram import DramTier
from kvtier.tiers.ssd import DiskTier

BB = 4096


@given(st.integers(1, 6), st.lists(st.lists(st.integers(0, 9), max_size=4), max_size=30))
def test_sightings_count_like_a_bounded_lru_model(capacity, batches):
    s = Sightings(capacity)
    model: OrderedDict[bytes, int] = OrderedDict()
    for batch in batches:
        keys = [bytes([k]) for k in batch]
        s.see(keys)
        for k in keys:
            model[k] = model.get(k, 0) + 1
            model.move_to_end(k)
        while len(model) > capacity:
            model.popitem(last=False)
    every = [bytes([k]) for k in range(10)]
    assert s.counts(every) == [model.get(k, 0) for k in every]


class _OtherDisk(DiskTier):
    name = "ssd2"


def test_two_second_hit_lower_tiers_write_what_was_seen_twice_to_each_and_nothing_else(tmp_path):
    keys = Namespace("sightings").keys(range(6))
    data = blocks_for(keys, BB)
    dram = DramTier(2 * BB, BB, policy="lru")
    disks = [cls(str(tmp_path / cls.name), 16 * BB, BB, segment_bytes=8 * BB) for cls in (DiskTier, _OtherDisk)]
    store = TieredStore([dram, *disks], offload="second_hit", promote=False)
    try:
        store.put(keys[:2], data[:2])
        store.get(keys[:1], torch.zeros(1, BB, dtype=torch.uint8))  # 0: put and hit (twice); 1: once
        store.put(keys[2:4], data[2:4])  # evicts 0 and 1
        assert store.flush(20)
        for disk in disks:
            assert disk.contains(keys[:2]) == [True, False]
        assert [o["skipped_seen_once"] for o in store.stats()["offloads"].values()] == [1, 1]
    finally:
        store.close()
