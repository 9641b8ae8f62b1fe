"""TieredStore with the SSD tier under DRAM: offload policies, promotion, in-flight writes, events, config."""

import threading

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from bytecheck import assert_all_hits_exact, assert_no_wrong_bytes
from conftest import blocks_for
from kvtier import Config, ConfigError, Namespace, StoreEvent, TieredStore
from kvtier.tiers.dram import DramTier
from kvtier.tiers.ssd import DiskTier

BB = 4096
KEYS = Namespace("store-ssd").keys(range(40))


def make_store(path, dram_blocks=4, ssd_blocks=64, **cfg):
    return TieredStore.from_config({"dram_capacity": dram_blocks * BB, "ssd_path": str(path),
                                    "ssd_capacity": ssd_blocks * BB, "ssd_segment_bytes": 8 * BB, **cfg}, BB)


def held_in(store, tier, keys):
    t = next(t for t in store.tiers if t.name == tier)
    return [k for k, h in zip(keys, t.contains(keys)) if h]


def test_from_config_builds_the_ssd_tier_under_dram(tmp_path):
    store = make_store(tmp_path)
    assert [t.name for t in store.tiers] == ["dram", "ssd"] and isinstance(store.tiers[1], DiskTier)
    assert store.stats()["offload"]["policy"] == "on_evict"
    store.close()
    with pytest.raises(ConfigError, match="ssd_offload: 'sometimes' is not one of"):
        Config.from_dict({"ssd_offload": "sometimes"})


def test_on_evict_writes_exactly_what_dram_evicts_and_gets_fall_through(tmp_path):
    store = make_store(tmp_path, ssd_promote=False)
    keys, data = KEYS[:10], blocks_for(KEYS[:10], BB)
    for i in range(0, 10, 2):
        store.put(keys[i:i + 2], data[i:i + 2])
    assert store.flush(10)
    assert held_in(store, "dram", keys) == keys[6:] and held_in(store, "ssd", keys) == keys[:6]
    out = torch.zeros(10, BB, dtype=torch.uint8)
    assert_all_hits_exact(store.get(keys, out), out, data)
    assert store.lookup_prefix(keys).runs == [("ssd", 6), ("dram", 4)]  # not promoted
    store.close()


def test_write_through_writes_every_put(tmp_path):
    store = make_store(tmp_path, ssd_offload="write_through")
    keys, data = KEYS[:10], blocks_for(KEYS[:10], BB)
    store.put(keys[:3], data[:3])
    assert store.flush(10)
    assert held_in(store, "ssd", keys) == keys[:3] and held_in(store, "dram", keys) == keys[:3]
    for i in range(3, 10, 4):  # batches that fit in DRAM: a block DRAM refuses is not written through
        store.put(keys[i:i + 4], data[i:i + 4])
    store.flush(10)
    assert held_in(store, "ssd", keys) == keys
    assert store.stats()["offload"]["written"] == 10  # no second write when DRAM evicts them
    store.close()


def test_second_hit_writes_only_blocks_seen_twice(tmp_path):
    store = make_store(tmp_path, ssd_offload="second_hit", ssd_promote=False)
    keys, data = KEYS[:12], blocks_for(KEYS[:12], BB)
    store.put(keys[:4], data[:4])
    store.get(keys[:2], torch.zeros(2, BB, dtype=torch.uint8))  # keys 0, 1 seen twice
    store.put(keys[4:8], data[4:8])  # evicts 0..3
    store.flush(10)
    assert held_in(store, "ssd", keys) == keys[:2]
    store.put(keys[2:4], data[2:4])  # dropped ones come back: now seen twice
    store.put(keys[8:12], data[8:12])
    store.flush(10)
    assert held_in(store, "ssd", keys) == keys[:4]
    assert store.stats()["offload"]["skipped_seen_once"] >= 6
    store.close()


