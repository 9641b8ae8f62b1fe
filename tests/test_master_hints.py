"""kvtier-master's hints on a node: StoreHints turns pins, session pins and priorities into leases of a real
TieredStore, first driven directly (injected clocks), then end to end through a real master subprocess and a
NodeAgent."""

from __future__ import annotations

import pytest

from conftest import blocks_for
from kvtier import TieredStore
import kvtier.client
from kvtier.client import MasterClient, MasterHints, NodeAgent, StoreHints
from kvtier.keys import Namespace
from kvtier.store.leases import LeaseTable, session_lease
from masterproc import MasterProcess
from poolproc import wait_for

BB = 4096
KEYS = Namespace("hints-test").keys(range(64))
AGENT_7 = session_lease("agent-7")


def test_the_old_sdk_names_still_import_with_a_deprecation_warning() -> None:
    new = {"Hints": "MasterHints", "LookupResult": "MasterLookup", "PrefixHit": "NodeTierHit"}
    for old, name in new.items():
        with pytest.warns(DeprecationWarning, match=f"kvtier.client.{old} is deprecated: use kvtier.client.{name}"):
            assert getattr(kvtier.client, old) is getattr(kvtier.client, name)
    assert not set(new) & set(kvtier.client.__all__)
    with pytest.raises(AttributeError):
        kvtier.client.NoSuchName  # noqa: B018


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_store(blocks: int = 8, clock: Clock | None = None) -> TieredStore:
    """A DRAM-only store of ``blocks`` blocks holding KEYS[:blocks]; its leases run on ``clock``."""
    s = TieredStore.from_config({"dram_capacity": blocks * BB}, BB)
    if clock is not None:
        s.leases = LeaseTable(s, clock=clock)
    s.put(KEYS[:blocks], blocks_for(KEYS[:blocks], BB))
    return s


@pytest.fixture
def node():
    """(store of 8 blocks, its StoreHints with a budget of 4 keys, one clock for the leases and the master)."""
    clock = Clock(1000.0)
    s = make_store(8, clock)
    yield s, StoreHints(s, hint_max_fraction=0.5, wall=clock), clock
    s.close()


def pressure(s: TieredStore, start: int, n: int = 8) -> None:
    """Put ``n`` new blocks: everything unpinned in an 8-block DRAM makes room for them."""
    s.put(KEYS[start : start + n], blocks_for(KEYS[start : start + n], BB))


def pins(s: TieredStore, keys) -> list[int]:
    return [s.pins.count(k) for k in keys]


# ---- StoreHints, driven directly ----------------------------------------------------------------------------

def test_the_store_gets_a_budget_unless_it_has_one():
    s = make_store(8)
    try:
        StoreHints(s, hint_max_fraction=0.5)
        assert s.leases.max_keys == 4
        s.leases.max_keys = 6  # e.g. the vLLM connector's hint_max_fraction
        StoreHints(s, hint_max_fraction=0.5)
        assert s.leases.max_keys == 6
        with pytest.raises(ValueError, match="hint_max_fraction"):
            StoreHints(s, hint_max_fraction=2)
    finally:
        s.close()


def test_key_pins_end_at_their_expiry_without_new_hints(node):
    s, hints, clock = node
    hints.apply(MasterHints(1, key_pins={KEYS[0]: 1100.0, KEYS[1]: 1100.0, KEYS[2]: 1200.0}))
    assert pins(s, KEYS[:4]) == [1, 1, 1, 0] and len(s.leases) == 2  # one lease per pin call
    pressure(s, 8)
    assert s.contains(KEYS[:3]) == [True] * 3
    clock.now = 1100  # no hints arrive: the first pin's lease ends by itself
    pressure(s, 16)
    assert s.contains(KEYS[:3]) == [False, False, True]


def test_key_pins_respect_the_budget_and_priorities(node):
    s, hints, clock = node
    soon, late = {k: 1100.0 for k in KEYS[:3]}, {k: 1200.0 for k in KEYS[3:6]}
    hints.apply(MasterHints(1, key_pins={**soon, **late}))
    assert pins(s, KEYS[:6]) == [0, 0, 0, 1, 1, 1]  # 6 keys > the budget of 4: the lease ending sooner went
    hints.apply(MasterHints(2, key_pins={**soon, **late}, key_priority={k: (5, float("inf")) for k in KEYS[:3]}))
    assert pins(s, KEYS[:6]) == [1, 1, 1, 0, 0, 0]  # the first pin ranks higher now
    hints.apply(MasterHints(3, key_pins=late))  # the master unpins the first: the budget-dropped one is not retried
    assert len(s.pins) == 0 and len(s.leases) == 0


