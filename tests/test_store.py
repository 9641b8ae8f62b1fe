"""TieredStore: a hypothesis state machine against a plain dict model (put, put_in_place, a failing fill), concurrency,
async, events."""

import threading

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import block_for, blocks_for
import kvtier
from kvtier import Namespace, StoreEvent, StoreLookup, TieredStore
from kvtier.memory.hostcopy import copy_rows
from kvtier.tiers.dram import DramTier

BB = 256
CAPACITY = 6
KEYS = Namespace("sm").keys(range(14))


class StoreModel(RuleBasedStateMachine):
    """Random put/get/remove/pin/unpin against a model: key -> last bytes stored, pin counts.

    Blocks for one key differ between puts (a counter is mixed in), so a get returning stale or foreign
    bytes is caught; a put of a held key must leave the old bytes (it is skipped).
    """

    policy = "lru"

    def __init__(self):
        super().__init__()
        self.store = TieredStore.from_config({"dram_capacity": CAPACITY * BB, "eviction": self.policy}, BB)
        self.model: dict[bytes, bytes] = {}
        self.pins: dict[bytes, int] = {}
        self.version = 0

    def teardown(self):
        self.store.close()

    def _held(self):
        return {k for k, h in zip(KEYS, self.store.contains(KEYS)) if h}

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5), in_place=st.booleans())
    def put(self, ks, in_place):
        self.version += 1
        data = [bytes([(self.version + i) % 256]) * BB for i in range(len(ks))]
        before = self._held()
        if in_place:  # the caller writes straight into the slots: bytes in must be bytes out all the same
            res = self.store.put_in_place(ks, fill_from([bytearray(d) for d in data]))
        else:
            res = self.store.put(ks, [bytearray(d) for d in data])
        after = self._held()
        assert res.stored + res.skipped + len(res.rejected) == len(ks)
        for k, d in reversed(list(zip(ks, data))):  # the first occurrence of a repeated key wins
            if k not in before and k in after:
                self.model[k] = d
        for k in before & set(ks):
            # put_in_place never evicts the batch's own blocks to make room for its new ones.
            assert k in after or (self.pins.get(k, 0) == 0 and not in_place)
        if res.rejected:
            # Only when every slot is taken by a pinned block or by this batch's own new blocks (in place:
            # or by this batch's blocks already held).
            kept = sum(1 for k in after if self.pins.get(k, 0) > 0 or (in_place and k in before & set(ks)))
            assert kept + res.stored >= CAPACITY
        for k in set(self.model) - after:
            del self.model[k]

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def put_in_place_fill_fails(self, ks):
        before = self._held()
        stored = self.store.stats()["put_stored"]
        calls = []

        def fill(index, slots):
            calls.append(index)
            copy_rows(slots.ptrs[:1], np.array([scrap.ctypes.data], np.uint64), BB)  # half done, then fails
            raise FillFailed

        scrap = np.full(BB, 0xEE, np.uint8)
        try:
            res = self.store.put_in_place(ks, fill)
            assert not calls and res.stored == 0  # nothing to write: fill is never called
        except FillFailed:
            assert calls
        after = self._held()
        assert after <= before  # publishes nothing (its reservation may have evicted others to make room)
        assert self.store.stats()["put_stored"] == stored
        for k in set(self.model) - after:
            del self.model[k]

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def get(self, ks):
        out = [bytearray(BB) for _ in ks]
        hit = self.store.get(ks, out)
        for k, h, o in zip(ks, hit, out):
            assert h == (k in self._held() or k in self.model)
            if h:
                assert bytes(o) == self.model[k]

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def remove(self, ks):
        self.store.remove(ks)
        for k in ks:  # the pins stay: their holders unpin them later, and a put again is pinned by them
            self.model.pop(k, None)

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def pin(self, ks):
        held = self.store.pin(ks)
        for k, h in zip(ks, held):
            assert h == (k in self.model)
            if h:
                self.pins[k] = self.pins.get(k, 0) + 1

    @rule(data=st.data())
    def unpin(self, data):
        pinned = [k for k, c in self.pins.items() if c > 0]
        if not pinned:
            return
        k = data.draw(st.sampled_from(pinned))
        self.store.unpin([k])
        self.pins[k] -= 1

    @invariant()
    def capacity_never_exceeded(self):
        t = self.store.stats()["tiers"]["dram"]
        assert t["used_bytes"] <= t["capacity_bytes"] == CAPACITY * BB

    @invariant()
    def no_slot_leaked(self):
        stats = self.store.stats()
        t = stats["tiers"]["dram"]
        assert t["used_bytes"] == t["blocks"] * BB and t["extra"]["pending"] == 0 and stats["inflight_puts"] == 0

    @invariant()
    def pinned_never_evicted(self):
        held = self._held()
        assert all(k in held for k, c in self.pins.items() if c > 0 and k in self.model)

    @invariant()
    def model_matches_store(self):
        assert self._held() == set(self.model)

    @invariant()
    def lookup_prefix_consistent_with_contains(self):
        for start in (0, 3, 7):
            ks = KEYS[start:]
            held = self.store.contains(ks)
            lk = self.store.lookup_prefix(ks)
            assert lk.length == (held.index(False) if False in held else len(ks))
            assert lk.runs == ([("dram", lk.length)] if lk.length else [])


