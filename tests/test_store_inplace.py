"""TieredStore.put_in_place beyond the state machine (test_store.py): concurrency, write-through, events,
a top tier without slots."""

import threading

import numpy as np
import pytest
import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import Namespace, StoreEvent, TieredStore
from kvtier.memory.hostcopy import copy_rows
from kvtier.tiers.ssd import DiskTier

BB = 4096
KEYS = Namespace("store-inplace").keys(range(16))


def fill_with(data: torch.Tensor):
    """A fill writing row i of ``data`` (one row per batch position) into the slot given for position i."""

    def fill(index, slots):
        copy_rows(slots.ptrs, np.array([data[i].data_ptr() for i in index], np.uint64), BB)

    return fill


def test_a_block_being_filled_is_in_flight_for_others_and_invisible_until_published():
    store = TieredStore.from_config({"dram_capacity": 8 * BB}, BB)
    keys, data = KEYS[:4], blocks_for(KEYS[:4], BB)
    entered, gate = threading.Event(), threading.Event()

    def slow_fill(index, slots):
        entered.set()
        assert gate.wait(10)
        fill_with(data)(index, slots)

    results = []
    first = threading.Thread(target=lambda: results.append(store.put_in_place(keys, slow_fill)))
    first.start()
    assert entered.wait(10)
    assert store.contains(keys) == [False] * 4  # reserved, not published
    assert store.get(keys, torch.zeros(4, BB, dtype=torch.uint8)) == [False] * 4
    again = store.put_in_place(keys, fill_with(torch.zeros(4, BB, dtype=torch.uint8)))
    copied = store.put(keys, torch.zeros(4, BB, dtype=torch.uint8))
    assert (again.stored, again.skipped) == (0, 4) and (copied.stored, copied.skipped) == (0, 4)
    gate.set()
    first.join(10)
    assert results[0].stored == 4 and results[0].ok
    out = torch.zeros(4, BB, dtype=torch.uint8)
    assert_all_hits_exact(store.get(keys, out), out, data)
    store.close()


def test_fill_gets_only_new_keys_and_events_and_counters_match_put():
    store = TieredStore.from_config({"dram_capacity": 8 * BB}, BB)
    events: list[StoreEvent] = []
    store.add_listener(events.append)
    keys, data = KEYS[:5], blocks_for(KEYS[:5], BB)
    store.put(keys[1:3], data[1:3])
    seen = []

    def fill(index, slots):
        seen.append(list(index))
        fill_with(data)(index, slots)

    res = store.put_in_place(keys + keys[:1], fill)  # a repeated key is written once
    assert seen == [[0, 3, 4]] and (res.stored, res.skipped, res.rejected) == (3, 3, [])
    assert events[-1] == StoreEvent("stored", "dram", [keys[0], keys[3], keys[4]])
    assert store.stats()["put_stored"] == 5 and store.stats()["put_skipped"] == 3
    assert store.put_in_place(keys, fill).stored == 0 and len(seen) == 1  # nothing new: fill not called
    store.close()


def test_rejected_when_pinned_blocks_fill_dram_and_nothing_leaks():
    store = TieredStore.from_config({"dram_capacity": 2 * BB}, BB)
    store.put(KEYS[:2], blocks_for(KEYS[:2], BB))
    store.pin(KEYS[:2])
    res = store.put_in_place(KEYS[2:4], fill_with(blocks_for(KEYS[2:4], BB)))
    assert res.rejected == KEYS[2:4] and res.stored == 0
    assert store.contains(KEYS[:4]) == [True, True, False, False]
    store.unpin(KEYS[:2])
    assert store.put_in_place(KEYS[2:4], fill_with(blocks_for(KEYS[2:4], BB))).stored == 2
    dram = store.stats()["tiers"]["dram"]
    assert dram["used_bytes"] == 2 * BB and dram["extra"]["pending"] == 0
    store.close()


