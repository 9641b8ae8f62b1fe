"""One answer per key: a prefix lookup that pins in the same pass (each tier asked once), a put that asks once
(``prepare_put``) and a distributed save that asks the master nothing to decide what is held."""

from __future__ import annotations

import threading
import time
from itertools import groupby

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier.blocks import block_rows
from kvtier.client import MasterClient
from kvtier.memory.hostcopy import copy_rows
from kvtier.keys import Namespace
from kvtier.store.leases import LeaseTable
from kvtier.store import TieredStore
from kvtier.tiers.dram import DramTier
from kvtier.tiers.ssd import DiskTier
from masterproc import MasterProcess
from poolproc import PoolProcess, wait_for

BB = 4096
KEYS = Namespace("held-test").keys(range(64))


class Counted:
    """A real tier's ``contains`` wrapped to count the calls and the keys asked (instrumentation only)."""

    def __init__(self, tier) -> None:
        self.tier, self.calls, self.asked = tier, 0, 0
        real = tier.contains

        def contains(keys):
            self.calls += 1
            self.asked += len(keys)
            return real(keys)
        tier.contains = contains


@pytest.fixture
def two_tiers(tmp_path):
    dram = DramTier(16 * BB, BB, policy="lru")
    ssd = DiskTier(tmp_path / "ssd", 64 * BB, BB, segment_bytes=16 * BB, direct_io="false", staging_bytes=0)
    store = TieredStore([dram, ssd], offload="write_through")
    yield store, Counted(dram), Counted(ssd)
    store.close()


def test_a_lookup_that_leases_asks_each_tier_once_and_pins_only_the_prefix(two_tiers):
    store, dram, ssd = two_tiers
    store.put(KEYS[:12], blocks_for(KEYS[:12], BB))
    assert store.flush(10)
    store.tiers[0].remove(KEYS[4:12])  # 0-3 in DRAM (and SSD), 4-11 on the SSD only; 12- nowhere
    dram.calls = ssd.calls = dram.asked = ssd.asked = 0
    leases = LeaseTable(store)
    found = leases.lease_prefix("lookup:1", KEYS[:20], ttl_s=60)
    assert found.length == 12 and found.runs == [("dram", 4), ("ssd", 8)]
    assert (dram.calls, ssd.calls) == (1, 1)  # the old lookup_prefix + lease asked each tier twice
    assert (dram.asked, ssd.asked) == (20, 16)  # the SSD only about what DRAM lacks
    assert [store.pins.count(k) for k in KEYS[:20]] == [1] * 12 + [0] * 8
    # The same lease again adds no second pin; a release leaves no pin behind.
    assert leases.lease_prefix("lookup:1", KEYS[:20], ttl_s=60).length == 12
    assert [store.pins.count(k) for k in KEYS[:12]] == [1] * 12
    assert leases.release("lookup:1") == 12 and len(store.pins) == 0
    # Nothing held: no lease is made, no pin is left.
    assert leases.lease_prefix("lookup:2", KEYS[30:34], ttl_s=60).length == 0
    assert "lookup:2" not in leases and len(store.pins) == 0


def test_blocks_a_lookup_found_are_pinned_before_it_answers(tmp_path):
    """Pinned before the tiers are asked: puts that fill DRAM while the lookup looks evict none of what it
    reports (before, a block could be evicted between the look and the pin and the prefix came back short)."""
    dram = DramTier(8 * BB, BB, policy="lru")
    store = TieredStore([dram])
    store.put(KEYS[:4], blocks_for(KEYS[:4], BB))
    real, flooded = dram.contains, []

    def contains_while_flooded(keys):
        held = real(keys)
        if flooded:  # the flood's own puts look too
            return held
        flooded.append(True)
        flood = KEYS[40:48]  # a whole DRAM of new blocks from another thread, right after the look
        t = threading.Thread(target=store.put, args=(flood, blocks_for(flood, BB)))
        t.start()
        t.join()
        return held
    dram.contains = contains_while_flooded
    found = LeaseTable(store).lease_prefix("lookup:9", KEYS[:4], ttl_s=60)
    dram.contains = real
    assert found.length == 4
    out = torch.zeros(4, BB, dtype=torch.uint8)
    assert_all_hits_exact(store.get(KEYS[:4], out), out, blocks_for(KEYS[:4], BB))
    store.close()


@settings(max_examples=60, deadline=None)
@given(held=st.lists(st.sampled_from(["dram", "ssd", "both", "none"]), min_size=1, max_size=24),
       repeat=st.booleans())
def test_lease_prefix_is_the_first_unheld_position_and_pins_it_once(tmp_path_factory, held, repeat):
    path = tmp_path_factory.mktemp("ssd")
    dram = DramTier(32 * BB, BB, policy="lru")
    ssd = DiskTier(path, 64 * BB, BB, segment_bytes=16 * BB, direct_io="false", staging_bytes=0)
    with TieredStore([dram, ssd], offload="on_evict") as store:
        keys = KEYS[: len(held)]
        for k, where in zip(keys, held):
            if where in ("dram", "both"):
                dram.put([k], blocks_for([k], BB))
            if where in ("ssd", "both"):
                ssd.put([k], blocks_for([k], BB))
        asked = keys + keys[:3] if repeat else keys  # a key repeated past the chain: pinned once in the lease
        leases = LeaseTable(store)
        found = leases.lease_prefix("x", asked, ttl_s=60)
        expect = next((i for i, w in enumerate(held) if w == "none"), len(held))
        if repeat and expect == len(held):
            expect += min(3, len(held))
        assert found.length == expect
        names = ["dram" if w in ("dram", "both") else "ssd" for w in (held + held[:3])[:expect]]
        assert found.runs == [(t, len(list(run))) for t, run in groupby(names)]
        assert all(store.pins.count(k) == (1 if k in set(asked[:expect]) else 0) for k in keys)
        leases.release("x")
        assert len(store.pins) == 0