class FillFailed(Exception):
    pass


def fill_from(blocks):
    """A put_in_place fill that writes blocks[i] into the slot given for batch position i."""

    def fill(index, slots):
        src = np.array([np.frombuffer(blocks[i], np.uint8).ctypes.data for i in index], np.uint64)
        copy_rows(slots.ptrs, src, BB)

    return fill


class S3FIFOStoreModel(StoreModel):
    policy = "s3fifo"


TestStoreLRU = StoreModel.TestCase
TestStoreLRU.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestStoreS3FIFO = S3FIFOStoreModel.TestCase
TestStoreS3FIFO.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_eight_threads_put_and_get_overlapping_keys():
    keys = Namespace("conc").keys(range(40))
    data = {k: block_for(k, 4096) for k in keys}
    store = TieredStore.from_config({"dram_capacity": 24 * 4096, "eviction": "s3fifo"}, 4096)
    bad, errors = [], []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            out = torch.zeros(8, 4096, dtype=torch.uint8)
            for _ in range(150):
                start = int(rng.integers(0, 32))
                ks = keys[start:start + 8]  # overlapping prefixes, as sessions sharing a prompt
                if rng.random() < 0.5:
                    res = store.put(ks, torch.stack([data[k] for k in ks]))
                    assert res.stored + res.skipped + len(res.rejected) == 8
                else:
                    hit = store.get(ks, out)
                    bad.extend(k for k, h, o in zip(ks, hit, out) if h and not torch.equal(o, data[k]))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not bad
    s = store.stats()
    assert s["tiers"]["dram"]["used_bytes"] <= 24 * 4096 and s["inflight_puts"] == 0
    store.close()


