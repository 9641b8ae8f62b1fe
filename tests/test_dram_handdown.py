"""DRAM hands its evictions down with its lock released (issue 16 item 8): a lower tier that stages nothing
(``ssd_staging_bytes=0``: the offload writes the disk synchronously) and a store listener that asks the store
(the KV-event recorder's ``store.contains``, a master RPC in distributed mode) must not stall every other DRAM
call; the evicted blocks stay readable in DRAM until the lower tier has them, and their slots are not reused
while a reader still copies from them."""

from __future__ import annotations

import threading
from typing import Any

import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import Namespace, StoreEvent, TieredStore
from kvtier.tiers.dram import DramTier
from kvtier.tiers.ssd import DiskTier

BB = 4096
KEYS = Namespace("handdown").keys(range(8))
DATA = blocks_for(KEYS, BB)
PROBE_S = 20.0  # a probe that is not done by then was blocked (only a broken tier takes that long)


class _Probe:
    """From another thread, while an eviction is being handed down: DRAM reads of a resident block and of the
    victims, and the store's own contains (what the event recorder asks)."""

    def __init__(self, store: TieredStore, resident: bytes) -> None:
        self.store, self.resident = store, resident
        self.results: list[Any] = []

    def run(self, victims: list[bytes]) -> None:
        def probe() -> None:
            dram = self.store.tiers[0]
            out = torch.zeros(1, BB, dtype=torch.uint8)
            resident_hit = dram.get([self.resident], out) == [True] and torch.equal(out[0], DATA[KEYS.index(self.resident)])
            held = self.store.contains(victims)
            vout = torch.zeros(len(victims), BB, dtype=torch.uint8)
            victims_hit = dram.get(victims, vout)
            right = all(torch.equal(vout[i], DATA[KEYS.index(k)]) for i, k in enumerate(victims))
            self.results.append((resident_hit, held, victims_hit, right))

        t = threading.Thread(target=probe)
        t.start()
        t.join(PROBE_S)
        self.results.append("done" if not t.is_alive() else "blocked")


class _ProbingDisk(DiskTier):
    """A real DiskTier (no staging: each put_later writes before it returns) that runs a probe first."""

    probe: _Probe | None = None

    def put_later(self, keys, blocks, *, wait):
        if self.probe is not None:
            self.probe.run(list(keys))
        return super().put_later(keys, blocks, wait=wait)


def _store(tmp_path, disk_cls=DiskTier, staging_bytes=0) -> tuple[TieredStore, DiskTier]:
    dram = DramTier(2 * BB, BB, policy="lru")
    disk = disk_cls(str(tmp_path), 32 * BB, BB, segment_bytes=8 * BB, staging_bytes=staging_bytes)
    return TieredStore([dram, disk], offload="on_evict", promote=False), disk


def test_a_synchronous_disk_write_on_eviction_leaves_dram_free_and_the_victim_readable(tmp_path):
    store, disk = _store(tmp_path, _ProbingDisk)
    try:
        store.put(KEYS[:2], DATA[:2])
        store.get(KEYS[1:2], torch.zeros(1, BB, dtype=torch.uint8))  # 0 is the LRU victim, 1 stays
        disk.probe = probe = _Probe(store, KEYS[1])
        assert store.put(KEYS[2:3], DATA[2:3]).stored == 1  # evicts 0, written to disk synchronously
        assert probe.results[-1] == "done", "a DRAM call blocked while the eviction was written to disk"
        assert probe.results[0] == (True, [True], [True], True)  # leaving: still held and readable in DRAM
        assert disk.contains(KEYS[:1]) == [True] and list(store.tiers[0].contains(KEYS[:1])) == [False]
        out = torch.zeros(3, BB, dtype=torch.uint8)
        assert_all_hits_exact(store.get(KEYS[:3], out), out, DATA[:3])
    finally:
        store.close()


def test_a_store_listener_that_asks_the_store_on_eviction_leaves_dram_free(tmp_path):
    """The KV-event recorder's holds (store.contains: a master RPC with a distributed pool) runs in the eviction
    callback; with staging the disk write is queued, so only the listener could stall DRAM."""
    store, _disk = _store(tmp_path, staging_bytes=8 * BB)
    try:
        store.put(KEYS[:2], DATA[:2])
        store.get(KEYS[1:2], torch.zeros(1, BB, dtype=torch.uint8))
        probe = _Probe(store, KEYS[1])

        def listener(event: StoreEvent) -> None:
            if event.kind == "removed" and event.tier == "dram":
                probe.run(event.keys)

        store.add_listener(listener)
        store.put(KEYS[2:3], DATA[2:3])
        assert probe.results[-1] == "done", "a DRAM call blocked while a store listener ran on an eviction"
        assert probe.results[0] == (True, [True], [True], True)
    finally:
        store.close()


