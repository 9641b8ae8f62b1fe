"""LeaseTable over a real TieredStore: pins that expire, composed with the store's per-block pin counts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import blocks_for
from kvtier.keys import Namespace
from kvtier.store.leases import LeaseTable, session_lease
from kvtier.store import TieredStore

BLOCK = 256
KEYS = Namespace("lease-test").keys(range(12))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store():
    s = TieredStore.from_config({"dram_capacity": 64 * BLOCK}, BLOCK)
    s.put(KEYS[:10], blocks_for(KEYS[:10], BLOCK))
    yield s
    s.close()


def test_a_lease_pins_held_keys_until_it_expires(store):
    clock = Clock()
    table = LeaseTable(store, clock=clock)
    assert table.lease("s", KEYS[8:12], ttl_s=10) == [True, True, False, False]  # 10 and 11 are not held
    assert store.pins.count(KEYS[8]) == 1 and store.pins.count(KEYS[10]) == 0
    table.lease("s", KEYS[8:9], ttl_s=30)  # re-leasing extends, never pins twice
    assert store.pins.count(KEYS[8]) == 1
    clock.now = 20
    assert table.sweep() == 0 and "s" in table
    clock.now = 30
    assert table.sweep() == 1 and "s" not in table
    assert len(store.pins) == 0


def test_leases_compose_with_other_pins(store):
    table = LeaseTable(store)
    store.pin(KEYS[:2])
    table.lease("a", KEYS[:2], ttl_s=5)
    table.lease("b", KEYS[1:3], ttl_s=5)
    assert [store.pins.count(k) for k in KEYS[:3]] == [2, 3, 1]
    assert table.release("a") == 2 and table.release("a") == 0
    assert [store.pins.count(k) for k in KEYS[:3]] == [1, 2, 1]


def test_remove_leaves_a_leases_pins_to_the_lease(store):
    """A removed and re-put block keeps the lease's pin; the lease's release takes its own pin, not the one a
    loader added meanwhile (which would make a block being loaded evictable)."""
    table = LeaseTable(store)
    table.lease("session:a", KEYS[:1], ttl_s=600)
    store.remove(KEYS[:1])
    store.put(KEYS[:1], blocks_for(KEYS[:1], BLOCK))
    assert store.pin(KEYS[:1]) == [True]  # a loader pins the block put again
    assert store.pins.count(KEYS[0]) == 2
    assert table.release("session:a") == 1
    assert store.pins.count(KEYS[0]) == 1  # the loader's pin
    store.unpin(KEYS[:1])
    assert len(store.pins) == 0


def test_pinned_blocks_survive_eviction():
    store = TieredStore.from_config({"dram_capacity": 4 * BLOCK}, BLOCK)
    try:
        store.put(KEYS[:4], blocks_for(KEYS[:4], BLOCK))
        store.leases.lease("keep", KEYS[:2], ttl_s=60)
        store.put(KEYS[4:8], blocks_for(KEYS[4:8], BLOCK))  # needs room: only the unleased blocks go
        assert store.contains(KEYS[:4]) == [True, True, False, False]
    finally:
        store.close()


def test_budget_releases_lowest_priority_first(store):
    table = LeaseTable(store, max_keys=4)
    table.lease("low", KEYS[0:2], ttl_s=100, priority=0)
    table.lease("high", KEYS[2:4], ttl_s=50, priority=5)
    table.lease("mid", KEYS[4:6], ttl_s=100, priority=1)
    assert "low" not in table and "high" in table and "mid" in table
    assert table.leased_keys == 4 == len(store.pins)
    assert table.released_by_budget == 1


def test_a_lease_released_for_the_budget_reports_nothing_leased(store):
    table = LeaseTable(store, max_keys=2)
    assert table.lease("high", KEYS[0:2], ttl_s=100, priority=5) == [True, True]
    assert table.lease("low", KEYS[2:4], ttl_s=100, priority=0) == [False, False]  # it went at once
    assert "low" not in table and store.pins.count(KEYS[2]) == 0


def test_expired_leases_end_without_an_explicit_sweep():
    clock = Clock()
    store = TieredStore.from_config({"dram_capacity": 4 * BLOCK}, BLOCK)
    try:
        table = LeaseTable(store, clock=clock)
        store.put(KEYS[:4], blocks_for(KEYS[:4], BLOCK))
        table.lease("session", KEYS[:4], ttl_s=10)
        assert store.put(KEYS[4:5], blocks_for(KEYS[4:5], BLOCK)).rejected == KEYS[4:5]  # all pinned
        clock.now = 10
        # The full store releases the expired lease itself and stores the block.
        assert store.put(KEYS[4:5], blocks_for(KEYS[4:5], BLOCK)).stored == 1
        assert table.expired == 1 and len(store.pins) == 0
        table.lease("again", KEYS[1:3], ttl_s=5)
        clock.now = 15
        assert store.stats()["pinned_keys"] == 0  # stats count live pins only
        table.lease("third", KEYS[1:2], ttl_s=5)
        clock.now = 20
        assert "third" not in table and table.keys_of("third") == set() and len(table) == 0
        assert table.leased_keys == 0
    finally:
        store.close()


def test_ttl_must_be_positive(store):
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        LeaseTable(store).lease("x", KEYS[:1], ttl_s=0)


def test_a_hold_keeps_a_lease_past_its_own_expiry_and_unhold_gives_it_back(store):
    clock = Clock()
    table = LeaseTable(store, clock=clock)
    table.lease("s", KEYS[:2], ttl_s=10)
    table.hold("s", ttl_s=100)
    clock.now = 50
    assert "s" in table and store.pins.count(KEYS[0]) == 1
    assert table.expires_in("s") == 50
    table.hold("s", ttl_s=20)  # a new hold replaces the old one, shorter or not
    assert table.expires_in("s") == 20
    assert table.unhold("s") and not table.unhold("s")
    assert "s" not in table and len(store.pins) == 0  # back on its own expiry, long past
    table.lease("t", KEYS[:1], ttl_s=10)
    table.hold("t", ttl_s=100)
    clock.now = 70
    table.hold("t", ttl_s=100, keep=False)  # ranks only: the lease is back on its own expiry, long past
    assert "t" not in table and len(store.pins) == 0


def test_a_hold_applies_to_a_lease_created_later_until_it_ends(store):
    clock = Clock()
    table = LeaseTable(store, clock=clock)
    table.hold(session_lease("agent-7"), ttl_s=300, priority=2)
    assert len(table) == 0 and len(store.pins) == 0  # a hold pins nothing itself
    table.lease(session_lease("agent-7"), KEYS[:3], ttl_s=5)
    clock.now = 299
    assert table.keys_of(session_lease("agent-7")) == set(KEYS[:3])
    clock.now = 300
    assert table.sweep() == 1 and len(store.pins) == 0
    table.lease(session_lease("agent-7"), KEYS[:1], ttl_s=5)  # the hold is over: its own TTL again
    assert table.expires_in(session_lease("agent-7")) == 5


def test_a_held_priority_ranks_the_lease_in_the_budget(store):
    clock = Clock()
    table = LeaseTable(store, max_keys=4, clock=clock)
    table.hold("vip", ttl_s=50, priority=9, keep=False)  # ranks only: the lease still ends at its own TTL
    table.lease("vip", KEYS[0:2], ttl_s=10)
    table.lease("other", KEYS[2:4], ttl_s=100, priority=1)
    table.lease("third", KEYS[4:6], ttl_s=100, priority=1)
    assert "vip" in table and "other" not in table and "third" in table
    clock.now = 10
    assert "vip" not in table  # keep=False: the hold did not extend it


def test_release_keys_keeps_the_rest_of_the_lease(store):
    table = LeaseTable(store)
    table.lease("p", KEYS[:3], ttl_s=10)
    assert table.release_keys("p", [KEYS[0], KEYS[0], KEYS[9]]) == 1
    assert table.keys_of("p") == set(KEYS[1:3]) and store.pins.count(KEYS[0]) == 0 and table.leased_keys == 2
    assert table.release_keys("p", KEYS[1:3]) == 2
    assert "p" not in table and len(store.pins) == 0
    assert table.release_keys("p", KEYS[:1]) == 0


def test_hold_ttl_must_be_positive(store):
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        LeaseTable(store).hold("x", ttl_s=0)


ops = st.lists(st.one_of(
    st.tuples(st.just("lease"), st.sampled_from("abcd"), st.lists(st.integers(0, 11), max_size=6),
              st.floats(0.5, 20), st.integers(0, 3)),
    st.tuples(st.just("release"), st.sampled_from("abcd")),
    st.tuples(st.just("release_keys"), st.sampled_from("abcd"), st.lists(st.integers(0, 11), max_size=4)),
    st.tuples(st.just("hold"), st.sampled_from("abcd"), st.floats(0.5, 30), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("unhold"), st.sampled_from("abcd")),
    st.tuples(st.just("advance"), st.floats(0, 10)),
), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=ops, budget=st.sampled_from([0, 3, 6]))
def test_pin_counts_always_equal_live_leases(ops, budget):
    """Invariant: a key's pin count is the number of live leases holding it; the budget always holds; no live
    lease has ended (holds included)."""
    store = TieredStore.from_config({"dram_capacity": 64 * BLOCK}, BLOCK)
    try:
        store.put(KEYS[:10], blocks_for(KEYS[:10], BLOCK))
        clock = Clock()
        table = LeaseTable(store, max_keys=budget, clock=clock)
        for op in ops:
            if op[0] == "lease":
                _, name, idx, ttl, prio = op
                got = table.lease(name, [KEYS[i] for i in idx], ttl, prio)
                assert all(not g for g, i in zip(got, idx) if i >= 10)  # never pins what the store lacks
                assert got == [KEYS[i] in table.keys_of(name) for i in idx]  # True: leased afterwards
            elif op[0] == "release":
                table.release(op[1])
            elif op[0] == "release_keys":
                table.release_keys(op[1], [KEYS[i] for i in op[2]])
            elif op[0] == "hold":
                _, name, ttl, prio, keep = op
                table.hold(name, ttl, prio, keep=keep)
            elif op[0] == "unhold":
                table.unhold(op[1])
            else:
                clock.now += op[1]  # no sweep: the table's own calls below release what expired
            if budget:
                assert table.leased_keys <= budget
            live = {n: table.keys_of(n) for n in "abcd" if n in table}
            assert all(table.expires_in(n) > 0 for n in live)
            for k in KEYS:
                assert store.pins.count(k) == sum(k in keys for keys in live.values())
        for name in "abcd":
            table.release(name)
        assert len(store.pins) == 0
    finally:
        store.close()
