"""How often one store call asks the DRAM tier about a key (issue 28, item 4): a get of blocks only the SSD holds
asks DRAM once per key in its tier walk (the get that misses), and its promotion asks once more, in the same step
that takes the slot (DramTier.put_new's reserve, under DRAM's lock: another reader may have promoted the block
since the miss). No ``contains`` before the promotion's claim, no index probe of keys known absent when they are
published. The promotion still stores a block once, counts and announces only what it stored."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import Namespace, StoreEvent, TieredStore
from kvtier.keys.table import key_bytes
from kvtier.tiers.dram import DramTier
from kvtier.tiers.ssd import DiskTier

BB = 4096
N = 8
KEYS = Namespace("store-lookups").keys(range(2 * N))
DATA = blocks_for(KEYS, BB)


class DramAsks:
    """Counts, per key of ``watch``, each question a DRAM tier is asked about it: a read (contains, get,
    acquire, touch), the check-and-take of a write (reserve), a probe of its native index of held keys
    (KeyTable.find: contains answers from it, and a publish asked it before inserting)."""

    def __init__(self, dram: DramTier, watch: Sequence[bytes]) -> None:
        self.watch = set(watch)
        self.asks: Counter[tuple[str, bytes]] = Counter()
        self.on = False
        for name in ("contains", "get", "acquire", "touch", "reserve"):
            setattr(dram, name, self._counting(name, getattr(dram, name), list))
        index = dram._table.index
        index.find = self._counting("index", index.find, key_bytes)

    def _counting(self, what, call, keys_of):
        def counted(keys, *a, **kw):
            if self.on:
                self.asks.update((what, k) for k in keys_of(keys) if k in self.watch)
            return call(keys, *a, **kw)
        return counted

    def per_key(self) -> dict[str, set[int]]:
        """Per question, the set of counts the watched keys got (one number when every key was asked alike)."""
        out: dict[str, set[int]] = {}
        for what in sorted({w for w, _ in self.asks}):
            out[what] = {self.asks[(what, k)] for k in self.watch}
        return out


def _ssd_only(tmp_path, promote: bool = True) -> tuple[TieredStore, DramTier]:
    store = TieredStore.from_config({"dram_capacity": N * BB, "ssd_path": str(tmp_path), "ssd_capacity": 64 * BB,
                                     "ssd_promote": promote}, BB)
    store.put(KEYS[:N], DATA[:N])
    store.put(KEYS[N:], DATA[N:])  # DRAM is full: the first N go down to the SSD (on_evict)
    dram = store.tiers[0]
    assert store.flush(20) and not dram.contains(KEYS[:N]).any() and store.tiers[1].contains(KEYS[:N]) == [True] * N
    return store, dram


def test_a_get_of_ssd_hits_asks_dram_once_per_key_and_its_promotion_once(tmp_path):
    store, dram = _ssd_only(tmp_path)
    try:
        events: list[StoreEvent] = []
        store.add_listener(events.append)
        asks = DramAsks(dram, KEYS[:N])
        out = torch.zeros(N, BB, dtype=torch.uint8)
        asks.on = True
        hit = store.get(KEYS[:N], out)
        asks.on = False
        assert_all_hits_exact(hit, out, DATA[:N])
        # the get's walk: one read per key; the promotion: one check-and-take per key; nothing else
        assert asks.per_key() == {"get": {1}, "reserve": {1}}, asks.per_key()
        assert list(dram.contains(KEYS[:N])) == [True] * N
        assert store.stats()["promoted"] == N and store.stats()["offload"]["promoted"] == N
        assert [e for e in events if e.tier == "dram" and e.kind == "stored"] == [StoreEvent("stored", "dram",
                                                                                            KEYS[:N])]
        again = torch.zeros(N, BB, dtype=torch.uint8)
        asks.asks.clear()
        asks.on = True
        assert_all_hits_exact(store.get(KEYS[:N], again), again, DATA[:N])  # promoted: DRAM serves them now
        asks.on = False
        assert asks.per_key() == {"get": {1}}
    finally:
        store.close()


def test_without_promotion_the_get_asks_dram_once(tmp_path):
    store, dram = _ssd_only(tmp_path, promote=False)
    try:
        asks = DramAsks(dram, KEYS[:N])
        out = torch.zeros(N, BB, dtype=torch.uint8)
        asks.on = True
        assert_all_hits_exact(store.get(KEYS[:N], out), out, DATA[:N])
        asks.on = False
        assert asks.per_key() == {"get": {1}}
        assert store.stats()["promoted"] == 0 and not dram.contains(KEYS[:N]).any()
    finally:
        store.close()


def test_a_lookup_then_a_get_ask_dram_once_each(tmp_path):
    """A connector's lookup (its walk: DRAM's index once) and its later load are two calls: each asks once."""
    store, dram = _ssd_only(tmp_path)
    try:
        asks = DramAsks(dram, KEYS[:N])
        asks.on = True
        found = store.lookup_prefix(KEYS[:N])
        asks.on = False
        assert found.length == N and found.count("ssd") == N
        assert asks.per_key() == {"contains": {1}, "index": {1}}  # contains answers from the index
    finally:
        store.close()


class _MeanwhileDisk(DiskTier):
    """A DiskTier that, once it has read a block, runs ``meanwhile`` (another reader's promotion finishing
    between this get's miss in DRAM and its own promotion)."""

    meanwhile = None

    def get(self, keys, out):
        hit = super().get(keys, out)
        if self.meanwhile is not None:
            self.meanwhile, run = None, self.meanwhile
            run()
        return hit


def test_a_block_promoted_meanwhile_is_neither_stored_again_nor_counted(tmp_path):
    dram = DramTier(4 * BB, BB, policy="lru")
    disk = _MeanwhileDisk(str(tmp_path), 32 * BB, BB, segment_bytes=8 * BB)
    store = TieredStore([dram, disk], offload="on_evict", promote=True)
    try:
        store.put(KEYS[:4], DATA[:4])
        store.put(KEYS[4:8], DATA[4:8])  # 0..3 go down to the disk
        assert store.flush(20) and not dram.contains(KEYS[:4]).any()
        events: list[StoreEvent] = []
        store.add_listener(events.append)
        disk.meanwhile = lambda: dram.put(KEYS[:2], DATA[:2])  # another reader promoted 0 and 1 meanwhile
        out = torch.zeros(4, BB, dtype=torch.uint8)
        assert_all_hits_exact(store.get(KEYS[:4], out), out, DATA[:4])
        assert list(dram.contains(KEYS[:4])) == [True] * 4
        assert dram.stats().blocks == 4 and dram._table.index.live == 4  # each once (its slot map and its index)
        assert store.stats()["promoted"] == 2 and store.stats()["offload"]["promoted"] == 2
        assert [e for e in events if e.tier == "dram" and e.kind == "stored"] == [StoreEvent("stored", "dram",
                                                                                            KEYS[2:4])]
        with dram.read_views(KEYS[:4]) as views:
            assert all(torch.equal(v, d) for v, d in zip(views, DATA[:4]))
    finally:
        store.close()


def test_put_new_does_not_store_again_a_block_being_handed_down():
    """A block DRAM evicted is still held (readable) until its hand-down ends: a promotion meanwhile leaves it
    (contains said held before the promotion asked no more; put_new's reserve says so itself)."""
    dram = DramTier(2 * BB, BB, policy="lru")
    answers: list[list[int]] = []

    def on_evict(keys, views):
        assert list(dram.contains(keys)) == [True] * len(keys)
        answers.append(dram.put_new(list(keys), blocks_for(list(keys), BB)))

    from kvtier.pins import PinTable
    dram.attach(PinTable(), on_evict)
    try:
        assert dram.put_new(KEYS[:2], DATA[:2]) == [0, 1]
        assert dram.put_new(KEYS[:2], DATA[:2]) == []  # held: nothing stored now
        assert dram.put_new(KEYS[2:3], DATA[2:3]) == [0]  # evicts KEYS[0]; put_new during its hand-down
        assert answers == [[]]
        assert list(dram.contains(KEYS[:3])) == [False, True, True] and dram._table.index.live == 2
    finally:
        dram.close()


def test_concurrent_readers_of_ssd_blocks_promote_each_once(tmp_path):
    store, dram = _ssd_only(tmp_path)
    try:
        events: list[StoreEvent] = []
        lock = threading.Lock()

        def listen(e: StoreEvent) -> None:
            with lock:
                events.append(e)

        store.add_listener(listen)
        barrier = threading.Barrier(4)
        bad: list[str] = []

        def read() -> None:
            out = torch.zeros(N, BB, dtype=torch.uint8)
            barrier.wait(20)
            hit = store.get(KEYS[:N], out)
            if not all(hit) or not torch.equal(out, DATA[:N]):
                bad.append("wrong or missing bytes")

        threads = [threading.Thread(target=read) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not bad
        stored = [k for e in events if e.tier == "dram" and e.kind == "stored" for k in e.keys]
        assert sorted(stored) == sorted(KEYS[:N]), "a block promoted (announced) twice or never"
        assert store.stats()["promoted"] == N and dram._table.index.live == len(dram.keys())
        assert np.asarray(dram.contains(KEYS[:N])).all()
    finally:
        store.close()