def test_a_reader_of_a_leaving_block_keeps_its_slot_and_the_put_does_not_wait_for_it(tmp_path):
    """A reader that acquired the victim while it was being handed down (a borrow, a pool client's acquire lease)
    reads the victim's bytes to the end, never the new block's, and the put that evicted does not wait for it:
    the new block gets another slot, or (none free) DRAM refuses it and it goes down as if evicted."""
    acquired, release, read = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    class _ReadDuringHandDown(DiskTier):
        def put_later(self, keys, blocks, *, wait):
            if not acquired.is_set():
                def reader() -> None:
                    with store.tiers[0].acquire(list(keys)) as addresses:
                        acquired.set()
                        release.wait(PROBE_S)
                        view = torch.frombuffer(ctypes_buffer(addresses[0]), dtype=torch.uint8)
                        seen.append(torch.equal(view, DATA[KEYS.index(keys[0])]))
                    read.set()

                threading.Thread(target=reader).start()
                acquired.wait(PROBE_S)
            return super().put_later(keys, blocks, wait=wait)

    store, disk = _store(tmp_path, _ReadDuringHandDown)
    try:
        store.put(KEYS[:2], DATA[:2])
        putter = threading.Thread(target=store.put, args=(KEYS[2:3], DATA[2:3]))  # evicts 0
        putter.start()
        putter.join(PROBE_S)
        assert acquired.is_set() and not putter.is_alive(), "the put waited for a reader of the evicted block"
        dram = store.tiers[0]
        assert list(dram.contains(KEYS[:3])) == [False, True, False]  # no free slot while 0's is read: 2 was refused
        release.set()
        assert read.wait(PROBE_S) and seen == [True], "the slot was reused while a reader copied from it"
        assert store.flush(PROBE_S) and disk.contains(KEYS[:3]) == [True, False, True]  # 2 went down as evicted
        out = torch.zeros(3, BB, dtype=torch.uint8)
        assert_all_hits_exact(store.get(KEYS[:3], out), out, DATA[:3])
        assert store.put(KEYS[3:4], DATA[3:4]).stored == 1  # 0's old slot is free again once read
        assert dram.stats().extra["pending"] == 0 and dram.stats().used_bytes <= 2 * BB
    finally:
        release.set()
        store.close()


def test_a_remove_of_a_block_being_handed_down_drops_it_below_too(tmp_path):
    """store.remove asks the tiers in order; DRAM waits for the block's hand-down, so the disk has it by the
    time the store asks the disk, and no tier holds it afterwards."""
    removed: list[int] = []

    class _RemoveDuringHandDown(DiskTier):
        def put_later(self, keys, blocks, *, wait):
            remover = threading.Thread(target=lambda: removed.append(store.remove(list(keys))))
            remover.start()
            remover.join(0.2)  # a remove that does not wait for the hand-down is done by now (on a quiet machine)
            self.remover = remover
            return super().put_later(keys, blocks, wait=wait)

    store, disk = _store(tmp_path, _RemoveDuringHandDown)
    try:
        store.put(KEYS[:2], DATA[:2])
        store.put(KEYS[2:3], DATA[2:3])  # evicts 0
        disk.remover.join(PROBE_S)
        assert removed == [1] and store.contains(KEYS[:1]) == [False] and disk.contains(KEYS[:1]) == [False]
    finally:
        store.close()


def ctypes_buffer(address: int) -> Any:
    import ctypes

    return (ctypes.c_uint8 * BB).from_address(address)


def test_concurrent_puts_gets_and_removes_over_a_synchronous_disk_read_only_right_bytes_and_leak_no_slot(tmp_path):
    """Threads putting, getting and removing over a 3-block DRAM that evicts into a disk without staging: every
    hit has its key's bytes, and afterwards every DRAM slot in use holds a block (none leaked by a hand-down)."""
    keys = Namespace("handdown-stress").keys(range(12))
    data = blocks_for(keys, BB)
    dram = DramTier(3 * BB, BB, policy="lru")
    disk = DiskTier(str(tmp_path), 64 * BB, BB, segment_bytes=8 * BB, staging_bytes=0)
    store = TieredStore([dram, disk], offload="on_evict", promote=True)
    errors: list[str] = []

    def worker(seed: int) -> None:
        import random

        rnd = random.Random(seed)
        out = torch.zeros(2, BB, dtype=torch.uint8)
        try:
            ops(rnd, out)
        except Exception as e:  # an error in a worker thread fails the test
            errors.append(repr(e))

    def ops(rnd: Any, out: torch.Tensor) -> None:
        for _ in range(150):
            i, j = rnd.randrange(12), rnd.randrange(12)
            op = rnd.random()
            if op < 0.45:
                store.put([keys[i], keys[j]] if i != j else [keys[i]], data[[i, j]] if i != j else data[[i]])
            elif op < 0.9:
                out.zero_()
                hit = store.get([keys[i], keys[j]], out)
                for h, k, row in zip(hit, (i, j), out):
                    if h and not torch.equal(row, data[k]):
                        errors.append(f"wrong bytes for key {k}")
            else:
                store.remove([keys[i]])

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads) and errors == []
        st = dram.stats()
        assert st.extra["pending"] == 0 and st.used_bytes == st.blocks * BB
        assert {k for k, h in zip(keys, dram.contains(keys)) if h} == set(dram.keys())  # nothing left leaving
    finally:
        store.close()