def test_a_repinned_key_moves_to_its_new_lease_without_being_unpinned(node):
    s, hints, clock = node
    hints.apply(MasterHints(1, key_pins={KEYS[0]: 1500.0, KEYS[1]: 1500.0}))
    unpin = s.unpin

    def checked_unpin(keys):
        assert all(s.pins.count(k) >= 2 for k in keys), "a moved key was unpinned before its new lease pinned it"
        unpin(keys)

    s.unpin = checked_unpin
    hints.apply(MasterHints(2, key_pins={KEYS[0]: 1100.0, KEYS[1]: 1500.0}))  # KEYS[0] re-pinned, shorter
    s.unpin = unpin
    assert pins(s, KEYS[:2]) == [1, 1] and len(s.leases) == 2
    clock.now = 1100
    assert pins(s, KEYS[:2]) == [1, 1] and s.leases.sweep() == 1 and pins(s, KEYS[:2]) == [0, 1]


def test_keys_the_store_lacks_are_pinned_when_the_hints_change_after_they_arrive(node):
    s, hints, clock = node
    new = KEYS[40]
    hints.apply(MasterHints(1, key_pins={new: 1500.0}))
    assert s.pins.count(new) == 0 and len(s.leases) == 0  # no empty lease for a key not held
    s.put([new], blocks_for([new], BB))
    hints.apply(MasterHints(2, key_pins={new: 1500.0, KEYS[7]: 1500.0}))
    assert pins(s, [new, KEYS[7]]) == [1, 1]


def test_a_session_pin_holds_the_sessions_lease_and_unpin_gives_it_back(node):
    s, hints, clock = node
    s.leases.lease(AGENT_7, KEYS[:4], ttl_s=10)  # the connector's own hint: 10 s
    hints.apply(MasterHints(1, session_pins={"agent-7": 1300.0}))  # the router: agent-7 is back within 5 minutes
    clock.now = 1100
    pressure(s, 8)
    assert s.contains(KEYS[:4]) == [True] * 4 and s.leases.expires_in(AGENT_7) == 200
    hints.apply(MasterHints(2))  # the router unpins it: the lease's own 10 s are long over
    assert AGENT_7 not in s.leases and len(s.pins) == 0


def test_a_session_pin_applies_to_the_lease_the_connector_creates_later(node):
    s, hints, clock = node
    hints.apply(MasterHints(1, session_pins={"agent-7": float("inf")}, session_priority={"agent-7": (3, 1500.0)}))
    s.leases.lease(AGENT_7, KEYS[:2], ttl_s=10)
    s.leases.lease("session:other", KEYS[2:4], ttl_s=600, priority=1)
    s.leases.lease("session:third", KEYS[4:6], ttl_s=600, priority=1)  # over the budget of 4
    assert AGENT_7 in s.leases and "session:other" not in s.leases  # agent-7 ranks 3 through the master
    clock.now = 100_000
    assert AGENT_7 in s.leases  # pinned until unpinned
    hints.apply(MasterHints(2, session_priority={"agent-7": (3, float("inf"))}))  # priority only now
    assert AGENT_7 not in s.leases and len(s.leases) == 0


# ---- end to end: a real kvtier-master, a node's store through its NodeAgent -------------------------------

@pytest.fixture
def master(tmp_path):
    with MasterProcess(tmp_path, lease_s=1.0) as mp:
        yield mp


def test_master_session_pin_keeps_a_nodes_session_blocks_until_its_ttl(master):
    """The node's leases run on an injected clock: the TTL passes without sleeping and without any message
    from the master, which still holds the pin (60 s of real time)."""
    clock = Clock()
    s = make_store(8, clock)
    agent = NodeAgent.for_store(s, master.endpoint, "w1", heartbeat_s=0.05).start()
    try:
        s.leases.lease(AGENT_7, KEYS[:4], ttl_s=5)  # what the connector does for kvtier.session = agent-7
        with MasterClient(master.endpoint) as m:
            assert m.pin(session="agent-7", ttl_s=60) == 1
        wait_for(lambda: s.leases.expires_in(AGENT_7) > 50, what="the session pin to reach the node")
        clock.now = 30  # the connector's 5 s are over; the master's 60 s are not
        pressure(s, 8)
        assert s.contains(KEYS[:4]) == [True] * 4
        clock.now = 61
        pressure(s, 16)
        assert s.contains(KEYS[:4]) == [False] * 4 and len(s.pins) == 0
    finally:
        agent.close(), s.close()


def test_master_key_pins_respect_the_node_budget_and_unpin_releases(master):
    s = make_store(8)
    agent = NodeAgent.for_store(s, master.endpoint, "w1", heartbeat_s=0.05).start()  # budget: 4 of 8 blocks
    try:
        with MasterClient(master.endpoint) as m:
            m.pin(KEYS[:3], ttl_s=60)
            m.pin(KEYS[3:6], ttl_s=120)
            wait_for(lambda: pins(s, KEYS[:6]) == [0, 0, 0, 1, 1, 1], what="the later pin to win the budget")
            m.priority(5, KEYS[:3], ttl_s=60)
            wait_for(lambda: pins(s, KEYS[:6]) == [1, 1, 1, 0, 0, 0], what="the higher priority to win")
            pressure(s, 8)
            assert s.contains(KEYS[:3]) == [True] * 3
            m.unpin(KEYS[:3])
            wait_for(lambda: len(s.pins) == 0, what="the unpin to release the lease")
    finally:
        agent.close(), s.close()