def test_prepare_put_answers_once_and_claims_until_written(two_tiers):
    store, dram, ssd = two_tiers
    store.put(KEYS[:2], blocks_for(KEYS[:2], BB))
    dram.calls = ssd.calls = 0
    data = blocks_for(KEYS[:6], BB)
    with store.prepare_put(KEYS[:6]) as plan:
        assert plan.fresh == [2, 3, 4, 5] and plan.skipped == 2 and plan.top_held == KEYS[:2]
        with store.prepare_put(KEYS[:6]) as other:  # a concurrent save of the same prefix writes nothing
            assert other.fresh == []
        assert plan.put([2, 3], data[2:4]).stored == 2  # in chunks
        with pytest.raises(ValueError, match="fresh positions, each once"):
            plan.put([2], data[2:3])
        with pytest.raises(ValueError, match="fresh positions"):
            plan.put([0], data[0:1])
        written: list[list[int]] = []

        def fill(index, slots):
            written.append(list(index))
            src = data[index].contiguous()
            copy_rows(slots.ptrs, block_rows(src, len(index), BB).ptrs, BB, 1)
        assert plan.put_in_place([4, 5], fill).stored == 2 and written == [[4, 5]]
    # One look per tier for the plan (DRAM about all six, the SSD about the four DRAM lacks), none after it.
    assert (dram.calls, ssd.calls) == (2, 2)  # the two plans
    out = torch.zeros(6, BB, dtype=torch.uint8)
    assert_all_hits_exact(store.get(KEYS[:6], out), out, data)
    with store.prepare_put(KEYS[:6]) as again:  # released at exit: nothing left in flight
        assert again.fresh == []
    assert store.stats()["inflight_puts"] == 0


def test_a_plan_written_whole_out_of_order_or_in_one_go_stores_each_block_under_its_key(two_tiers):
    """A write of every fresh position in another order than ``fresh`` maps each block to its own key (a whole
    put in batch order skips the plan's checks; a permutation must not take that path); one in order, too."""
    store = two_tiers[0]
    data = blocks_for(KEYS[:8], BB)
    with store.prepare_put(KEYS[:4]) as plan:
        order = [3, 1, 0, 2]
        assert plan.put(order, data[order]).stored == 4
        with pytest.raises(ValueError, match="fresh positions, each once"):
            plan.put(plan.fresh, data[:4])  # all written already
    with store.prepare_put(KEYS[4:8]) as plan:
        assert plan.put(plan.fresh, data[4:8]).stored == 4
    out = torch.zeros(8, BB, dtype=torch.uint8)
    assert store.get(KEYS[:8], out) == [True] * 8 and torch.equal(out, data)


def test_a_distributed_save_asks_the_master_nothing(tmp_path):
    """Before: every save chunk asked the master (locate) twice only to decide what was held."""
    with MasterProcess(tmp_path, lease_s=5.0) as mp, \
            PoolProcess(tmp_path, capacity="16MiB", block_bytes=BB, master=mp.endpoint,
                        args=("--heartbeat-s", "0.2")), MasterClient(mp.endpoint) as m:
        deadline = time.monotonic() + 15
        while not any(n["state"] == "live" for n in m.nodes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        cfg = {"mode": "distributed", "master": mp.endpoint, "node_id": "engine-1", "dram_capacity": 64 * BB,
               "pool_timeout_ms": 2000}

        def locates() -> int:
            return sum(m.ping()["activity"]["requests"].get("locate", {}).values())

        with TieredStore.from_config(cfg, BB) as store:
            before = locates()
            data = blocks_for(KEYS[:32], BB)
            assert store.put(KEYS[:16], data[:16]).stored == 16
            with store.prepare_put(KEYS[:32]) as plan:  # a connector's save: half already held here
                assert plan.fresh == list(range(16, 32))
                assert plan.put(plan.fresh, data[16:]).stored == 16
            assert store.flush(10)
            # An agent's session lease over the saved blocks (the connector's hints) pins the local copies only.
            store.tiers[0].remove(KEYS[28:32])  # now in the pool only
            assert store.leases.lease("session:s", KEYS[:32], ttl_s=60) == [True] * 28 + [False] * 4
            assert locates() == before  # nothing asked to decide what is held
            assert store.stats()["offloads"]["pool"]["written"] == 32  # and the write-through still went
            # Negative control: a lookup does ask the master (the pool tier is remote).
            # (The pools tell the master what they hold on their heartbeat: wait until it knows.)
            wait_for(lambda: store.lookup_prefix(KEYS[28:32]).length == 4, 15.0, "the master knows the pool's blocks")
            assert locates() > before