class _GatedDram(DramTier):
    """A real DRAM tier whose put waits on a gate, to hold a put in flight."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.entered, self.gate, self.calls = threading.Event(), threading.Event(), 0

    def put(self, keys, blocks):
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(10)
        return super().put(keys, blocks)


def test_put_in_flight_is_skipped_and_costs_nothing():
    tier = _GatedDram(8 * BB, BB)
    store = TieredStore([tier])
    keys = KEYS[:4]
    first = store.put_async(keys, blocks_for(keys, BB))
    assert tier.entered.wait(10)
    second = store.put(keys, blocks_for(keys, BB))  # same prefix, another session, while the first writes
    assert (second.stored, second.skipped) == (0, 4) and tier.calls == 1
    tier.gate.set()
    assert first.result(10).stored == 4
    third = store.put(keys, blocks_for(keys, BB))
    assert (third.stored, third.skipped) == (0, 4) and tier.calls == 1
    store.close()


def test_lookup_prefix_answers_a_store_lookup_whose_old_name_still_imports_deprecated():
    store = TieredStore.from_config({"dram_capacity": 2 * BB}, BB)
    store.put(KEYS[:1], blocks_for(KEYS[:1], BB))
    assert store.lookup_prefix(KEYS[:2]) == StoreLookup(1, [("dram", 1)])
    with pytest.warns(DeprecationWarning, match="kvtier.PrefixLookup is deprecated: use kvtier.StoreLookup"):
        assert kvtier.PrefixLookup is StoreLookup
    assert "PrefixLookup" not in kvtier.__all__
    with pytest.raises(AttributeError):
        kvtier.NoSuchName  # noqa: B018


def test_async_variants_and_events():
    store = TieredStore.from_config({"dram_capacity": 2 * BB}, BB)
    events: list[StoreEvent] = []
    store.add_listener(events.append)
    keys = KEYS[:3]
    data = blocks_for(keys, BB)
    assert store.put_async(keys[:2], data[:2]).result(10).stored == 2
    out = torch.zeros(3, BB, dtype=torch.uint8)
    assert store.get_async(keys, out).result(10) == [True, True, False]
    assert store.lookup_prefix_async(keys).result(10).length == 2
    store.put(keys[2:], data[2:])  # evicts keys[0]
    store.remove(keys[1:2])
    assert events == [StoreEvent("stored", "dram", keys[:2]), StoreEvent("removed", "dram", keys[:1]),
                      StoreEvent("stored", "dram", keys[2:]), StoreEvent("removed", "dram", keys[1:2])]
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put_async(keys, data)


def test_put_reports_rejected_keys_when_all_pinned():
    store = TieredStore.from_config({"dram_capacity": 2 * BB}, BB)
    store.put(KEYS[:2], blocks_for(KEYS[:2], BB))
    assert store.pin(KEYS[:3]) == [True, True, False]
    res = store.put(KEYS[2:5], blocks_for(KEYS[2:5], BB))
    assert res.rejected == KEYS[2:5] and not res.ok and res.stored == 0
    store.unpin(KEYS[:2])
    assert store.put(KEYS[2:4], blocks_for(KEYS[2:4], BB)).stored == 2


def test_bad_keys_and_blocks_are_clear_errors():
    store = TieredStore.from_config({"dram_capacity": 2 * BB}, BB)
    with pytest.raises(ValueError, match="key 0: expected 16 bytes"):
        store.put([b"short"], blocks_for(KEYS[:1], BB))
    with pytest.raises(ValueError, match=f"expected {BB} bytes"):
        store.put(KEYS[:1], torch.zeros(1, BB + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="host tiers take CPU tensors|CPU"):
        store.put(KEYS[:1], torch.zeros(1, BB, dtype=torch.uint8, device="meta"))
    assert store.stats()["put_stored"] == 0


def test_unknown_policy_lists_known():
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo2'; known: arc, chain-lru, default, fifo, lru, pnu, s3fifo"):
        TieredStore.from_config({"eviction": "fifo2", "dram_capacity": 2 * BB}, BB)


def test_layout_dtype_checked():
    from kvtier import BlockLayout

    layout = BlockLayout.mha(1, 1, 8, "float16", 4)  # 4 tokens x 8 x 2 parts x 2 B = 128 B
    store = TieredStore.from_config({"dram_capacity": 4 * layout.nbytes}, layout)
    with pytest.raises(ValueError, match="expected dtype uint8 or float16, got float32"):
        store.put(KEYS[:1], torch.zeros(1, layout.nbytes // 4, dtype=torch.float32))
    assert store.put(KEYS[:1], torch.zeros(1, layout.nbytes // 2, dtype=torch.float16)).stored == 1