def test_second_hit_counts_zero_copy_borrows_as_hits(tmp_path):
    """The vLLM connector reads DRAM hits through borrow(), not get(): those hits are sightings too."""
    store = make_store(tmp_path, dram_blocks=2, ssd_offload="second_hit", ssd_promote=False)
    keys, data = KEYS[:4], blocks_for(KEYS[:4], BB)
    store.put(keys[:1], data[:1])
    with store.borrow(keys[:2]) as addresses:
        assert addresses[0] is not None and addresses[1] is None
    store.put(keys[1:4], data[1:4])  # evicts key 0 (seen twice: a put and a borrowed hit) and key 1
    store.flush(10)
    assert held_in(store, "ssd", keys) == keys[:1]
    store.close()


def test_damaged_ssd_blocks_are_removed_events(tmp_path):
    """A block the SSD drops as damaged must leave the master's directory and the KV events like an eviction."""
    store = make_store(tmp_path, ssd_offload="write_through", ssd_promote=False, ssd_staging_bytes=0)
    events = []
    store.add_listener(events.append)
    keys, data = KEYS[:4], blocks_for(KEYS[:4], BB)
    store.put(keys, data)
    ssd = store.tiers[1]
    segment = ssd._files.path(ssd._files.place(ssd._slot_of[keys[2]])[0])
    segment.unlink()  # behind the tier's back: check() drops what lived in that segment file
    assert ssd.check() >= 1
    removed = [k for e in events if e.kind == "removed" and e.tier == "ssd" for k in e.keys]
    assert keys[2] in removed and sorted(removed) == sorted(k for k in keys if not ssd.contains([k])[0])
    store.close()


def test_promotion_brings_ssd_hits_back_to_dram(tmp_path):
    store = make_store(tmp_path, ssd_promote=True)  # off by default (kvtier/settings/ssd.py)
    keys, data = KEYS[:8], blocks_for(KEYS[:8], BB)
    store.put(keys[:4], data[:4])
    store.put(keys[4:], data[4:])  # evicts 0..3 to SSD
    store.flush(10)
    events = []
    store.add_listener(events.append)
    out = torch.zeros(2, BB, dtype=torch.uint8)
    assert_all_hits_exact(store.get(keys[:2], out), out, data[:2])
    assert store.lookup_prefix(keys[:2]).runs == [("dram", 2)]
    assert StoreEvent("stored", "dram", keys[:2]) in events
    assert store.stats()["offload"]["promoted"] == 2
    store.flush(10)
    store.put(KEYS[8:12], blocks_for(KEYS[8:12], BB))  # DRAM evicts 6, 7, 0, 1 (promoting evicted 4, 5)
    store.flush(10)
    assert store.stats()["offload"]["written"] == 8  # 0..7 once each: the promoted 0, 1 were not rewritten
    store.close()


def test_events_name_the_ssd_tier(tmp_path):
    store = make_store(tmp_path, ssd_blocks=4, ssd_promote=False)
    events = []
    store.add_listener(events.append)
    keys, data = KEYS[:12], blocks_for(KEYS[:12], BB)
    for i in range(12):
        store.put(keys[i:i + 1], data[i:i + 1])
        store.flush(10)
    stored = [k for e in events if e.kind == "stored" and e.tier == "ssd" for k in e.keys]
    removed = [k for e in events if e.kind == "removed" and e.tier == "ssd" for k in e.keys]
    assert stored == keys[:8] and removed == keys[:4]
    store.remove(keys[4:5])
    assert events[-1] == StoreEvent("removed", "ssd", keys[4:5])
    store.close()


