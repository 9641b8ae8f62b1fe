"""Promotion goes through the store's own put path (issue 16 item 3): a block a lower tier served is copied into
DRAM once, counted once and announced once, even when two threads read it from below at the same time."""

from __future__ import annotations

import threading

import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import Namespace, StoreEvent, TieredStore
from kvtier.tiers.dram import DramTier
from kvtier.tiers.ssd import DiskTier

BB = 4096
KEYS = Namespace("promotion").keys(range(8))
DATA = blocks_for(KEYS, BB)


class _BarrierDisk(DiskTier):
    """A real DiskTier whose gets of ``gated`` keys meet at a barrier: both readers are served from disk."""

    barrier: threading.Barrier | None = None

    def get(self, keys, out):
        hit = super().get(keys, out)
        if self.barrier is not None:
            self.barrier.wait(20)
        return hit


def _store(tmp_path, disk_cls=DiskTier):
    dram = DramTier(4 * BB, BB, policy="lru")
    disk = disk_cls(str(tmp_path), 32 * BB, BB, segment_bytes=8 * BB)
    store = TieredStore([dram, disk], offload="on_evict", promote=True)
    store.put(KEYS[:4], DATA[:4])
    store.put(KEYS[4:8], DATA[4:8])  # evicts 0..3 to disk
    assert store.flush(20) and list(dram.contains(KEYS[:4])) == [False] * 4 and disk.contains(KEYS[:4]) == [True] * 4
    return store, dram, disk


def test_a_promotion_is_counted_and_announced_once_by_the_store(tmp_path):
    store, dram, _disk = _store(tmp_path)
    try:
        events: list[StoreEvent] = []
        store.add_listener(events.append)
        out = torch.zeros(2, BB, dtype=torch.uint8)
        assert_all_hits_exact(store.get(KEYS[:2], out), out, DATA[:2])
        assert list(dram.contains(KEYS[:2])) == [True, True]
        stats = store.stats()
        assert stats["promoted"] == 2 and stats["offload"]["promoted"] == 2
        assert stats["put_stored"] == 8  # promotions are not the caller's puts
        # DRAM's victims reach the disk by write-behind meanwhile (the ssd's events, whenever its thread gets there)
        stored = [e for e in events if e.kind == "stored" and e.tier == "dram"]
        assert stored == [StoreEvent("stored", "dram", KEYS[:2])]
    finally:
        store.close()


def test_two_readers_of_one_block_below_promote_it_once(tmp_path):
    store, dram, disk = _store(tmp_path, _BarrierDisk)
    try:
        events: list[StoreEvent] = []
        store.add_listener(events.append)
        disk.barrier = threading.Barrier(2)
        outs = [torch.zeros(1, BB, dtype=torch.uint8) for _ in range(2)]
        hits: list[list[bool]] = []
        readers = [threading.Thread(target=lambda o=o: hits.append(store.get(KEYS[:1], o))) for o in outs]
        for t in readers:
            t.start()
        for t in readers:
            t.join(30)
        assert hits == [[True], [True]] and all(torch.equal(o[0], DATA[0]) for o in outs)
        assert list(dram.contains(KEYS[:1])) == [True]
        stored = [e for e in events if e.kind == "stored" and e.tier == "dram"]
        assert stored == [StoreEvent("stored", "dram", KEYS[:1])], "promoted (and announced) twice"
        assert store.stats()["offload"]["promoted"] == 1
    finally:
        store.close()