def test_write_through_copies_the_filled_slots_to_the_ssd(tmp_path):
    store = TieredStore.from_config({"dram_capacity": 4 * BB, "ssd_path": str(tmp_path), "ssd_capacity": 64 * BB,
                                     "ssd_segment_bytes": 8 * BB, "ssd_offload": "write_through"}, BB)
    keys, data = KEYS[:3], blocks_for(KEYS[:3], BB)
    assert store.put_in_place(keys, fill_with(data)).stored == 3
    assert store.flush(10)
    assert store.tiers[1].contains(keys) == [True] * 3
    store.tiers[0].remove(keys)  # read them back from the SSD alone
    out = torch.zeros(3, BB, dtype=torch.uint8)
    assert_all_hits_exact(store.get(keys, out), out, data)
    store.close()


def test_a_failed_fill_raises_frees_its_slots_and_writes_nothing_through(tmp_path):
    store = TieredStore.from_config({"dram_capacity": 4 * BB, "ssd_path": str(tmp_path), "ssd_capacity": 64 * BB,
                                     "ssd_segment_bytes": 8 * BB, "ssd_offload": "write_through"}, BB)

    def broken(index, slots):
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        store.put_in_place(KEYS[:4], broken)
    assert store.flush(10)
    assert store.contains(KEYS[:4]) == [False] * 4
    stats = store.stats()
    assert stats["tiers"]["dram"]["used_bytes"] == 0 and stats["inflight_puts"] == 0
    assert store.put_in_place(KEYS[:4], fill_with(blocks_for(KEYS[:4], BB))).stored == 4  # all four slots back
    store.close()


def test_a_top_tier_without_slots_keeps_put_only(tmp_path):
    store = TieredStore([DiskTier(str(tmp_path), 64 * BB, BB, segment_bytes=8 * BB)])
    assert not store.writes_in_place
    with pytest.raises(TypeError, match="top tier 'ssd' has no addressable slots.*use put"):
        store.put_in_place(KEYS[:1], fill_with(blocks_for(KEYS[:1], BB)))
    assert store.put(KEYS[:1], blocks_for(KEYS[:1], BB)).stored == 1
    store.close()
    with TieredStore.from_config({"dram_capacity": 4 * BB}, BB) as store:
        assert store.writes_in_place


def test_a_held_block_of_the_batch_evicted_before_the_reservation_leaks_nothing(monkeypatch):
    """The batch's blocks the top tier holds are only protected from eviction, never reserved: one removed by
    another thread between the store's look and its reservation is not reserved under a wrong position
    (that raised and left the reservation's slots pending for ever)."""
    store = TieredStore.from_config({"dram_capacity": 8 * BB}, BB)
    top = store.tiers[0]
    keys, data = KEYS[:4], blocks_for(KEYS[:4], BB)
    store.put(keys[:2], data[:2])
    real, looks = top.contains, []

    def contains_then_removed(ks):
        held = real(ks)
        looks.append(len(ks))
        if len(looks) == 1:  # put_in_place's one look (its plan's); then another thread removes one
            top.remove([keys[0]])
        return held
    monkeypatch.setattr(top, "contains", contains_then_removed)
    result = store.put_in_place(keys, fill_with(data))
    monkeypatch.undo()
    assert result.stored == 2 and not top._pending  # the new two published, no slot left reserved
    assert store.contains(keys) == [False, True, True, True]
    assert store.put(keys, data).stored == 1  # the removed one can be stored again
    out = torch.zeros_like(data)
    assert_all_hits_exact(store.get(keys, out), out, data)
    assert top.stats().used_bytes == 4 * BB


def test_concurrent_evictions_never_leak_a_reservation():
    store = TieredStore.from_config({"dram_capacity": 8 * BB}, BB)
    top = store.tiers[0]
    keys = Namespace("inplace-churn").keys(range(64))
    data = blocks_for(keys, BB)
    stop = threading.Event()

    def churn():  # other puts evicting the top tier's blocks all the time
        i = 0
        while not stop.is_set():
            j = i % 60
            store.put(keys[j + 4: j + 8], data[j + 4: j + 8])
            i += 1
    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(2000):
            store.put(keys[:2], data[:2])
            store.put_in_place(keys[:4], fill_with(data))  # two held (if not evicted meanwhile), two new
    finally:
        stop.set()
        t.join()
    assert not top._pending and top.stats().used_bytes <= 8 * BB
    out = torch.zeros(4, BB, dtype=torch.uint8)
    assert store.get(keys[:4], out) == store.contains(keys[:4])
    assert all(torch.equal(out[i], data[i]) for i, h in enumerate(store.contains(keys[:4])) if h)