class _GatedDisk(DiskTier):
    """A real DiskTier whose write batches wait on a gate, to hold a write in flight."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate, self.entered = threading.Event(), threading.Event()

    def _write_batch(self, keys, ptrs, *, staged):
        self.entered.set()
        assert self.gate.wait(10)
        return super()._write_batch(keys, ptrs, staged=staged)


@pytest.mark.parametrize("policy", ["write_through", "on_evict"])
def test_a_write_scheduled_before_dram_evicts_still_completes(tmp_path, policy):
    dram = DramTier(2 * BB, BB)
    disk = _GatedDisk(tmp_path, 32 * BB, BB, segment_bytes=8 * BB)
    store = TieredStore([dram, disk], offload=policy, promote=False)
    keys, data = KEYS[:6], blocks_for(KEYS[:6], BB)
    for i in range(0, 6, 2):  # DRAM evicts 0..3; their DRAM slots are reused at once
        store.put(keys[i:i + 2], data[i:i + 2])
    assert disk.entered.wait(10)
    assert held_in(store, "dram", keys) == keys[4:]
    out = torch.zeros(6, BB, dtype=torch.uint8)
    assert_all_hits_exact(store.get(keys, out), out, data)  # 0..3 served from staging
    disk.gate.set()
    assert store.flush(10)
    store.close()
    disk = DiskTier(tmp_path, 32 * BB, BB, segment_bytes=8 * BB)  # and they really are on disk
    out = torch.zeros(4, BB, dtype=torch.uint8)
    assert_all_hits_exact(disk.get(keys[:4], out), out, data[:4])
    disk.close()


class StoreWithDisk(RuleBasedStateMachine):
    """Random put/get/remove on DRAM (4 blocks) over an SSD big enough for every key: nothing put is ever lost,
    every hit is bit-exact, capacity holds in both tiers."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.TemporaryDirectory(prefix="kvtier-store-ssd-")
        self.store = make_store(self.dir.name, ssd_blocks=16, ssd_fsync=False, ssd_staging_bytes=0)
        self.keys = KEYS[:12]
        self.model: dict[bytes, bytes] = {}
        self.v = 0

    def teardown(self):
        self.store.close()
        self.dir.cleanup()

    @rule(idx=st.lists(st.integers(0, 11), min_size=1, max_size=3))
    def put(self, idx):
        self.v += 1
        ks = [self.keys[i] for i in idx]
        blocks = [bytes([(self.v + j) % 256]) * BB for j in range(len(ks))]
        before = set(self.model)
        self.store.put(ks, [bytearray(b) for b in blocks])
        for k, b in reversed(list(zip(ks, blocks))):
            if k not in before:
                self.model[k] = b

    @rule(idx=st.lists(st.integers(0, 11), min_size=1, max_size=4))
    def get(self, idx):
        ks = [self.keys[i] for i in idx]
        out = [bytearray(BB) for _ in ks]
        for k, h, o in zip(ks, self.store.get(ks, out), out):
            assert h == (k in self.model)
            if h:
                assert bytes(o) == self.model[k]

    @rule(idx=st.lists(st.integers(0, 11), min_size=1, max_size=2))
    def remove(self, idx):
        ks = [self.keys[i] for i in idx]
        self.store.remove(ks)
        for k in ks:
            self.model.pop(k, None)

    @invariant()
    def nothing_lost(self):
        assert {k for k, h in zip(self.keys, self.store.contains(self.keys)) if h} == set(self.model)
        for t in self.store.stats()["tiers"].values():
            assert t["used_bytes"] <= t["capacity_bytes"]


TestStoreWithDisk = StoreWithDisk.TestCase
TestStoreWithDisk.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


def test_tiny_blocks_for_a_replayer(tmp_path):
    """The configuration a trace replayer uses: 64 B blocks standing for real ones, capacity in blocks exact."""
    keys = Namespace("tiny").keys(range(300))
    store = TieredStore.from_config({"dram_capacity": 50 * 64, "ssd_path": str(tmp_path), "ssd_capacity": 200 * 64,
                                     "ssd_direct_io": "false", "ssd_fsync": False, "ssd_staging_bytes": 0}, 64)
    data = blocks_for(keys, 64)
    for i in range(0, 300, 10):
        store.put(keys[i:i + 10], data[i:i + 10])
    ssd = store.stats()["tiers"]["ssd"]
    assert ssd["extra"]["slot_bytes"] == 64 and ssd["capacity_bytes"] == 200 * 64 and ssd["blocks"] == 200
    out = torch.zeros(300, 64, dtype=torch.uint8)
    hit = store.get(keys, out)
    assert assert_no_wrong_bytes(hit, out, data).hits == 250
    store.close()
